"""Draft heads (minispec/heads): the models' hidden states, published EAGLE and Medusa layouts against
straightforward re-implementations, exactness of decoding with a head (greedy = plain in three dtypes,
batch = alone, sampled = the target's joint distribution), bad head folders, and training."""

import contextlib
import copy
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import save_reference, spread_init
from test_speculative import assert_sampled_from, exact_joint

import minispec
from minispec.models.base import Feed
from minispec.loaders import load_draft
from minispec.heads import is_head_dir
from minispec.loading.weights import save_safetensors
from minispec.models.base import CachedLM
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [1, 5, 9, 12, 5, 9, 30, 31]


def randn(generator, *shape):
    return torch.randn(*shape, generator=generator) / shape[-1] ** 0.5


def write_eagle(directory, hf, seed=0, scale=1.0):
    """A random EAGLE-1/2 head for a target with config.json `hf`, as EAGLE's authors publish them:
    a Llama config of one layer, fc with a bias, layers.0.* in Hugging Face names, no input norm."""
    dim, heads, kv, inter = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["intermediate_size"]
    hd, g = dim // heads, torch.Generator().manual_seed(seed)
    weights = {"fc.weight": randn(g, dim, 2 * dim) * scale, "fc.bias": randn(g, dim),
               "layers.0.self_attn.q_proj.weight": randn(g, heads * hd, dim),
               "layers.0.self_attn.k_proj.weight": randn(g, kv * hd, dim),
               "layers.0.self_attn.v_proj.weight": randn(g, kv * hd, dim),
               "layers.0.self_attn.o_proj.weight": randn(g, dim, heads * hd),
               "layers.0.mlp.gate_proj.weight": randn(g, inter, dim), "layers.0.mlp.up_proj.weight": randn(g, inter, dim),
               "layers.0.mlp.down_proj.weight": randn(g, dim, inter),
               "layers.0.post_attention_layernorm.weight": 1 + 0.1 * randn(g, dim),
               "embed_tokens.weight": randn(g, hf["vocab_size"], dim)}  # some heads carry the target's: unused
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, directory / "model.safetensors")
    config = {key: hf[key] for key in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                       "intermediate_size", "rms_norm_eps", "vocab_size")}
    config.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1, bias=True,
                  max_position_embeddings=2048, rope_theta=10000.0)
    (directory / "config.json").write_text(json.dumps(config))
    return directory, weights, config


def reduce_vocab(source, directory, ids):
    """A copy of the EAGLE head in `source` whose q covers only the token ids `ids` (minispec's reduced
    draft vocabulary: config.json's minispec_draft_vocab, the int64 tensor draft_vocab)."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = load_file(source / "model.safetensors")
    save_safetensors({**weights, "draft_vocab": torch.tensor(ids, dtype=torch.long)}, directory / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "minispec_draft_vocab": len(ids)}))
    return directory


def write_eagle3(directory, hf, seed=0, draft_vocab=None, layer_ids=None, dim=None, sharpness=4.0):
    """A random EAGLE-3 head for a target with config.json `hf`, as EAGLE's authors publish them: fc over
    the target's states at len(layer_ids) layers (default 3), midlayer.* whose q/k/v read [embedding,
    state] (2 dim), hidden_norm, its own norm and lm_head over the token ids `draft_vocab` (d2t: their
    offsets; t2d: their mask; `sharpness` scales it), and its own embedding when `dim` is narrower than
    the target's."""
    target_dim, vocab = hf["hidden_size"], hf["vocab_size"]
    dim, ids = dim or target_dim, list(range(vocab)) if draft_vocab is None else draft_vocab
    heads, kv, inter, g = 4, 2, 2 * (dim or target_dim), torch.Generator().manual_seed(seed)
    hd, taps = dim // heads, 3 if layer_ids is None else len(layer_ids)
    weights = {"fc.weight": randn(g, dim, taps * target_dim),
               "midlayer.self_attn.q_proj.weight": randn(g, heads * hd, 2 * dim),
               "midlayer.self_attn.k_proj.weight": randn(g, kv * hd, 2 * dim),
               "midlayer.self_attn.v_proj.weight": randn(g, kv * hd, 2 * dim),
               "midlayer.self_attn.o_proj.weight": randn(g, dim, heads * hd),
               "midlayer.mlp.gate_proj.weight": randn(g, inter, dim), "midlayer.mlp.up_proj.weight": randn(g, inter, dim),
               "midlayer.mlp.down_proj.weight": randn(g, dim, inter),
               "midlayer.hidden_norm.weight": 1 + 0.1 * randn(g, dim), "midlayer.input_layernorm.weight": 1 + 0.1 * randn(g, dim),
               "midlayer.post_attention_layernorm.weight": 1 + 0.1 * randn(g, dim), "norm.weight": 1 + 0.1 * randn(g, dim),
               "lm_head.weight": randn(g, len(ids), dim) * sharpness, "d2t": torch.tensor(ids) - torch.arange(len(ids)),
               "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(ids), True),
               "embed_tokens.weight": randn(g, vocab, dim)}  # the target's copy, or (narrower) the head's own
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, directory / "model.safetensors")
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": dim,
              "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "vocab_size": vocab, "draft_vocab_size": len(ids),
              "max_position_embeddings": 2048, "rope_theta": 10000.0, "tie_word_embeddings": False}
    if dim != target_dim:
        config["target_hidden_size"] = target_dim
    if layer_ids is not None:
        config["eagle_aux_hidden_state_layer_ids"] = layer_ids
    (directory / "config.json").write_text(json.dumps(config))
    return directory, weights, config


def write_medusa(directory, dim, vocab, heads=3, seed=0):
    """Random Medusa-1 heads as published: {head}.0.linear.weight/bias and {head}.1.weight."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for i in range(heads):
        weights[f"{i}.0.linear.weight"], weights[f"{i}.0.linear.bias"] = randn(g, dim, dim), randn(g, dim)
        weights[f"{i}.1.weight"] = randn(g, vocab, dim) * 4
    directory.mkdir(parents=True, exist_ok=True)
    save_safetensors(weights, directory / "medusa_lm_head.safetensors")
    (directory / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": 1,
                                                       "base_model_name_or_path": "tiny"}))
    return directory, weights


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5_v1_0"])
def test_hidden_states_are_what_the_head_reads(reference_dirs, kind):
    """decode_rows(hidden=True): the same logits, and hidden states whose logits they are, bit for bit;
    a wide forward's states are each its 1-token forward's (row invariance)."""
    model = minispec.load(reference_dirs[kind][1])
    prompt = torch.tensor([PROMPT])
    model.ensure_caches(1, 32)
    model.prepare_batch(1, prompt.shape[1])
    start = model.encode_row(0, prompt).view(1, -1)
    tokens = torch.cat([start, torch.tensor([[7, 8, 9, 10]])], dim=1)
    with torch.inference_mode():
        plain = model.decode_rows(Feed(tokens, [0]), eager=True)
        logits, hidden = model.decode_rows(Feed(tokens, [0]), eager=True, hidden=True)
        assert torch.equal(plain, logits) and torch.equal(model.logits(hidden), logits)
        n = tokens.shape[1]
        model.decode_rows(Feed(tokens[:, :n - 2], [0]), eager=True)
        for j in range(n - 2, n):  # the last two tokens one at a time
            _, alone = model.decode_rows(Feed(tokens[:, j:j + 1], [j]), eager=True, hidden=True)
            assert torch.equal(alone[0, 0], hidden[0, j])


def test_published_eagle_layout_drafts_as_a_straightforward_reimplementation(reference_dirs, tmp_path):
    """An EAGLE head in its authors' layout against the same math written out with the reference's own
    Llama layer: f̂ = Layer(fc([embed(x_{i+1}), f_i])), layer 0 without its input norm, the target's head."""
    reference, directory = reference_dirs["llama_gqa"]
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    head_dir, weights, config = write_eagle(tmp_path / "eagle", hf)
    head = minispec.load_draft_head(head_dir, target, quantize=None)  # the float math, as written
    tokens = torch.tensor([PROMPT + [40, 41, 42]])
    with torch.no_grad():
        states = reference(tokens, output_hidden_states=True).hidden_states[-1]  # after the final norm
        layer_model = transformers.LlamaModel(transformers.LlamaConfig(**{**config, "num_hidden_layers": 1})).eval()
        layer_model.load_state_dict({k: v for k, v in weights.items() if k.startswith("layers.")}, strict=False)
        layer_model.layers[0].input_layernorm, layer_model.norm = torch.nn.Identity(), torch.nn.Identity()
        pairs = F.linear(torch.cat([reference.model.embed_tokens(tokens[:, 1:]), states[:, :-1]], -1),
                         weights["fc.weight"], weights["fc.bias"])
        expected = layer_model(inputs_embeds=pairs).last_hidden_state
        expected_logits = reference.lm_head(expected)
    head.ensure_caches(1, 32)
    with torch.inference_mode():
        logits, predicted = head.decode_rows(Feed(tokens[:, 1:], [0], inputs=states[:, :-1]), eager=True, hidden=True)
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


