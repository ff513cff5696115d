"""Llama-family models (Llama MHA/GQA with llama3 and YaRN rope scaling, Qwen2, Qwen3, Mistral sliding window) against
the reference implementation: prefill, cached decoding, rollback, greedy generation, checkpoint errors."""

import copy
import json
from dataclasses import dataclass

import pytest
import torch
import transformers
from conftest import TINY_CONFIGS, save_reference, spread_init

from minispec import generate
from minispec.loading.checkpoint import CheckpointError, load_model
from minispec.models.base import apply_rope
from minispec.models.llama import LlamaConfig, rope_tables

KINDS = ["llama", "llama_gqa", "qwen2", "qwen3"]
# Our float32 logits are compared with the reference's computed in float64 (the exact values, up to
# float64 rounding): within ATOL, or within twice the reference's own float32 error where that is
# larger. Comparing two float32 results directly fails for rounding alone on some CPUs (AVX2 and
# AVX-512 kernels add in different orders), and there our decode steps are the closer to float64.
ATOL = 1e-4


@dataclass
class Reference:
    exact: torch.Tensor  # the reference in float64, cast to float32
    float32: torch.Tensor  # the reference in float32

    def __getitem__(self, index):
        return Reference(self.exact[index], self.float32[index])


def reference_logits(hf_model, tokens):
    with torch.no_grad():
        exact = copy.deepcopy(hf_model).double()(torch.tensor([tokens])).logits[0].float()
        return Reference(exact, hf_model(torch.tensor([tokens])).logits[0])


def assert_logits_close(actual, reference, floor=ATOL, **kwargs):
    atol = max(floor, 2 * (reference.float32 - reference.exact).abs().max().item())
    torch.testing.assert_close(actual, reference.exact, atol=atol, rtol=0, **kwargs)


