"""Draft heads (minispec/heads): the models' hidden states, published EAGLE and Medusa layouts against
straightforward re-implementations, exactness of decoding with a head (greedy = plain in three dtypes,
batch = alone, sampled = the target's joint distribution), bad head folders, and training."""

import contextlib
import io
import json
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import save_reference, spread_init
from test_speculative import assert_sampled_from, exact_joint

import minispec
from minispec.loading.weights import save_safetensors

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
        plain = model.decode_rows(tokens, [0], eager=True)
        logits, hidden = model.decode_rows(tokens, [0], eager=True, hidden=True)
        assert torch.equal(plain, logits) and torch.equal(model.logits(hidden), logits)
        n = tokens.shape[1]
        model.decode_rows(tokens[:, :n - 2], [0], eager=True)
        for j in range(n - 2, n):  # the last two tokens one at a time
            _, alone = model.decode_rows(tokens[:, j:j + 1], [j], eager=True, hidden=True)
            assert torch.equal(alone[0, 0], hidden[0, j])


def test_published_eagle_layout_drafts_as_a_straightforward_reimplementation(reference_dirs, tmp_path):
    """An EAGLE head in its authors' layout against the same math written out with the reference's own
    Llama layer: f̂ = Layer(fc([embed(x_{i+1}), f_i])), layer 0 without its input norm, the target's head."""
    reference, directory = reference_dirs["llama_gqa"]
    target = minispec.load(directory)
    hf = json.loads((directory / "config.json").read_text())
    head_dir, weights, config = write_eagle(tmp_path / "eagle", hf)
    head = minispec.load_draft_head(head_dir, target)
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
        logits, predicted = head.decode_rows(tokens[:, 1:], [0], eager=True, hidden=True, inputs=states[:, :-1])
    torch.testing.assert_close(predicted, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-4, atol=1e-4)


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
    """For each dtype: the tiny GQA llama target and its random EAGLE and Medusa heads."""
    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    eagle_dir, _, _ = write_eagle(tmp_path_factory.mktemp("eagle"), hf)
    medusa_dir, _ = write_medusa(tmp_path_factory.mktemp("medusa"), hf["hidden_size"], hf["vocab_size"])
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        target = minispec.load(directory, dtype=dtype)
        out[dtype] = target, {"eagle": minispec.load_draft_head(eagle_dir, target),
                              "medusa": minispec.load_draft_head(medusa_dir, target)}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_with_a_head_is_plain_greedy(gqa_heads, kind, dtype):
    target, heads = gqa_heads[dtype]
    plain = minispec.generate(target, PROMPT, max_new_tokens=40, ignore_eos=True)
    for gamma in (1, 3, "auto"):
        out = minispec.generate(target, PROMPT, draft=heads[kind], gamma=gamma, max_new_tokens=40, ignore_eos=True)
        assert out.tokens == plain.tokens, (gamma, out.stats)
        assert gamma == "auto" or out.stats["proposed"] > 0 and out.stats["draft_calls"] > 0


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_batched_rows_draft_as_alone(gqa_heads, kind):
    """Rows of a batch with a head: each request's tokens those it gets alone (greedy, and sampled for a
    seed with a fixed gamma)."""
    target, heads = gqa_heads[torch.float32]
    prompts = [PROMPT, PROMPT[:5], [3, 4, 5], PROMPT[2:]]
    for settings in ({}, {"temperature": 1.0, "top_k": 5}):
        together = minispec.generate(target, prompts, draft=heads[kind], gamma=3, max_new_tokens=24, seed=4,
                                     ignore_eos=True, batch_size=3, **settings)
        for prompt, out in zip(prompts, together):
            alone = minispec.generate(target, prompt, draft=heads[kind], gamma=3, max_new_tokens=24, seed=4,
                                      ignore_eos=True, **settings)
            assert out.tokens == alone.tokens


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
    return target, {"eagle": minispec.load_draft_head(eagle_dir, target),
                    "medusa": minispec.load_draft_head(medusa_dir, target)}


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_sampled_tokens_have_the_targets_joint_distribution(vocab16_heads, kind):
    """Four tokens of many requests, each with its own seed, against the target's exact joint: the first
    comes from the prompt's forward (no states yet), the next three from steps verifying the head's two
    guesses, drawn from its q (chi-square at p > 0.001, test_speculative.assert_sampled_from)."""
    target, heads = vocab16_heads
    sampling, prompt, draws = {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 2000
    joint = exact_joint(target, prompt, minispec.Sampling(**sampling), length=4)
    counts, accepted, verified = Counter(), 0, 0
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=heads[kind], gamma=2, max_new_tokens=4, seed=seed,
                                ignore_eos=True, **sampling)
        counts[tuple(out.tokens)] += 1
        accepted, verified = accepted + out.stats["accepted"], verified + out.stats["verified"]
    print(f"{kind}: acceptance rate {accepted / verified:.3f}")
    assert 0.1 < accepted / verified < 0.9
    assert_sampled_from(counts, joint, draws)