def eagle3_reference(weights, config, embedded, fused):
    """EAGLE-3's layer written out (eagle/model/cnets.py's LlamaDecoderLayeremb and Model, on one
    sequence without a cache): [norm(embedding), norm(state)] -> attention, state + it, + the MLP; the
    head's norm and lm_head; the draft tokens' logits placed at their target ids, -inf elsewhere."""
    def norm(x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config["rms_norm_eps"]) * weights[name]

    def w(name):
        return weights[f"midlayer.{name}.weight"]
    n, heads, kv = fused.shape[1], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // heads
    both = torch.cat([norm(embedded, "midlayer.input_layernorm.weight"), norm(fused, "midlayer.hidden_norm.weight")], -1)
    q, k, v = (F.linear(both, w(f"self_attn.{p}_proj")).view(1, n, -1, hd).transpose(1, 2) for p in "qkv")
    inv = 1.0 / config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)
    angles = torch.outer(torch.arange(n).float(), inv).repeat(1, 2)

    def rope(x):
        return x * angles.cos() + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * angles.sin()
    k, v = (t.repeat_interleave(heads // kv, dim=1) for t in (rope(k), v))
    attended = F.scaled_dot_product_attention(rope(q), k, v, is_causal=True).transpose(1, 2).reshape(1, n, -1)
    residual = norm(fused, "midlayer.hidden_norm.weight") if config.get("norm_before_residual") else fused
    x = residual + F.linear(attended, w("self_attn.o_proj"))
    h = norm(x, "midlayer.post_attention_layernorm.weight")
    x = x + F.linear(F.silu(F.linear(h, w("mlp.gate_proj"))) * F.linear(h, w("mlp.up_proj")), w("mlp.down_proj"))
    drafted = F.linear(norm(x, "norm.weight"), weights["lm_head.weight"])
    ids = torch.arange(drafted.shape[-1]) + weights["d2t"]
    logits = torch.full((1, n, config["vocab_size"]), float("-inf"))
    logits[..., ids] = drafted
    return x, logits


@pytest.fixture(scope="module")
def deep_target(tmp_path_factory):
    """A tiny Llama of 8 layers: EAGLE-3's default taps (the states entering layers 2, 4 and 5) exist."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    reference = spread_init(transformers.LlamaForCausalLM(config).eval(), 0)
    return reference, save_reference(reference, tmp_path_factory.mktemp("deep"))


@pytest.mark.parametrize("variant", ["as wide as the target", "narrower, own embedding", "norm before residual"])
def test_published_eagle3_layout_drafts_as_a_straightforward_reimplementation(deep_target, tmp_path, variant):
    """An EAGLE-3 head in its authors' layout: the target's states entering layers 2, L/2 and L-3 are the
    reference's hidden_states there; fused by fc, paired with the next token's embedding (the target's,
    or the narrower head's own), through EAGLE-3's layer (whose residual is the normed state where the
    config says norm_before_residual), its logits those of the math written out."""
    narrow = variant == "narrower, own embedding"
    reference, directory = deep_target
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    ids = list(range(1, 64, 3))
    head_dir, weights, config = write_eagle3(tmp_path / "eagle3", hf, draft_vocab=ids, dim=16 if narrow else None)
    if variant == "norm before residual":
        config["norm_before_residual"] = True
        (head_dir / "config.json").write_text(json.dumps(config))
    head = minispec.load_draft_head(head_dir, target, quantize=None)  # the float math, as written
    assert head.taps == (2, 4, 5) and head.draft_vocab.tolist() == ids
    tokens = torch.tensor([PROMPT + [40, 41, 42]])
    target.ensure_caches(1, 32)
    head.ensure_caches(1, 32)
    with torch.no_grad():
        wanted = torch.cat([reference(tokens, output_hidden_states=True).hidden_states[j] for j in (2, 4, 5)], -1)
        embedding = weights["embed_tokens.weight"] if narrow else reference.model.embed_tokens.weight
        fused = F.linear(wanted[:, :-1], weights["fc.weight"])
        expected, expected_logits = eagle3_reference(weights, config, F.embedding(tokens[:, 1:], embedding), fused)
    with torch.inference_mode():
        logits, states = target.decode_rows(Feed(tokens, [0]), eager=True, hidden=head.taps)
        torch.testing.assert_close(logits, target.decode_rows(Feed(tokens, [0]), eager=True), rtol=0, atol=0)
        torch.testing.assert_close(states, wanted, rtol=1e-4, atol=1e-4)
        logits, predicted = head.decode_rows(Feed(tokens[:, 1:], [0], inputs=head.fuse(states[:, :-1])), eager=True, hidden=True)
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_greedy_with_an_eagle3_head_on_its_default_layers_is_plain_greedy(deep_target, tmp_path, dtype):
    """The head reading layers 2, 4 and 5 of 8, chains and trees: plain greedy's tokens."""
    directory = deep_target[1]
    target = minispec.load(directory, dtype=dtype)
    head_dir, _, _ = write_eagle3(tmp_path / "eagle3", json.loads((directory / "config.json").read_text()),
                                  draft_vocab=list(range(0, 64, 2)))
    head = minispec.load_draft_head(head_dir, target)
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    for settings in ({"gamma": 1}, {"gamma": 3}, {"gamma": "auto"}, {"gamma": 3, "tree": 8}):
        out = minispec.generate(target, PROMPT, draft=head, max_new_tokens=30, ignore_eos=True, **settings)
        assert out.tokens == plain.tokens, settings
        assert settings["gamma"] == "auto" or out.stats["proposed"] > 0
    with pytest.raises(ValueError, match="on_states cannot be given with a draft head"):
        minispec.generate(target, PROMPT, draft=head, on_states=print)


def test_published_medusa_layout_drafts_as_a_straightforward_reimplementation(reference_dirs, tmp_path):
    """Medusa-1 heads in their authors' layout: head j's logits are W_j (f + SiLU(A_j f + b_j))."""
    reference, directory = reference_dirs["llama_gqa"]
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    head_dir, weights = write_medusa(tmp_path / "medusa", hf["hidden_size"], hf["vocab_size"])
    heads = minispec.load_draft_head(head_dir, target)
    state = torch.randn(hf["hidden_size"])
    expected = torch.stack([F.linear(state + F.silu(F.linear(state, weights[f"{j}.0.linear.weight"],
                                                             weights[f"{j}.0.linear.bias"])), weights[f"{j}.1.weight"])
                            for j in range(3)])
    torch.testing.assert_close(heads(state, 3), expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def gqa_heads(reference_dirs, tmp_path_factory):
    """For each dtype: the tiny GQA llama target and its random EAGLE, EAGLE-3 and Medusa heads."""
    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    eagle_dir, _, _ = write_eagle(tmp_path_factory.mktemp("eagle"), hf)
    reduced_dir = reduce_vocab(eagle_dir, tmp_path_factory.mktemp("reduced"), list(range(0, hf["vocab_size"], 3)))
    medusa_dir, _ = write_medusa(tmp_path_factory.mktemp("medusa"), hf["hidden_size"], hf["vocab_size"])
    # two layers: EAGLE-3's default taps do not exist, the config names the states entering both
    eagle3_dir, _, _ = write_eagle3(tmp_path_factory.mktemp("eagle3"), hf, draft_vocab=list(range(1, hf["vocab_size"], 2)),
                                    layer_ids=[0, 1])
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        target = minispec.load(directory, dtype=dtype)
        out[dtype] = target, {"eagle": minispec.load_draft_head(eagle_dir, target),
                              "eagle_reduced": minispec.load_draft_head(reduced_dir, target),
                              "medusa": minispec.load_draft_head(medusa_dir, target),
                              "eagle3": minispec.load_draft_head(eagle3_dir, target)}
    return out


def test_each_medusa_head_keeps_its_own_costs(reference_dirs, tmp_path):
    """gamma="auto"'s costs for two different Medusa heads of one target: two stored profiles and two
    in this process (Medusa heads have no model of their own: their weights tell them apart); heads
    not loaded from a folder keep theirs in this process only."""
    from minispec.decoding import policy, profiles

    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    target = minispec.load(directory)
    heads = [minispec.load_draft_head(write_medusa(tmp_path / f"m{seed}", hf["hidden_size"], hf["vocab_size"],
                                                   seed=seed)[0], target) for seed in (0, 1)]
    keys = [profiles.pair_key(target, head.drafter(), None, 4) for head in heads]
    assert None not in keys and keys[0] != keys[1]
    assert policy.profile_for(target, heads[0].drafter(), None, 4) is policy.profile_for(target, heads[0].drafter(), None, 4)
    assert policy.profile_for(target, heads[0].drafter(), None, 4) is not policy.profile_for(target, heads[1].drafter(), None, 4)
    unsaved = copy.deepcopy(heads[0])
    unsaved.fingerprint = None
    assert profiles.pair_key(target, unsaved.drafter(), None, 4) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["eagle", "eagle_reduced", "eagle3", "medusa"])
def test_greedy_with_a_head_is_plain_greedy(gqa_heads, kind, dtype):
    target, heads = gqa_heads[dtype]
    plain = minispec.generate(target, PROMPT, max_new_tokens=40, ignore_eos=True)
    for gamma in (1, 3, "auto"):
        out = minispec.generate(target, PROMPT, draft=heads[kind], gamma=gamma, max_new_tokens=40, ignore_eos=True)
        assert out.tokens == plain.tokens, (gamma, out.stats)
        assert gamma == "auto" or out.stats["proposed"] > 0 and out.stats["draft_calls"] > 0


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_batched_rows_draft_as_alone(gqa_heads, kind):
    """Rows of a batch with a head: each request's tokens those it gets alone (greedy, and sampled for a
    seed with a fixed gamma); under gamma="auto" (rows choosing their own guesses) greedy ones."""
    target, heads = gqa_heads[torch.float32]
    prompts = [PROMPT, PROMPT[:5], [3, 4, 5], PROMPT[2:]]
    for gamma, settings in ((3, {}), (3, {"temperature": 1.0, "top_k": 5}), ("auto", {})):
        together = minispec.generate(target, prompts, draft=heads[kind], gamma=gamma, max_new_tokens=24, seed=4,
                                     ignore_eos=True, batch_size=3, **settings)
        for prompt, out in zip(prompts, together):
            alone = minispec.generate(target, prompt, draft=heads[kind], gamma=gamma, max_new_tokens=24, seed=4,
                                      ignore_eos=True, **settings)
            assert out.tokens == alone.tokens, (gamma, settings)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_reduced_draft_vocabulary_is_the_target_heads_rows(gqa_heads, dtype):
    """A reduced head's logits are the whole head's on its draft vocabulary and -inf elsewhere (so its
    guesses, greedy or drawn, are among those tokens, and q is zero on the others)."""
    target, heads = gqa_heads[dtype]
    whole, reduced = heads["eagle"], heads["eagle_reduced"]
    hidden = torch.randn(3, whole.config.dim, dtype=dtype)
    ids = reduced.draft_vocab
    full, part = whole.logits(hidden), reduced.logits(hidden)
    torch.testing.assert_close(part[:, ids], full[:, ids], rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-3)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(part[:, outside]).all() and torch.isfinite(part[:, ids]).all()


@pytest.mark.parametrize("kind, quantize", [("llama_gqa", None), ("llama", None), ("llama", "int8"), ("gpt2", "int4")])
def test_head_rows_are_the_targets_logits_of_the_identity(reference_dirs, kind, quantize):
    """head_rows reads a float head's rows instead of a forward of `dim` rows; tied, untied and
    quantized heads alike give what the target's logits of the identity give."""
    from minispec.heads.eagle import head_rows

    target = minispec.load(reference_dirs[kind][1], quantize=quantize)
    identity = target.logits(torch.eye(target.hidden_size)).T
    ids = torch.tensor([5, 0, 17, 3])
    assert torch.equal(head_rows(target, ids), identity[ids])
    assert torch.equal(head_rows(target), identity)


@pytest.fixture(scope="module")
def vocab16_heads(tmp_path_factory):
    """A tiny one-layer llama over 16 tokens; an EAGLE head that is nearly the target itself (fc passes
    the token's embedding, its layer is the target's), so that its guesses are often but not always
    accepted; random Medusa heads."""
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    torch.manual_seed(0)
    reference = spread_init(transformers.LlamaForCausalLM(config).eval(), 0, gain=1.0)
    directory = save_reference(reference, tmp_path_factory.mktemp("v16"))
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    eagle_dir, weights, _ = write_eagle(tmp_path_factory.mktemp("v16_eagle"), hf, seed=3)
    weights.update({k.removeprefix("model."): v for k, v in reference.state_dict().items()
                    if k.startswith("model.layers.0.") and "input_layernorm" not in k})
    weights["fc.weight"] = torch.cat([torch.eye(16), torch.zeros(16, 16)], dim=1)
    weights["fc.bias"] = torch.zeros(16)
    save_safetensors(weights, eagle_dir / "model.safetensors")
    medusa_dir, _ = write_medusa(tmp_path_factory.mktemp("v16_medusa"), 16, 16, heads=2, seed=3)
    # q zero on 4 of the target's likelier tokens: they come only from the residual max(0, p - q)
    reduced_dir = reduce_vocab(eagle_dir, tmp_path_factory.mktemp("v16_reduced"), [0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15])
    # EAGLE-3 over the state entering the one layer (the token's embedding), q zero on 2 tokens (and
    # nearly flat elsewhere: a sharp random q is seldom accepted)
    eagle3_dir, _, _ = write_eagle3(tmp_path_factory.mktemp("v16_eagle3"), hf, seed=3, layer_ids=[0], sharpness=0.2,
                                    draft_vocab=[i for i in range(16) if i not in (4, 10)])
    return target, {"eagle": minispec.load_draft_head(eagle_dir, target),
                    "eagle_reduced": minispec.load_draft_head(reduced_dir, target),
                    "eagle3": minispec.load_draft_head(eagle3_dir, target),
                    "medusa": minispec.load_draft_head(medusa_dir, target)}


@pytest.mark.parametrize("kind", ["eagle", "eagle_reduced", "eagle3", "medusa"])
def test_sampled_tokens_have_the_targets_joint_distribution(vocab16_heads, kind):
    """Four tokens of many requests, each with its own seed, against the target's exact joint: the first
    comes from the prompt's forward (no states yet), the next three from steps verifying the head's two
    guesses, drawn from its q (chi-square at p > 0.001, test_speculative.assert_sampled_from); a reduced
    head's q is zero on the tokens outside its draft vocabulary. Algorithm 1's verification
    (coupling="rejection"; test_seeds.py runs heads under the default)."""
    target, heads = vocab16_heads
    # top 4 for EAGLE-3: its random q cut to its own top 3 seldom meets the target's (0.06 accepted; 0.14 at 4)
    sampling, prompt, draws = {"temperature": 1.0, "top_k": 4 if kind == "eagle3" else 3}, [1, 2, 3], 2000
    joint = exact_joint(target, prompt, minispec.Sampling(**sampling), length=4)
    counts, accepted, verified = Counter(), 0, 0
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=heads[kind], gamma=2, max_new_tokens=4, seed=seed,
                                ignore_eos=True, coupling="rejection", **sampling)
        counts[tuple(out.tokens)] += 1
        accepted, verified = accepted + out.stats["accepted"], verified + out.stats["verified"]
    print(f"{kind}: acceptance rate {accepted / verified:.3f}")
    assert 0.1 < accepted / verified < 0.9
    assert_sampled_from(counts, joint, draws)


# --- token trees from heads (decoding/tree.py): EAGLE-2's dynamic tree, Medusa's best products --------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["eagle", "eagle_reduced", "eagle3", "medusa"])
def test_greedy_with_a_heads_tree_is_plain_greedy(gqa_heads, kind, dtype):
    """Trees of several budgets, alone and batched: plain greedy's tokens, each row what it is alone."""
    target, heads = gqa_heads[dtype]
    prompts = [PROMPT, PROMPT[:5], [3, 4, 5]]
    settings = {"draft": heads[kind], "gamma": 3, "max_new_tokens": 24, "ignore_eos": True}
    plain = [minispec.generate(target, prompt, max_new_tokens=24, ignore_eos=True).tokens for prompt in prompts]
    for tree in (4, 16):
        alone = [minispec.generate(target, prompt, tree=tree, **settings) for prompt in prompts]
        assert [out.tokens for out in alone] == plain, tree
        assert sum(out.stats.get("tree_nodes", 0) for out in alone) > 0
        together = minispec.generate(target, prompts, tree=tree, batch_size=2, **settings)
        assert [out.tokens for out in together] == plain, tree


@pytest.mark.parametrize("sampling", [minispec.Sampling(), minispec.Sampling(temperature=0.8, top_k=6)],
                         ids=["greedy", "sampled"])
def test_an_eagle_heads_tree_holds_the_children_its_paths_give(gqa_heads, sampling):
    """Every expanded node's children are the head's best after the node's path (greedy), or draws from
    its q there (sampled), as the chain's 1-pair forwards give them: each node's input is its parent's predicted state (the root's: the state after
    the target's tokens), at its depth's position, after its own ancestors."""
    from test_tree import assert_same_tree, drafted_tree, reference_tree

    target, heads = gqa_heads[torch.float32]
    head = heads["eagle"]
    drafter = head.drafter()
    target.ensure_caches(1, 64)
    head.ensure_caches(1, 64)
    with torch.inference_mode():
        drafter.start(torch.tensor([PROMPT]))
        logits, states = target.decode_rows(Feed(torch.tensor([PROMPT]), [0]), eager=True, hidden=True)
        t = logits[0, -1].argmax().view(1)
        drafter.accept(t.tolist(), t, (torch.tensor(PROMPT), states[0]))  # as the engine's first step does
        drafted = drafted_tree(drafter, 4, 16, sampling)
        assert drafted[2] is not None and len(drafted[0]) == 16

        def logits_after(path):
            logits, state = drafter.next_logits, drafter.state
            for depth, token in enumerate(path):
                out, predicted = head.decode_rows(Feed(torch.tensor([[token]]), [drafter.length + depth], inputs=state.view(1, 1, -1)), hidden=True)
                logits, state = out[0, -1], predicted[0, -1]
            return logits
        assert_same_tree(drafted, reference_tree(logits_after, 4, 16, sampling), sampling)


def test_a_medusa_tree_is_the_heads_best_products(gqa_heads):
    """Medusa's tree: the heads' chain (each head's most probable token) and the other paths with the
    largest products of their heads' probabilities, each head's candidates its top MEDUSA_TREE_WIDTH
    (enumerated here: every path of up to 3 of them), 8 paths in all."""
    import itertools

    from minispec.heads.medusa import MEDUSA_TREE_WIDTH

    heads = gqa_heads[torch.float32][1]["medusa"]
    drafter = heads.drafter()
    drafter.start(torch.tensor([PROMPT]))
    drafter.state = torch.randn(heads.target.hidden_size, generator=torch.Generator().manual_seed(2))
    tokens, q, parents = drafter.propose_tree(3, 8, minispec.Sampling())
    assert q is None and parents is not None
    best = F.log_softmax(heads(drafter.state, 3), -1).topk(MEDUSA_TREE_WIDTH)
    paths = {}
    for depth in (1, 2, 3):
        for choice in itertools.product(range(MEDUSA_TREE_WIDTH), repeat=depth):
            paths[tuple(best.indices[j, c].item() for j, c in enumerate(choice))] = sum(
                best.values[j, c].item() for j, c in enumerate(choice))
    spine = [tuple(best.indices[:depth, 0].tolist()) for depth in (1, 2, 3)]
    expected = set(spine + sorted(set(paths) - set(spine), key=paths.get, reverse=True)[:5])

    def path_of(j):
        return path_of(parents[j]) + (tokens[j].item(),) if j >= 0 else ()
    assert {path_of(j) for j in range(len(tokens))} == expected


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_sampled_tokens_from_a_heads_tree_have_the_targets_joint_distribution(vocab16_heads, kind):
    """As for the chain (four tokens, chi-square at p > 0.001 and a total-variation bound), with trees of
    5 nodes, 2 deep: EAGLE's draws from its q, verified by recursive rejection; Medusa's best
    candidates, verified as fixed candidates (tree.sample_walk)."""
    target, heads = vocab16_heads
    # top 4 for EAGLE-3: its random q cut to its own top 3 seldom meets the target's (0.06 accepted; 0.14 at 4)
    sampling, prompt, draws = {"temperature": 1.0, "top_k": 4 if kind == "eagle3" else 3}, [1, 2, 3], 2000
    joint = exact_joint(target, prompt, minispec.Sampling(**sampling), length=4)
    counts, accepted, verified, trees = Counter(), 0, 0, 0
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=heads[kind], gamma=2, tree=5, max_new_tokens=4, seed=seed,
                                ignore_eos=True, **sampling)
        counts[tuple(out.tokens)] += 1
        accepted, verified = accepted + out.stats["accepted"], verified + out.stats["verified"]
        trees += out.stats.get("tree_nodes", 0) > 0
    print(f"{kind}: acceptance rate {accepted / verified:.3f}, {trees} requests verified a tree")
    assert 0.1 < accepted / verified < 0.9 and trees >= draws // 2
    assert_sampled_from(counts, joint, draws)


def test_an_eagle_tree_accepts_more_per_target_call_than_its_chain(vocab16_heads):
    """The same depth (gamma 3), greedy, a good head: more tokens per target call (deterministic)."""
    target, heads = vocab16_heads
    prompts = [[1, 2, 3], [4, 5], [7, 8, 9, 10]]
    settings = {"draft": heads["eagle"], "gamma": 3, "max_new_tokens": 24, "ignore_eos": True}
    per_call = [sum(len(out.tokens) for out in outs) / sum(out.stats["target_calls"] for out in outs)
                for outs in (minispec.generate(target, prompts, **settings),
                             minispec.generate(target, prompts, tree=16, **settings))]
    print(f"tokens per target call: chain {per_call[0]:.2f}, tree {per_call[1]:.2f}")
    assert per_call[1] > 1.2 * per_call[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa", "eagle+lookup"])
def test_a_prefix_hit_drafts_with_a_head_as_a_cold_run(gqa_heads, kind, dtype):
    """A head's request reuses stored blocks: the target's states there, stored beside them, reach the head
    with its first states, so every prompt (the conversation's next turn, all of a stored prompt, part of a
    block) gets a cold run's tokens and the same guesses, accepted alike, in chains and trees."""
    from minispec.decoding.prefix import BLOCK, PrefixCache
    target, heads = gqa_heads[dtype]
    draft = [heads["eagle"], "lookup"] if kind == "eagle+lookup" else heads[kind]
    base = torch.randint(2, 90, (3 * BLOCK + 5,), generator=torch.Generator().manual_seed(3)).tolist()
    for shape in ({"gamma": 3, "tree": "off"}, {"gamma": 3, "tree": 8}):
        settings = {"draft": draft, "max_new_tokens": 16, "ignore_eos": True, **shape}
        cache = PrefixCache()
        first = minispec.generate(target, base, prefix_cache=cache, **settings)
        prompts = [base + first.tokens + [7, 8], base, base[:2 * BLOCK + 3] + [9, 9]]
        for prompt, cached in zip(prompts, [len(base) + len(first.tokens) - 1, len(base) - 1, 2 * BLOCK]):
            cold = minispec.generate(target, prompt, **settings)
            warm = minispec.generate(target, prompt, prefix_cache=cache, **settings)
            assert warm.stats["cached_tokens"] == cached // BLOCK * BLOCK > 0, shape
            assert warm.tokens == cold.tokens, shape
            assert warm.trace == cold.trace, shape  # the same guesses, rejected ones too
            assert [warm.stats[key] for key in ("proposed", "accepted", "draft_calls")] == \
                [cold.stats[key] for key in ("proposed", "accepted", "draft_calls")], shape
        assert cache.bytes == sum(node.bytes for node in cache.lru) <= cache.budget


def test_blocks_a_plain_request_stored_take_a_heads_states_when_it_passes(gqa_heads):
    """A plain request's blocks hold no states: a head's request over them computes its prompt, and stores
    the states it computed into them, so the next one reuses them; a plain request reuses either."""
    from minispec.decoding.prefix import BLOCK, PrefixCache
    target, heads = gqa_heads[torch.float32]
    prompt, cache = torch.randint(2, 90, (2 * BLOCK + 3,), generator=torch.Generator().manual_seed(4)).tolist(), PrefixCache()
    settings = {"draft": heads["eagle"], "gamma": 3, "max_new_tokens": 8, "ignore_eos": True}
    minispec.generate(target, prompt, prefix_cache=cache, max_new_tokens=1)
    plain_bytes = cache.bytes
    assert minispec.generate(target, prompt, prefix_cache=cache, **settings).stats["cached_tokens"] == 0
    states = 2 * BLOCK * target.hidden_size * 4  # float32 states at two blocks' tokens
    assert cache.bytes == plain_bytes + states
    warm = minispec.generate(target, prompt, prefix_cache=cache, **settings)
    assert warm.stats["cached_tokens"] == 2 * BLOCK
    assert warm.tokens == minispec.generate(target, prompt, **settings).tokens
    assert minispec.generate(target, prompt, prefix_cache=cache, max_new_tokens=8).stats["cached_tokens"] == 2 * BLOCK


def test_an_eagle_head_keeps_the_pairs_of_a_step_that_drafted_nothing(gqa_heads):
    """gamma="auto" may choose a plain step (k = 0): the pairs the target gave meanwhile wait, and the
    next proposal feeds them all (they were dropped, leaving the head's positions behind the text's)."""
    target, heads = gqa_heads[torch.float32]
    drafter = heads["eagle"].drafter()
    target.ensure_caches(1, 64)
    heads["eagle"].ensure_caches(1, 64)
    with torch.inference_mode():
        drafter.start(torch.tensor([PROMPT]))
        seen = torch.tensor(PROMPT)
        for length in (0, len(PROMPT)):  # the prompt's step, then a plain step drafting nothing
            logits, states = target.decode_rows(Feed(seen.view(1, -1), [length]), eager=True, hidden=True)
            drafter.propose(0, minispec.Sampling(), None)
            t = logits[0, -1].argmax().view(1)
            drafter.accept(t.tolist(), t, (seen, states[0]))
            seen = t
        drafter.propose(1, minispec.Sampling(), None)
        assert drafter.length == len(PROMPT) + 1  # a pair per token the target has seen, the last t's


def tiny_training_target(directory):
    """A target to train heads on in seconds, 64 prompts to answer, 16 others, and a head's acceptance
    on those (greedy, gamma 3, 48 tokens): two layers over 64 tokens, whose next state is not mostly its
    last (over 16 tokens and one layer the answers repeat their tokens, and the untrained EAGLE head,
    f̂ = f, is already right 84% of the time)."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    target = minispec.load(save_reference(spread_init(transformers.LlamaForCausalLM(config).eval(), 0, gain=1.0),
                                          directory))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 64, (5,), generator=g).tolist() for _ in range(64)]
    unseen = [torch.randint(3, 64, (5,), generator=g).tolist() for _ in range(16)]

    def acceptance(head):
        out = minispec.generate(target, unseen, draft=head, gamma=3, max_new_tokens=48)
        return sum(o.stats["accepted"] for o in out) / sum(o.stats["proposed"] for o in out)
    return target, prompts, unseen, acceptance


def test_training_raises_acceptance_above_an_untrained_heads(tmp_path):
    """`train` on a tiny target's own answers, in seconds: the head's greedy guesses are accepted more
    often on prompts it never saw than the untrained head's (which starts as tools/train_heads.py's new_head);
    an interrupted run resumes (the epochs done are kept), and the folder loads as a head."""
    from minispec.tools import train_heads as train

    target, prompts, _, acceptance = tiny_training_target(tmp_path / "target")

    settings = dict(max_new_tokens=48, chat=False, lr=3e-3)
    untrained = train.train(target, tmp_path / "head", "eagle", prompts, epochs=0, **settings)
    train.train(target, tmp_path / "head", "eagle", prompts, epochs=10, **settings)
    assert json.loads((tmp_path / "head" / "training" / "progress.json").read_text())["epochs_done"] == 10
    train.train(target, tmp_path / "head", "eagle", prompts, epochs=20, **settings)  # resumes
    trained = minispec.load_draft_head(tmp_path / "head", target)
    before, after = acceptance(untrained), acceptance(trained)
    print(f"acceptance {before:.3f} untrained, {after:.3f} trained")
    assert after > before + 0.05

    # a reduced draft vocabulary: the 8 tokens the target said most in its answers, kept with the head
    train.train(target, tmp_path / "reduced", "eagle", prompts[:8], epochs=1, max_new_tokens=16, chat=False,
                draft_vocab=8)
    data = train.load_data(tmp_path / "reduced" / "training" / "data.safetensors")
    said = Counter(token for tokens, start in data for token in tokens[start:].tolist())
    reduced = minispec.load_draft_head(tmp_path / "reduced", target)
    assert reduced.draft_vocab.tolist() == sorted(sorted(said, key=lambda t: (-said[t], t))[:8])


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """A tiny random Llama with a ChatML byte-level tokenizer (700 tokens) and SmolLM2's chat template."""
    from test_chat import SMOLLM2
    from test_tokenizer import build_byte_level

    directory = build_byte_level(tmp_path_factory.mktemp("chat_target"), "smollm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = SMOLLM2
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return minispec.load(directory)


def test_a_chat_target_writes_prompts_from_the_start_of_a_users_turn(chat_target, monkeypatch):
    """own_prompts: each try is what the target writes alone from user_turn_start with its own seed from
    the generator (temperature 1, the 50 likeliest tokens), kept when it ends the message (<|im_end|> or
    EOS) within PROMPT_TOKENS, once, in order. default_prompts: a chat target answers the templates over
    every other subject and those; a target answering plain text, every subject under every template."""
    from minispec.tools import train_heads as train
    from minispec.loading.chat import user_turn_start

    monkeypatch.setattr(train, "PROMPT_TOKENS", 300)  # this random target ends about half its messages in 300
    tokenizer = chat_target.tokenizer
    ends = [tokenizer.encode("<|im_end|>", add_special_tokens=False)[0], tokenizer.eos_token_id]
    written = train.own_prompts(chat_target, 12, torch.Generator().manual_seed(5), batch_size=4)
    expected = []
    for seed in torch.randint(2**62, (12,), generator=torch.Generator().manual_seed(5)).tolist():
        alone = minispec.generate(chat_target, user_turn_start(tokenizer), max_new_tokens=300, temperature=1.0,
                                  top_k=50, seed=seed, stop_token_ids=ends)
        text = tokenizer.decode(alone.tokens[:-1]).strip()
        if alone.tokens[-1] in ends and text and text not in expected:
            expected.append(text)
    assert written == expected and 2 <= len(written) <= 10, len(written)

    monkeypatch.setattr(train, "own_prompts", lambda target, count, generator, batch_size: ["a", "b"])
    everything = train.default_prompts(chat_target, False, None, 4)
    assert len(set(everything)) == len(train.SUBJECTS) * len(train.TEMPLATES) == 1920
    chat = train.default_prompts(chat_target, True, None, 4)
    assert chat[-2:] == ["a", "b"] and len(set(chat[:-2])) == 960 and set(chat[:-2]) < set(everything)


def test_an_eagle3_head_trained_here_is_saved_as_published_and_drafts(reference_dirs, tmp_path):
    """`train --kind eagle3`: the head reads the inputs of the target's layers (both of a 2-layer
    target's), learns (acceptance on unseen prompts above the untrained head's), is written in EAGLE-3's
    published layout (midlayer.*, d2t, t2d, draft_vocab_size and the layers in config.json) and drafts
    exactly; a target outside the Llama family is refused before answering."""
    from minispec.tools import train_heads as train

    _, prompts, trained, before, after = trained_beside_untrained(tmp_path, "eagle3", 20, lr=3e-3, draft_vocab=48)
    assert type(trained).__name__ == "Eagle3Head" and trained.taps == (0, 1) and after > before + 0.05
    hf = json.loads((tmp_path / "head" / "config.json").read_text())
    assert hf["draft_vocab_size"] == 48 and hf["eagle_aux_hidden_state_layer_ids"] == [0, 1]
    weights = load_file(tmp_path / "head" / "model.safetensors")
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.gate_proj.weight"} <= set(weights)
    assert torch.equal(torch.arange(48) + weights["d2t"], trained.draft_vocab) and weights["t2d"].sum() == 48
    with pytest.raises(ValueError, match="Llama-family target"):
        train.train(minispec.load(reference_dirs["gpt2"][1]), tmp_path / "gpt2", "eagle3", prompts)


def test_medusa_heads_trained_here_are_saved_as_published_and_draft(tmp_path):
    """`train --kind medusa`: K heads on the last state, each trained against the target one position
    further (Medusa-1's self-distillation), accepted more often on unseen prompts than the untrained
    heads (each the target's own output head: a guess of the token after next as if it were the next),
    written in Medusa's published layout and drafting exactly."""
    _, _, trained, before, after = trained_beside_untrained(tmp_path, "medusa", 20, lr=1e-2, heads=3)
    assert type(trained).__name__ == "MedusaHeads" and after > before + 0.05
    hf = json.loads((tmp_path / "head" / "config.json").read_text())
    assert hf["medusa_num_heads"] == 3 and hf["medusa_num_layers"] == 1


def trained_beside_untrained(tmp_path, kind, epochs, **settings):
    """A head of `kind` for tiny_training_target, in tmp_path / "head": (target, its prompts, the head
    trained `epochs` epochs, the untrained head's acceptance on unseen prompts, the trained one's). The
    trained head's greedy drafting is checked to give plain greedy's tokens."""
    from minispec.tools import train_heads as train

    target, prompts, unseen, acceptance = tiny_training_target(tmp_path / "target")
    settings = dict(max_new_tokens=48, chat=False, **settings)
    untrained = train.train(target, tmp_path / "head", kind, prompts, epochs=0, **settings)
    train.train(target, tmp_path / "head", kind, prompts, epochs=epochs, **settings)
    trained = minispec.load_draft_head(tmp_path / "head", target)
    before, after = acceptance(untrained), acceptance(trained)
    print(f"acceptance {before:.3f} untrained, {after:.3f} trained")
    plain = minispec.generate(target, unseen, max_new_tokens=48)
    drafted = minispec.generate(target, unseen, draft=trained, gamma=3, max_new_tokens=48)
    assert [o.tokens for o in drafted] == [o.tokens for o in plain]
    return target, prompts, trained, before, after


def test_each_training_step_computes_with_the_weights_the_last_step_left(tmp_path, monkeypatch):
    """Training's products run in bfloat16 autocast where the device has it natively, one autocast per
    step: autocast keeps its bfloat16 copies of the weights till it ends, so one kept open over an
    epoch computed every step with the epoch's first weights (SmolLM2's EAGLE-3 head learnt nothing:
    first-guess accuracy 0.03 after an epoch)."""
    from minispec.tools import train_heads as train

    target, prompts, _, _ = tiny_training_target(tmp_path / "target")
    monkeypatch.setattr(train, "bfloat16_products", lambda device: torch.autocast(device.type, dtype=torch.bfloat16))
    current, loss = [], train.eagle3_loss

    def checked_loss(head, *batch, **settings):  # fc as autocast computes it, against its weights now
        x = torch.randn(3, head.fc.in_features)
        now = F.linear(x.bfloat16(), head.fc.weight.detach().bfloat16(),
                       None if head.fc.bias is None else head.fc.bias.detach().bfloat16())
        current.append(torch.equal(head.fc(x).detach(), now))
        return loss(head, *batch, **settings)
    monkeypatch.setattr(train, "eagle3_loss", checked_loss)
    train.train(target, tmp_path / "head", "eagle3", prompts, epochs=1, max_new_tokens=16, chat=False, draft_vocab=48,
                tokens_per_batch=64)
    assert len(current) > 5 and all(current)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_the_states_kept_while_answering_are_those_a_resumed_run_records(tmp_path, kind):
    """train.answer keeps the target's states from the forwards that answer (generate's on_states); a
    resumed run, whose answers are saved but not their states, records them in one forward: the same
    numbers, over the prompt and the answer but its last token (no forward saw it)."""
    from minispec.tools import train_heads as train

    target, prompts, _, _ = tiny_training_target(tmp_path / "target")
    taps = train.eagle3.training_taps(len(target.layers)) if kind == "eagle3" else None
    sequences, records = train.answer(target, prompts[:6], 16, 4, False, taps)
    plain = minispec.generate(target, prompts[:6], max_new_tokens=16)
    assert [(t.tolist(), start) for t, start in sequences] == [
        (p + g.tokens[:-1], len(p)) for p, g in zip(prompts[:6], plain) if len(g.tokens) > 1]
    width = target.hidden_size * (1 if taps is None else len(taps) + 1)
    for kept, recorded in zip(records, train.record(target, sequences, taps)):
        assert kept.shape[-1] == width
        torch.testing.assert_close(kept, recorded, rtol=1e-5, atol=1e-6)


def test_eagle3_training_time_test_unrolls_as_the_head_drafts(tmp_path):
    """EAGLE-3's training-time test: the head's states at unrolled step j, computed for every chain of
    a batch at once, are the states it drafts j guesses deep from the target's pairs up to that chain's
    position (through its KV cache, as decoding does), the guesses being the answer's tokens."""
    from minispec.tools import train_heads as train

    target, _, _, _ = tiny_training_target(tmp_path / "target")
    g = torch.Generator().manual_seed(2)
    sequences = [(torch.randint(3, 64, (n,), generator=g), 4) for n in (40, 29)]
    records = train.record(target, sequences, train.eagle3.training_taps(len(target.layers)))
    head, _ = train.new_head("eagle3", target, 4, torch.arange(0, 64, 2))
    with torch.no_grad():  # away from the identity it starts as
        for parameter in head.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * 0.1)
    tokens, states, mask = train.padded_batch(sequences, records, [0, 1])
    unrolled = []
    hook = head.norm.register_forward_hook(lambda module, inputs, output: unrolled.append(inputs[0].detach()))
    with train.training(head, 128):
        train.eagle3_loss(head, tokens, states, mask, None, steps=3)
    hook.remove()
    assert len(unrolled) == 3
    tapped = states[..., :-head.config.dim]
    head.ensure_caches(1, 128)
    for row, chain in [(0, 4), (0, 20), (0, 36), (1, 9), (1, 25)]:
        inputs = head.fuse(tapped[row, :chain + 1])[None]
        _, drafted = head.decode_rows(Feed(tokens[row, 1:chain + 2][None], [0], inputs=inputs), eager=True, hidden=True)
        state = drafted[0, -1]
        for j in range(3):
            kept = train.shifted(mask, 1 + j)
            at = int(kept.flatten()[:row * kept.shape[1] + chain].sum())  # the chain's row among the kept ones
            torch.testing.assert_close(unrolled[j][at], state, rtol=1e-4, atol=1e-5)
            _, drafted = head.decode_rows(Feed(tokens[row, chain + 2 + j].view(1, 1), [chain + 1 + j], inputs=state.view(1, 1, -1)), eager=True, hidden=True)
            state = drafted[0, -1]


@pytest.mark.parametrize("setting, message", [
    (dict(epochs=-1), "epochs must be an integer >= 0"), (dict(lr=float("nan")), "lr must be a number > 0"),
    (dict(lr=0.0), "lr must be a number > 0"), (dict(kind="medusa", heads=0), "heads >= 1"),
    (dict(dtype=torch.float16), "float16 is not supported")])
def test_training_refuses_settings_it_could_only_fail_with_before_answering(reference_dirs, tmp_path, monkeypatch,
                                                                           setting, message):
    from minispec.tools import train_heads as train

    monkeypatch.setattr(train, "answer", lambda *args: pytest.fail("answered before checking its settings"))
    target = minispec.load(reference_dirs["llama_gqa"][1], dtype=setting.pop("dtype", None))
    with pytest.raises(ValueError, match=message):
        train.train(target, tmp_path / "head", prompts=[PROMPT], **setting)


def test_training_that_diverges_stops_with_the_last_good_head(reference_dirs, tmp_path, monkeypatch, capsys):
    """A non-finite loss ends training with one line naming it; what the folder holds is the last
    finished epoch's head (none here), never a head of NaNs. And `--epochs 0` is refused: it would
    write no head."""
    from minispec.tools import train_heads as train

    target = minispec.load(reference_dirs["llama_gqa"][1])
    monkeypatch.setattr(train, "eagle_loss", lambda head, *args, **kwargs: (
        sum(p.sum() for p in head.parameters()) * float("nan"), torch.zeros(())))
    with pytest.raises(ValueError, match="training diverged at epoch 1, step 1 .*lower lr"):
        train.train(target, tmp_path / "head", prompts=[PROMPT] * 2, epochs=2, max_new_tokens=8, chat=False)
    assert not (tmp_path / "head" / "model.safetensors").exists()
    capsys.readouterr()
    assert train.main(["--target", str(reference_dirs["llama_gqa"][1]), "--out", str(tmp_path / "h"),
                       "--epochs", "0"]) == 2
    assert capsys.readouterr().err.strip() == "minispec: --epochs must be >= 1, got 0"
    quantized = minispec.load(reference_dirs["llama_gqa"][1], quantize="int8")
    for kind in ("eagle", "eagle3", "medusa"):  # each starts from the target's float weights
        with pytest.raises(ValueError, match="a head is trained on a float target"):
            train.train(quantized, tmp_path / "q", kind=kind)


def test_bad_head_folders_are_named(reference_dirs, tmp_path):
    directory = reference_dirs["llama_gqa"][1]
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    eagle_dir, _, config = write_eagle(tmp_path / "eagle", hf)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(config))
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(minispec.CheckpointError, match="pytorch_model.bin is a pickle file.*safetensors"):
        minispec.load_draft_head(pickled, target)
    eagle3_dir, _, eagle3_config = write_eagle3(tmp_path / "eagle3", hf)
    for change, message in (({}, r"layers 2, L/2 and L-3, which are not three layers of .* name them in "
                                 r"eagle_aux_hidden_state_layer_ids"),
                            ({"eagle_aux_hidden_state_layer_ids": [0, 0]}, r"must be distinct layer indices .*\(0..1\)"),
                            ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, r"must be distinct layer indices"),
                            ({"eagle_aux_hidden_state_layer_ids": [0, 1], "target_hidden_size": 32},
                             "hidden states of 32 cannot draft"),
                            ({"eagle_aux_hidden_state_layer_ids": [0, 1], "draft_vocab_size": 10**6},
                             "draft_vocab_size 1000000 is more than")):
        (eagle3_dir / "config.json").write_text(json.dumps({**eagle3_config, **change}))
        with pytest.raises(minispec.CheckpointError, match=message):
            minispec.load_draft_head(eagle3_dir, target)
    (eagle3_dir / "config.json").write_text(json.dumps({**eagle3_config, "eagle_aux_hidden_state_layer_ids": [0]}))
    with pytest.raises(minispec.CheckpointError, match=r"fc.weight.*shape"):  # its fc reads 3 layers, not 1
        minispec.load_draft_head(eagle3_dir, target)
    eagle3_bad, _, _ = write_eagle3(tmp_path / "eagle3_bad", hf, layer_ids=[0, 1], draft_vocab=[3, 5, 5])
    with pytest.raises(minispec.CheckpointError, match=r"d2t \(EAGLE-3's offsets to target ids\) must give distinct"):
        minispec.load_draft_head(eagle3_bad, target)
    gpt2 = minispec.load(reference_dirs["gpt2"][1])
    with pytest.raises(minispec.CheckpointError, match="reads states inside a Llama-family target"):
        minispec.load_draft_head(eagle3_dir, gpt2)
    repeated = reduce_vocab(eagle_dir, tmp_path / "repeated", [1, 2, 2])
    with pytest.raises(minispec.CheckpointError, match="draft_vocab must give distinct token ids"):
        minispec.load_draft_head(repeated, target)
    too_many = reduce_vocab(eagle_dir, tmp_path / "too_many", [1, 2])
    (too_many / "config.json").write_text(json.dumps({**config, "minispec_draft_vocab": 10**6}))
    with pytest.raises(minispec.CheckpointError, match="minispec_draft_vocab must be a token count"):
        minispec.load_draft_head(too_many, target)
    other = minispec.load(reference_dirs["llama"][1])  # hidden size 32, not 64
    with pytest.raises(minispec.CheckpointError, match="hidden_size 64 cannot draft") as refused:
        minispec.load_draft_head(eagle_dir, other)
    assert str(refused.value).count(str(eagle_dir)) == 1  # the folder named once
    head = minispec.load_draft_head(eagle_dir, target)
    with pytest.raises(ValueError, match="loaded for"):
        minispec.generate(minispec.load(directory), PROMPT, draft=head)
    with pytest.raises(ValueError, match="draft heads guess one sequence"):
        minispec.generate(target, PROMPT, draft=head, beams=2)
    with pytest.raises(minispec.CheckpointError, match="not a directory"):
        minispec.load_draft_head(tmp_path / "missing", target)