def random_tokens(n, seed, vocab=96):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def loaded(reference_dirs):
    return {kind: (reference_dirs[kind][0], load_model(reference_dirs[kind][1])) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_reference(loaded, kind):
    hf_model, model = loaded[kind]
    tokens = random_tokens(20, seed=1)
    model.setup_caches(1, 64)
    logits = model.prefill(torch.tensor([tokens]))
    assert logits.dtype == torch.float32 and logits.shape == (1, 20, 96)
    assert_logits_close(logits[0], reference_logits(hf_model, tokens))


@pytest.mark.parametrize("kind", KINDS)
def test_decode_and_rollback_match_reference(loaded, kind):
    hf_model, model = loaded[kind]
    tokens = random_tokens(8, seed=2)
    model.setup_caches(1, 64)
    model.prefill(torch.tensor([tokens]))
    for step, token in enumerate(random_tokens(16, seed=3)):
        tokens.append(token)
        logits = model.decode(torch.tensor([[token]]))[0, -1]
        assert_logits_close(logits, reference_logits(hf_model, tokens)[-1], msg=f"step {step}")
    # Forget the last 3 positions, then decode different tokens (a block of 2, then 1) over them.
    model.rollback(len(tokens) - 3)
    tokens = tokens[:-3] + [5, 6]
    logits = model.decode(torch.tensor([[5, 6]]))[0]
    assert_logits_close(logits, reference_logits(hf_model, tokens)[-2:])
    tokens.append(7)
    logits = model.decode(torch.tensor([[7]]))[0, -1]
    assert_logits_close(logits, reference_logits(hf_model, tokens)[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_reference(loaded, kind):
    hf_model, model = loaded[kind]
    prompt = random_tokens(6, seed=4)
    ours = generate(model, prompt, max_new_tokens=32, temperature=0.0, ignore_eos=True).tokens
    # eos_token_id=None: plain greedy, as ignore_eos. (With the model's eos id, min_new_tokens would
    # forbid EOS instead, and Qwen2 greedily emits EOS at step 21 for this prompt.)
    with torch.no_grad():
        theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
    assert ours == theirs
    assert len(set(ours)) >= 8  # a varied continuation, so the comparison means something


def test_mistral_sliding_window_matches_reference(tmp_path):
    config = transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, sliding_window=8, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    hf_model = spread_init(transformers.MistralForCausalLM(config).eval(), seed=0)
    model = load_model(save_reference(hf_model, tmp_path))
    assert model.config.windows == (8, 8)
    tokens = random_tokens(20, seed=5)
    model.setup_caches(1, 32)
    logits = model.prefill(torch.tensor([tokens]))[0]
    assert_logits_close(logits, reference_logits(hf_model, tokens))
    for token in random_tokens(6, seed=6):  # decoding past the window through the cache
        tokens.append(token)
        logits = model.decode(torch.tensor([[token]]))[0, -1]
        assert_logits_close(logits, reference_logits(hf_model, tokens)[-1])
    # Without the window the logits differ: the test would notice a mask that ignores it.
    full = reference_logits(transformers.MistralForCausalLM(
        transformers.MistralConfig(**{**config.to_dict(), "sliding_window": None})).eval(), tokens)
    assert not torch.allclose(full.exact, reference_logits(hf_model, tokens).exact, atol=1e-2)


@pytest.mark.parametrize("kind, dtype", [("llama_gqa", torch.bfloat16), ("qwen3", torch.bfloat16),
                                         ("qwen3", torch.float16)])
def test_bfloat16_close_to_float32(reference_dirs, kind, dtype):
    hf_model, directory = reference_dirs[kind]
    model = load_model(directory, dtype=dtype)
    assert model.dtype == dtype
    tokens = random_tokens(12, seed=7)
    model.setup_caches(1, 16)
    logits = model.prefill(torch.tensor([tokens]))[0]
    reference = reference_logits(hf_model, tokens).exact
    assert logits.dtype == torch.float32
    # The spread-init model amplifies rounding (the reference's own bf16 run is off by ~3 of 28 at worst),
    # so compare on average: a wrong rope or norm in bf16 would be off by far more.
    assert (logits - reference).abs().mean() < 0.05 * reference.abs().mean()
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.75


def test_shape_mismatch_names_tensor(reference_dirs, tmp_path):
    _, directory = reference_dirs["llama"]
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    with pytest.raises(CheckpointError, match=r"tensor \S+ has shape"):
        load_model(tmp_path)


def test_config_key_layouts():
    from minispec.models.llama import LlamaConfig

    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=128)
    old = LlamaConfig.from_hf({**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = LlamaConfig.from_hf({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}})
    assert old == new and old.rope_theta == 5e5 and old.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert old.n_kv_heads == 4 and old.head_dim == 8 and old.windows == (None, None)
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="llama3 rope scaling needs low_freq_factor, high_freq_factor"):
        LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                      "original_max_position_embeddings": 64}})
    with pytest.raises(ValueError, match="yarn rope scaling needs factor"):
        LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": None}})


