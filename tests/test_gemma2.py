"""Gemma 2 text models against the reference implementation (Gemma2ForCausalLM): soft-capped attention scores
and logits, even layers sliding, one RoPE base, no q/k norm. Prefill, cached decoding and rollback past the
window; greedy generation in float32, bfloat16 and float16; the reference's defaults and a null cap;
speculative greedy output equal to plain greedy (chains, trees, int8/int4 self-drafts, batches, two
tensor-parallel ranks, compiled), row invariance, the sampled joint distribution the target's, and a GGUF
file converted."""

import copy
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_CONFIGS, gemma_init, noisy_copy, save_reference, spread_init, target_and_drafts
from test_compile import test_compiled_decoding_matches_eager_and_never_recompiles as compiled_check
from test_llama import assert_logits_close, random_tokens, reference_logits
from test_rows import mismatched_rows
from test_speculative import SMALL_VOCAB, assert_sampled_from, exact_joint
from test_tp import torchrun

import minispec
from minispec import generate
from minispec.loading.checkpoint import load_model
from minispec.models.gemma import GemmaConfig


@pytest.fixture(scope="module")
def loaded(reference_dirs):
    reference, directory = reference_dirs["gemma2"]
    return reference, load_model(directory)


def test_config_as_the_reference_reads_it(loaded):
    reference, model = loaded
    c = model.config
    assert reference.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert c.windows == (8, None, 8) and c.rope_theta == c.local_rope_theta == 10000.0 and not c.qk_norm
    assert (c.attention_softcap, c.logit_softcap) == (2.0, 5.0) and model.layers[0].attention.q_norm is None


def test_prefill_decode_and_rollback_match_reference(loaded):
    """Past the sliding window of 8, in a prefill and one token at a time through the cache."""
    hf_model, model = loaded
    tokens = random_tokens(20, seed=1)
    model.setup_caches(1, 64)
    assert_logits_close(model.prefill(torch.tensor([tokens]))[0], reference_logits(hf_model, tokens))
    for step, token in enumerate(random_tokens(12, seed=3)):
        tokens.append(token)
        assert_logits_close(model.decode(torch.tensor([[token]]))[0, -1], reference_logits(hf_model, tokens)[-1],
                            msg=f"step {step}")
    model.rollback(len(tokens) - 3)
    tokens = tokens[:-3] + [5, 6]
    assert_logits_close(model.decode(torch.tensor([[5, 6]]))[0], reference_logits(hf_model, tokens)[-2:])
    # Without either cap the reference's logits differ: the test would notice one left out.
    for change in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None}):
        other = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**{**hf_model.config.to_dict(), **change}))
        other.load_state_dict(hf_model.state_dict())
        assert not torch.allclose(reference_logits(other.eval(), tokens).exact, reference_logits(hf_model, tokens).exact,
                                  atol=1e-2), change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_greedy_generation_matches_reference(reference_dirs, dtype):
    """The reference run in the same dtype: the same 32 greedy tokens."""
    hf_model, directory = reference_dirs["gemma2"]
    model, hf_model = load_model(directory, dtype=dtype), copy.deepcopy(hf_model).to(dtype)
    prompt = random_tokens(6, seed=4)
    ours = generate(model, prompt, max_new_tokens=32, temperature=0.0, ignore_eos=True).tokens
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) >= 8