def test_a_one_layer_draft_model_is_no_head(reference_dirs, tmp_path):
    """A one-layer Llama checkpoint without tokenizer files looks like EAGLE's published config, but its
    weights hold no fc: --draft takes it as a draft model. EAGLE's folder stays a head."""
    reference, directory = reference_dirs["llama_gqa"]
    hf = json.loads((directory / "config.json").read_text())
    eagle_dir, _, _ = write_eagle(tmp_path / "eagle", hf)
    assert is_head_dir(eagle_dir)
    one_layer = copy.deepcopy(reference)
    one_layer.model.layers = one_layer.model.layers[:1]
    one_layer.config.num_hidden_layers = 1
    draft_dir = save_reference(one_layer, tmp_path / "one_layer")
    for tokenizer_file in draft_dir.glob("tokenizer*"):
        tokenizer_file.unlink()
    assert not is_head_dir(draft_dir)
    target = minispec.load(directory)
    draft = load_draft(str(draft_dir), target)
    assert isinstance(draft, CachedLM) and len(draft.layers) == 1
    out = minispec.generate(target, PROMPT, draft=draft, gamma=2, max_new_tokens=8, ignore_eos=True)
    assert out.tokens == minispec.generate(target, PROMPT, max_new_tokens=8, ignore_eos=True).tokens