@pytest.mark.parametrize("family, rope", [
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    ("llama", {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
               "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5}),
    ("llama", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "attention_factor": 1.3,
               "truncate": False}),
    ("qwen2", {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),  # older key layout
])
def test_yarn_rope_scaling_matches_reference(tmp_path, family, rope):
    """YaRN context extension (Qwen2.5's long-context configs): logits past the original context, in a
    prefill and through the cache, equal the reference's. head_dim 32 and theta 1000 put the ramp
    between kept and slowed pairs inside the 16 pairs, starting past pair 0 (where floor and ceil differ)."""
    config_class, model_class = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                                 "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    config = config_class(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                          rope_theta=1000.0, rope_scaling=rope)
    torch.manual_seed(0)
    hf_model = spread_init(model_class(config).eval(), seed=0)
    model = load_model(save_reference(hf_model, tmp_path))
    assert model.config.rope_scaling["rope_type"] == "yarn"
    tokens = random_tokens(300, seed=8)  # past the original context
    model.setup_caches(1, 512)
    reference = reference_logits(hf_model, tokens)
    assert_logits_close(model.prefill(torch.tensor([tokens[:290]]))[0], reference[:290])
    # The decode steps to the reference's own float32 rounding over all ten (one position's alone is
    # 1e-4 here, which two float32 computations can straddle by rounding)
    floor = 2 * (reference.float32[290:] - reference.exact[290:]).abs().max().item()
    for i in range(290, 300):
        assert_logits_close(model.decode(torch.tensor([[tokens[i]]]))[0, -1], reference[i], floor)
    # Plain RoPE gives different logits: the test would notice yarn being ignored.
    plain = model_class(config_class(**{**config.to_dict(), "rope_scaling": None, "rope_parameters": None})).eval()
    plain.load_state_dict(hf_model.state_dict())
    assert hf_model.config.rope_parameters["rope_type"] == "yarn" and plain.config.rope_parameters["rope_type"] == "default"
    assert not torch.allclose(reference_logits(plain, tokens).exact, reference.exact, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_rotate_half_bit_for_bit(dtype):
    """apply_rope's roll with signed sines is the reference's rotate_half, bit for bit."""
    config = LlamaConfig.from_hf(TINY_CONFIGS["llama"]().to_dict())
    cos, signed_sin = rope_tables(config, 64, torch.device("cpu"))
    half = config.head_dim // 2
    sin = torch.cat([signed_sin[:, half:]] * 2, dim=-1)  # the reference's table: halves repeated
    positions = torch.tensor([0, 7, 63])
    x = torch.randn(2, 3, 4, config.head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    x1, x2 = x.float().chunk(2, dim=-1)
    wanted = (x.float() * cos[positions, None] + torch.cat([-x2, x1], -1) * sin[positions, None]).to(dtype)
    assert torch.equal(apply_rope(x, cos[positions], signed_sin[positions]), wanted)


def test_qwen3_config_as_the_reference_reads_it():
    """Qwen3's head_dim defaults to 128 (not hidden_size / heads), it has no MLP bias, its q/k norm is on,
    and its sliding window follows Qwen2's rules."""
    base = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=32, max_position_embeddings=128, mlp_bias=True, model_type="qwen3")
    config = LlamaConfig.from_hf(base)
    wanted = transformers.Qwen3Config(**base)
    assert config.head_dim == wanted.head_dim == 128 and config.n_kv_heads == wanted.num_key_value_heads == 32
    assert config.qk_norm and not config.mlp_bias and config.windows == (None, None)
    assert LlamaConfig.from_hf({**base, "model_type": "qwen2"}).head_dim == 2
    windowed = {**base, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    assert LlamaConfig.from_hf(windowed).windows == (None, 4)
    assert not LlamaConfig.from_hf({**base, "model_type": "llama"}).qk_norm


def test_qwen3_sliding_window_matches_reference(tmp_path):
    """Qwen3 slides the layers from max_window_layers on when use_sliding_window is set (here layer 1)."""
    config = transformers.Qwen3Config(**{**TINY_CONFIGS["qwen3"]().to_dict(), "use_sliding_window": True,
                                         "sliding_window": 8, "max_window_layers": 1, "layer_types": None})
    torch.manual_seed(3)
    hf_model = spread_init(transformers.Qwen3ForCausalLM(config).eval(), seed=3)
    model = load_model(save_reference(hf_model, tmp_path))
    assert model.config.windows == (None, 8) and hf_model.config.layer_types == ["full_attention", "sliding_attention"]
    tokens = random_tokens(20, seed=5)
    model.setup_caches(1, 32)
    assert_logits_close(model.prefill(torch.tensor([tokens]))[0], reference_logits(hf_model, tokens))
    for token in random_tokens(4, seed=6):  # decoding past the window through the cache
        tokens.append(token)
        assert_logits_close(model.decode(torch.tensor([[token]]))[0, -1], reference_logits(hf_model, tokens)[-1])