def test_defaults_and_null_caps(tmp_path):
    """A config.json that leaves the caps, layer_types and RoPE out reads as the reference's defaults (caps
    50 and 30, every other layer sliding); a null cap is no cap, not the default."""
    config = {key: value for key, value in TINY_CONFIGS["gemma2"]().to_dict().items()
              if key not in ("attn_logit_softcapping", "final_logit_softcapping", "layer_types", "rope_parameters")}
    hf_model = gemma_init(spread_init(transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**config)).eval(), 0))
    save_reference(hf_model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = load_model(tmp_path).config
    assert (c.attention_softcap, c.logit_softcap, c.windows, c.rope_theta) == (50.0, 30.0, (8, None, 8), 10000.0)
    (tmp_path / "config.json").write_text(json.dumps({**config, "attn_logit_softcapping": None,
                                                      "final_logit_softcapping": None}))
    model = load_model(tmp_path)
    assert (model.config.attention_softcap, model.config.logit_softcap) == (0.0, 0.0)
    tokens = random_tokens(12, seed=2)
    model.setup_caches(1, 16)
    uncapped = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **{**config, "attn_logit_softcapping": None, "final_logit_softcapping": None})).eval()
    uncapped.load_state_dict(hf_model.state_dict())
    assert_logits_close(model.prefill(torch.tensor([tokens]))[0], reference_logits(uncapped, tokens))