def test_run_py_drafts_with_a_head_folder(reference_dirs, tmp_path):
    """--draft DIR: a head's folder is loaded as a head for the target, and greedy output is plain's,
    with --tree N too."""
    import run

    directory = reference_dirs["llama_gqa"][1]
    eagle_dir, _, _ = write_eagle(tmp_path / "eagle", json.loads((directory / "config.json").read_text()))
    ids = ",".join(map(str, PROMPT))
    outputs = []
    for draft in (str(eagle_dir), "none", str(eagle_dir)):
        args = ["--target", str(directory), "--draft", draft, "--prompt-ids", ids, "--max-new-tokens", "12",
                "--ignore-eos", "--gamma", "2", "--json"] + (["--tree", "8"] if len(outputs) == 2 else [])
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert run.main(args) == 0
        outputs.append(json.loads(buffer.getvalue()))
    assert outputs[0]["tokens"] == outputs[1]["tokens"] == outputs[2]["tokens"]
    assert outputs[0]["stats"]["proposed"] > 0 and outputs[2]["stats"]["tree_nodes"] > 0  # --tree 8


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3 norm before residual"])
def test_a_heads_layer_in_one_call_drafts_what_its_modules_draft(deep_target, tmp_path, kind, monkeypatch):
    """EAGLE-1's layer (no input norm) and EAGLE-3's ([embedding, state], each normed; the state, or
    its norm, the residual) run as one call on a CPU (minispec/native/layer.cpp): bit for bit their modules."""
    from minispec import native
    from minispec.models.llama import Llama
    if not native.available():
        pytest.skip("minispec's CPU kernels cannot be built here")
    _, directory = deep_target
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    if kind == "eagle":
        head_dir, _, _ = write_eagle(tmp_path / "head", hf)
    else:
        head_dir, _, config = write_eagle3(tmp_path / "head", hf, draft_vocab=list(range(1, 64, 3)))
        config["norm_before_residual"] = kind.endswith("residual")
        (head_dir / "config.json").write_text(json.dumps(config))
    head = minispec.load_draft_head(head_dir, target)
    tokens = torch.tensor([PROMPT + [40, 41, 42]])
    calls = []
    monkeypatch.setattr(native, "llama_layers", lambda *args, original=native.llama_layers: calls.append(1) or original(*args))

    def draft():
        head.ensure_caches(1, 32)
        width = hf["hidden_size"] * (1 if kind == "eagle" else len(head.taps))  # the target's state(s) read
        states = torch.randn(1, tokens.shape[1] - 1, width, generator=torch.Generator().manual_seed(0))
        inputs = states if kind == "eagle" else head.fuse(states)
        return head.decode_rows(Feed(tokens[:, 1:], [0], inputs=inputs), eager=True, hidden=True)
    with torch.inference_mode():
        fused = draft()
        assert calls == [1]
        monkeypatch.setattr(Llama, "fused_layers", lambda self, x: None)
        modules = draft()
    assert calls == [1] and all(torch.equal(a, b) for a, b in zip(fused, modules))


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_on_a_cpu_or_beside_a_quantized_target_a_head_is_int8(reference_dirs, tmp_path, kind):
    """A float head's guess costs what its bytes cost: by default its linear layers are int8 on a CPU and
    beside a quantized target (quantize=None keeps them as they are), and greedy decoding with it is
    still plain greedy."""
    from minispec.models.quant import Int8Linear
    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    head_dir = (write_eagle(tmp_path / "head", hf) if kind == "eagle" else
                write_eagle3(tmp_path / "head", hf, draft_vocab=list(range(1, hf["vocab_size"], 2)), layer_ids=[0, 1]))[0]
    target = minispec.load(directory)
    assert not isinstance(minispec.load_draft_head(head_dir, target, quantize=None).layers[0].feed_forward.w2, Int8Linear)
    for quantize in (None, "int4"):
        target = minispec.load(directory, quantize=quantize)
        head = minispec.load_draft_head(head_dir, target)
        assert isinstance(head.layers[0].feed_forward.w2, Int8Linear)
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    for gamma in (1, 3):
        out = minispec.generate(target, PROMPT, draft=head, gamma=gamma, max_new_tokens=30, ignore_eos=True)
        assert out.tokens == plain.tokens and out.stats["proposed"] > 0


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_a_head_is_quantized_beside_a_float_target_when_asked(reference_dirs, tmp_path, quantize, capsys):
    """quantize= (run.py's --draft-quantize) chooses how an EAGLE head beside a float target is
    quantized; greedy decoding with it is still plain greedy. A Medusa head's heads are the target's
    output head: asking is an error that says so."""
    import run
    from minispec.models.quant import Int4Linear, Int8Linear
    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    head_dir = write_eagle3(tmp_path / "head", hf, layer_ids=[0, 1])[0]
    target = minispec.load(directory)
    head = minispec.load_draft_head(head_dir, target, quantize=quantize)
    assert isinstance(head.layers[0].feed_forward.w2, {"int8": Int8Linear, "int4": Int4Linear}[quantize])
    # its stored costs (decoding/profiles.py) are its own, not the float head's
    assert head.fingerprint != minispec.load_draft_head(head_dir, target, quantize=None).fingerprint
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    out = minispec.generate(target, PROMPT, draft=head, max_new_tokens=30, ignore_eos=True)
    assert out.tokens == plain.tokens
    common = ["--target", str(directory), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4"]
    assert run.main([*common, "--draft", str(head_dir), "--draft-quantize", quantize]) == 0
    medusa_dir = write_medusa(tmp_path / "medusa", hf["hidden_size"], hf["vocab_size"])[0]
    capsys.readouterr()
    assert run.main([*common, "--draft", str(medusa_dir), "--draft-quantize", quantize]) == 2
    assert "a Medusa head is not quantized" in capsys.readouterr().err


@pytest.mark.parametrize("kind, fields, message", [
    ("medusa", {"medusa_num_heads": 10**9}, "medusa_num_heads, medusa_num_layers ask for a head of"),
    ("medusa", {"medusa_num_layers": 2**30}, "medusa_num_heads, medusa_num_layers ask for a head of"),
    ("eagle", {"num_hidden_layers": 2**30}, "num_hidden_layers, hidden_size, intermediate_size ask for a head of"),
    ("eagle", {"intermediate_size": 2**31 - 1}, "num_hidden_layers, hidden_size, intermediate_size ask for a head of"),
])
def test_a_head_config_asking_for_more_memory_than_is_free_is_refused_before_it_is_built(
        reference_dirs, tmp_path, kind, fields, message):
    """A head whose config.json asks for more than the free memory: one line naming the fields, at once
    (built, a billion Medusa heads would take hours before anything is read)."""
    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    head_dir = (write_medusa(tmp_path / "h", hf["hidden_size"], hf["vocab_size"]) if kind == "medusa" else
                write_eagle(tmp_path / "h", hf))[0]
    config = json.loads((head_dir / "config.json").read_text())
    (head_dir / "config.json").write_text(json.dumps({**config, **fields}))
    target = minispec.load(directory)
    started = time.monotonic()
    with pytest.raises(minispec.CheckpointError, match=message) as error:
        minispec.load_draft_head(head_dir, target)
    assert time.monotonic() - started < 10 and "GiB free" in str(error.value) and "\n" not in str(error.value)


def resume_case(folder, case):
    """Damage a trained head's resume files as `case` says."""
    training = folder / "training"
    if case == "progress cut short":
        (training / "progress.json").write_text('{"epochs_do')
    elif case == "optimizer missing":
        (training / "optimizer.safetensors").unlink()
    elif case == "optimizer cut short":
        data = (training / "optimizer.safetensors").read_bytes()
        (training / "optimizer.safetensors").write_bytes(data[:len(data) // 2])
    elif case == "answers cut short":
        data = (training / "data.safetensors").read_bytes()
        (training / "data.safetensors").write_bytes(data[:len(data) // 2])
    elif case == "another kind's":
        (training / "progress.json").write_text(json.dumps({"epochs_done": 1, "kind": "eagle"}))
    elif case == "another head's optimizer":  # two heads' where three are trained
        shutil.copy(folder.parent / "two" / "training" / "optimizer.safetensors", training)


RESUME_CASES = ["progress cut short", "optimizer missing", "optimizer cut short", "answers cut short",
                "another kind's", "another head's optimizer"]


def test_resume_files_that_cannot_be_resumed_from_are_one_line(tmp_path, capsys):
    """The heads tool's resume files missing, cut short or another head's: exit 2, one line naming the
    folder and what to do, no traceback."""
    from minispec.tools import train_heads as train

    target, prompts, _, _ = tiny_training_target(tmp_path / "target")
    settings = dict(max_new_tokens=16, chat=False, kind="medusa", epochs=1)
    train.train(target, tmp_path / "three", prompts=prompts[:8], heads=3, **settings)
    train.train(target, tmp_path / "two", prompts=prompts[:8], heads=2, **settings)
    for case in RESUME_CASES:
        folder = tmp_path / case.replace(" ", "_").replace("'", "")
        shutil.copytree(tmp_path / "three", folder)
        resume_case(folder, case)
        argv = ["--target", str(tmp_path / "target"), "--out", str(folder), "--kind", "medusa", "--heads", "3",
                "--epochs", "2", "--no-chat", "--max-new-tokens", "16"]
        capsys.readouterr()
        assert train.main(argv) == 2, case
        err = capsys.readouterr().err
        assert err.startswith(f"minispec: cannot resume the training in {folder}") and err.count("\n") == 1, (case, err)
        assert "remove" in err and "Traceback" not in err, (case, err)


KILLING = """
import os, signal, sys
calls = 0
real_fsync = os.fsync
def fsync(fd):  # the Nth write is cut off at half its bytes, then the process is killed
    global calls
    calls += 1
    if calls == int(os.environ["KILL_AT"]):
        os.ftruncate(fd, os.fstat(fd).st_size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    real_fsync(fd)
os.fsync = fsync
"""


def test_a_training_killed_at_any_write_leaves_its_last_good_state(tmp_path):
    """kill -9 in the middle of each of a training's writes (the answers, then per epoch the head, its
    config, the optimizer and the progress): the folder keeps its last whole files, and the next run
    resumes and finishes with a head that loads."""
    from minispec.tools import train_heads as train

    target, prompts, _, _ = tiny_training_target(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("".join(json.dumps(p) + "\n" for p in prompts[:8]))
    code = KILLING + "from minispec.tools import train_heads; sys.exit(train_heads.main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for kill_at in (1, 3, 5, 8):  # the answers; epoch 1's config and progress; epoch 2's optimizer
        out = tmp_path / f"head{kill_at}"
        argv = ["--target", str(tmp_path / "target"), "--out", str(out), "--kind", "medusa", "--heads", "2",
                "--epochs", "2", "--no-chat", "--max-new-tokens", "16", "--prompts", str(tmp_path / "prompts.txt")]
        killed = subprocess.run([sys.executable, "-c", code, *argv], env={**env, "KILL_AT": str(kill_at)},
                                capture_output=True, text=True, timeout=300)
        assert killed.returncode == -9, killed.stderr[-2000:]
        finished = subprocess.run([sys.executable, "-m", "minispec.tools.train_heads", *argv], env=env,
                                  capture_output=True, text=True, timeout=300)
        assert finished.returncode == 0, (kill_at, finished.stderr[-2000:])
        assert json.loads((out / "training" / "progress.json").read_text())["epochs_done"] == 2
        minispec.load_draft_head(out, target)
