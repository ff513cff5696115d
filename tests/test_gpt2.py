"""GPT-2 against the reference implementation: prefill, cached decoding, rollback, greedy generation."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minispec import generate
from minispec.loading.checkpoint import load_model
from minispec.models.gpt2 import GPT2Config

ATOL = 1e-4
# Fixed tokens (not random) so a failure is reproducible; 24 long = 8 prompt + 16 decode steps.
SEQUENCE = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54, 29, 88, 16, 70, 45, 9, 31, 66, 24, 81, 50, 38]


@pytest.fixture(scope="module")
def gpt2(reference_dirs):
    reference, directory = reference_dirs["gpt2"]
    return reference, load_model(directory), directory


@torch.no_grad()
def reference_logits(reference, tokens):
    return reference(torch.tensor([tokens])).logits


def test_prefill_matches_reference(gpt2):
    reference, model, _ = gpt2
    model.setup_caches(1, 64)
    logits = model.prefill(torch.tensor([SEQUENCE]))
    assert logits.dtype == torch.float32 and logits.shape == (1, len(SEQUENCE), model.vocab_size)
    torch.testing.assert_close(logits, reference_logits(reference, SEQUENCE), atol=ATOL, rtol=0)


def test_incremental_decode_and_rollback(gpt2):
    reference, model, _ = gpt2
    model.setup_caches(1, 64)
    full = reference_logits(reference, SEQUENCE)
    model.prefill(torch.tensor([SEQUENCE[:8]]))
    for i in range(8, len(SEQUENCE)):  # 16 single-token steps through the cache
        logits = model.decode(torch.tensor([[SEQUENCE[i]]]))
        torch.testing.assert_close(logits[0, -1], full[0, i], atol=ATOL, rtol=0)
    assert model.length == len(SEQUENCE)

    # Forget the last 3 positions and write different tokens there (as after a speculative rejection):
    # the stale cache entries must not leak into the new logits.
    model.rollback(len(SEQUENCE) - 3)
    new_sequence = SEQUENCE[:-3] + [1, 95, 7]
    assert new_sequence[-3:] != SEQUENCE[-3:]
    logits = model.decode(torch.tensor([new_sequence[-3:]]))
    torch.testing.assert_close(logits[0], reference_logits(reference, new_sequence)[0, -3:], atol=ATOL, rtol=0)


def test_greedy_generation_matches_reference(gpt2):
    reference, model, _ = gpt2
    prompt = SEQUENCE[:6]
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
    )[0, len(prompt):].tolist()
    tokens = generate(model, prompt, max_new_tokens=32, temperature=0.0, ignore_eos=True).tokens
    assert tokens == expected
    assert len(set(tokens)) >= 8  # a collapsed model repeating one token would prove little


def test_checkpoint_without_transformer_prefix(gpt2, tmp_path):
    """The original openai-community/gpt2 files: no `transformer.` prefix, attention-mask buffers stored."""
    _, model, directory = gpt2
    weights = {k.removeprefix("transformer."): v for k, v in load_file(directory / "model.safetensors").items()}
    config = json.loads((directory / "config.json").read_text())
    n = config["n_positions"]
    for i in range(config["n_layer"]):
        weights[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.uint8)).view(1, 1, n, n)
        weights[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(weights, tmp_path / "model.safetensors")
    shutil.copy(directory / "config.json", tmp_path / "config.json")

    unprefixed = load_model(tmp_path)
    for name, tensor in model.state_dict().items():
        assert torch.equal(unprefixed.state_dict()[name], tensor), name
    tokens = torch.tensor([SEQUENCE])
    model.setup_caches(1, 32)
    unprefixed.setup_caches(1, 32)
    assert torch.equal(unprefixed.prefill(tokens), model.prefill(tokens))


@pytest.mark.parametrize("change, problem", [
    ({"activation_function": "relu"}, "activation_function 'relu'"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"tie_word_embeddings": False}, "untied lm_head"),
])
def test_unsupported_config_is_refused(gpt2, change, problem):
    """Variants that would compute something else must fail loudly, not load with wrong outputs."""
    config = json.loads((gpt2[2] / "config.json").read_text())
    with pytest.raises(ValueError, match=problem):
        GPT2Config.from_hf({**config, **change})