def test_one_rope_for_every_layer():
    """Gemma 2's rope_parameters hold one RoPE for every layer (Gemma 3's one per kind of layer): its base
    read for both kinds, a scaling refused in one line."""
    config = TINY_CONFIGS["gemma2"]().to_dict()
    c = GemmaConfig.from_hf({**config, "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}})
    assert c.rope_theta == c.local_rope_theta == 500.0
    for scaled in ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                   {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        with pytest.raises(ValueError, match="rope_type 'linear' is not supported|Gemma 2 with rope scaling"):
            GemmaConfig.from_hf({**config, **scaled})


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_drafts("gemma2", tmp_path_factory)


def test_speculative_greedy_equals_plain_greedy(models):
    target = models["target"]
    prompt = random_tokens(12, seed=5)
    baseline = generate(target, prompt, max_new_tokens=40, ignore_eos=True).tokens
    assert len(set(baseline)) >= 8
    for name in ("same", "noisy", "independent"):
        for gamma in (1, 3, 5, "auto"):
            out = generate(target, prompt, draft=models[name], gamma=gamma, max_new_tokens=40, ignore_eos=True)
            assert out.tokens == baseline, (name, gamma)
    for draft, tree in (("lookup", 8), (models["noisy"], 4), ("int8", None), ("int4", None)):  # trees, self-drafts
        out = generate(target, prompt, draft=draft, tree=tree, max_new_tokens=40, ignore_eos=True)
        assert out.tokens == baseline, (draft, tree)
    prompts = [prompt, random_tokens(5, seed=6), random_tokens(9, seed=7)]  # batched: each as it would alone
    alone = [generate(target, p, max_new_tokens=20, ignore_eos=True).tokens for p in prompts]
    together = generate(target, prompts, draft=models["noisy"], batch_size=2, max_new_tokens=20, ignore_eos=True)
    assert [out.tokens for out in together] == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_every_row_computes_as_it_would_alone(reference_dirs, dtype):
    """Soft-capped attention takes PyTorch's path, which keeps row invariance: batch rows and verify
    widths compute each token's logits bit for bit as a 1-token forward."""
    model = minispec.load(reference_dirs["gemma2"][1], dtype=dtype)
    with torch.inference_mode():
        assert mismatched_rows(model) == []


def test_compiled_decoding_matches_eager(tmp_path):
    compiled_check(None, tmp_path, "gemma2")  # test_compile's, on a Gemma 2: no recompiles either


def test_tensor_parallel_parity_and_speculative_greedy(reference_dirs, tmp_path):
    """Two ranks (torchrun): sharded logits and greedy tokens as one process's, speculative = plain, row
    invariance per rank (tp_worker's checks of a family)."""
    reference, target = reference_dirs["gemma2"]
    draft = save_reference(noisy_copy(reference, seed=1, scale=0.05), tmp_path / "draft")
    script = tmp_path / "worker.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nimport tp_worker\n"
                      f"tp_worker.check_family('gemma2', {str(target)!r}, {str(draft)!r})\n"
                      "tp_worker.dist.barrier()\ntp_worker.dist.destroy_process_group()\n")
    result = torchrun(script)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for line in ("ok gemma2: parity, speculative = plain", "ok gemma2: row invariance"):
        assert result.stdout.count(line) == 2, (line, result.stdout)  # once per rank


def test_sampled_joint_distribution_is_the_targets(tmp_path_factory):
    """Speculative sampling with a noisy Gemma 2 draft: the first three tokens of many requests against the
    target's exact joint (test_speculative's chi-square and total-variation checks)."""
    config = transformers.Gemma2Config(vocab_size=SMALL_VOCAB, hidden_size=16, intermediate_size=32, head_dim=8,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                       max_position_embeddings=32, sliding_window=2, tie_word_embeddings=False,
                                       attn_logit_softcapping=1.0, final_logit_softcapping=3.0)
    torch.manual_seed(0)
    reference = gemma_init(spread_init(transformers.Gemma2ForCausalLM(config).eval(), 0, gain=1.0))
    target, draft = (minispec.load(save_reference(model, tmp_path_factory.mktemp(name))) for name, model in
                     (("g2v16", reference), ("g2v16_noisy", noisy_copy(reference, seed=1, scale=0.2))))
    prompt, draws, settings = [1, 2, 3], 6000, {"temperature": 1.0, "top_k": 3}
    joint = exact_joint(target, prompt, minispec.Sampling(**settings), length=3)
    counts = Counter(tuple(generate(target, prompt, draft=draft, gamma=2, max_new_tokens=3, seed=seed,
                                    ignore_eos=True, **settings).tokens) for seed in range(draws))
    assert_sampled_from(counts, joint, draws)


def test_gguf_file_converts_to_the_reference(tmp_path):
    """A Gemma 2 file as llama.cpp writes one (norms stored as 1 + w, its caps and window in the metadata),
    the even layers sliding as llama.cpp reads them: the converted folder loads in minispec and in the
    reference with the reference's logits. Without the caps in the file, llama.cpp's defaults (50, 30)."""
    from gguf import GGUFValueType
    from test_gguf import PROMPT, model_to_gguf

    from minispec.loading.gguf import convert_gguf

    reference = make_gemma2(num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=16, layer_types=None,
                            tie_word_embeddings=True)  # llama.cpp writes no output tensor for Gemma 2
    stored = copy.deepcopy(reference)
    with torch.no_grad():
        for name, weight in stored.named_parameters():
            if name.endswith("norm.weight"):
                weight.add_(1.0)
    c, f32 = reference.config, GGUFValueType.FLOAT32
    metadata = {"gemma2.attention.sliding_window": (4, GGUFValueType.UINT32),
                "gemma2.attention.key_length": (16, GGUFValueType.UINT32),
                "gemma2.attention.value_length": (16, GGUFValueType.UINT32),
                "gemma2.attn_logit_softcapping": (c.attn_logit_softcapping, f32),
                "gemma2.final_logit_softcapping": (c.final_logit_softcapping, f32)}
    out = convert_gguf(model_to_gguf(stored, tmp_path / "model.gguf", metadata=metadata), tmp_path / "converted",
                       progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma2" and config["layer_types"] == reference.config.layer_types
    tokens = PROMPT * 2  # past the window
    model = load_model(out, dtype=torch.float32)
    model.setup_caches(1, 32)
    with torch.no_grad():
        logits = model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]
    expected = reference_logits(reference, tokens).exact
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
    imported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(reference_logits(imported, tokens).exact, expected, atol=1e-4, rtol=0)
    del metadata["gemma2.attn_logit_softcapping"], metadata["gemma2.final_logit_softcapping"]
    out = convert_gguf(model_to_gguf(stored, tmp_path / "default.gguf", metadata=metadata), tmp_path / "default",
                       progress=False)
    config = json.loads((out / "config.json").read_text())
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"]) == (50.0, 30.0)


def make_gemma2(**changes):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**{**TINY_CONFIGS["gemma2"]().to_dict(), **changes})
    return gemma_init(spread_init(transformers.Gemma2ForCausalLM(config).eval(), 0))