def test_training_raises_acceptance_above_an_untrained_heads(tmp_path):
    """`train` on a tiny target's own answers, in seconds: the head's greedy guesses are accepted more
    often on prompts it never saw than the untrained head's (which starts as heads/train.py's new_head);
    an interrupted run resumes (the epochs done are kept), and the folder loads as a head."""
    from minispec.heads import train

    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    torch.manual_seed(0)
    target = minispec.load(save_reference(spread_init(transformers.LlamaForCausalLM(config).eval(), 0, gain=1.0),
                                          tmp_path / "target"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 16, (5,), generator=g).tolist() for _ in range(64)]
    unseen = [torch.randint(3, 16, (5,), generator=g).tolist() for _ in range(16)]

    def acceptance(head):
        out = minispec.generate(target, unseen, draft=head, gamma=3, max_new_tokens=48)
        return sum(o.stats["accepted"] for o in out) / sum(o.stats["proposed"] for o in out)

    untrained = train.train(target, tmp_path / "head", "eagle", prompts, epochs=0, max_new_tokens=48, chat=False)
    train.train(target, tmp_path / "head", "eagle", prompts, epochs=10, max_new_tokens=48, chat=False)
    assert json.loads((tmp_path / "head" / "training" / "progress.json").read_text())["epochs_done"] == 10
    train.train(target, tmp_path / "head", "eagle", prompts, epochs=20, max_new_tokens=48, chat=False)  # resumes
    trained = minispec.load_draft_head(tmp_path / "head", target)
    before, after = acceptance(untrained), acceptance(trained)
    print(f"acceptance {before:.3f} untrained, {after:.3f} trained")
    assert after > before + 0.05


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
    eagle3 = tmp_path / "eagle3"
    eagle3.mkdir()
    (eagle3 / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 32}))
    with pytest.raises(minispec.CheckpointError, match="EAGLE-3"):
        minispec.load_draft_head(eagle3, target)
    other = minispec.load(reference_dirs["llama"][1])  # hidden size 32, not 64
    with pytest.raises(minispec.CheckpointError, match="hidden_size 64 cannot draft"):
        minispec.load_draft_head(eagle_dir, other)
    head = minispec.load_draft_head(eagle_dir, target)
    with pytest.raises(ValueError, match="loaded for"):
        minispec.generate(minispec.load(directory), PROMPT, draft=head)
    with pytest.raises(ValueError, match="draft heads guess one sequence"):
        minispec.generate(target, PROMPT, draft=head, beams=2)
    with pytest.raises(minispec.CheckpointError, match="not a directory"):
        minispec.load_draft_head(tmp_path / "missing", target)


def test_run_py_drafts_with_a_head_folder(reference_dirs, tmp_path):
    """--draft DIR: a head's folder is loaded as a head for the target, and greedy output is plain's."""
    import run

    directory = reference_dirs["llama_gqa"][1]
    eagle_dir, _, _ = write_eagle(tmp_path / "eagle", json.loads((directory / "config.json").read_text()))
    ids = ",".join(map(str, PROMPT))
    outputs = []
    for draft in (str(eagle_dir), "none"):
        args = ["--target", str(directory), "--draft", draft, "--prompt-ids", ids, "--max-new-tokens", "12",
                "--ignore-eos", "--gamma", "2", "--json"]
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert run.main(args) == 0
        outputs.append(json.loads(buffer.getvalue()))
    assert outputs[0]["tokens"] == outputs[1]["tokens"]
    assert outputs[0]["stats"]["proposed"] > 0
