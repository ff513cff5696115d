"""T5 v1.0 (ReLU, tied head) and v1.1 (gated GELU) against the reference implementation: encoder once
per request, cached decoding, rollback, greedy generation, a batch-1 prompt under a batch of rows,
cross-attention memory in capacity buckets, compiled decoding without recompilation across prompt lengths."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters
from transformers import T5ForConditionalGeneration

import minispec
from minispec import generate
from minispec.loading.checkpoint import load_model
from minispec.models.t5 import T5Config

KINDS = ["t5_v1_0", "t5_v1_1"]
ATOL = 1e-4  # float32 logits of minispec and the reference
# 24 tokens: encoder distances reach past relative_attention_max_distance (20), the last bucket.
PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54, 29, 88, 16, 70, 45, 9, 31, 66, 24, 81, 50, 38]
# The decoder sequence: the start token, then 16 fixed tokens fed one by one.
DECODER = [0, 29, 88, 16, 70, 45, 9, 31, 66, 24, 81, 50, 38, 7, 60, 93, 21]


@pytest.fixture(scope="module", params=KINDS)
def t5(request, reference_dirs):
    reference, directory = reference_dirs[request.param]
    return reference, load_model(directory), ATOL


@torch.no_grad()
def reference_logits(reference, decoder_tokens, prompt=PROMPT):
    return reference(input_ids=torch.tensor([prompt]), decoder_input_ids=torch.tensor([decoder_tokens])).logits


def test_config(reference_dirs):
    for kind, activation, gated, scale in [("t5_v1_0", "relu", False, True), ("t5_v1_1", "gelu_new", True, False)]:
        model = load_model(reference_dirs[kind][1])
        assert model.is_encoder_decoder and model.context_length is None and model.vocab_size == 96
        assert (model.config.activation, model.config.gated, model.config.scale_decoder_outputs) == (activation, gated, scale)
    # Configs written before transformers 5 say tie_word_embeddings instead of scale_decoder_outputs.
    assert T5Config.from_hf({"model_type": "t5"}).scale_decoder_outputs  # original T5: tied and scaled
    flan = T5Config.from_hf({"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False, "pad_token_id": 0})
    assert not flan.scale_decoder_outputs and flan.decoder_start_token_id == 0
    with pytest.raises(ValueError, match="feed_forward_proj"):
        T5Config.from_hf({"feed_forward_proj": "gated-swish-x"})


def test_encode_and_prefill_match_reference(t5):
    reference, model, atol = t5
    calls = model.encoder_calls
    prefix = model.encode(torch.tensor([PROMPT]))
    assert prefix.tolist() == [[0]] and model.encoder_calls == calls + 1
    model.setup_caches(1, 32)  # after encode: must keep the encoder state
    logits = model.prefill(prefix)
    assert logits.dtype == torch.float32 and logits.shape == (1, 1, model.vocab_size)
    torch.testing.assert_close(logits, reference_logits(reference, [0]), atol=atol, rtol=0)


def test_incremental_decode_and_rollback(t5):
    reference, model, atol = t5
    calls = model.encoder_calls
    model.setup_caches(1, 32)
    model.prefill(model.encode(torch.tensor([PROMPT])))
    full = reference_logits(reference, DECODER)
    for i in range(1, len(DECODER)):  # 16 single-token steps through the cache
        logits = model.decode(torch.tensor([[DECODER[i]]]))
        torch.testing.assert_close(logits[0, -1], full[0, i], atol=atol, rtol=0)
    assert model.length == len(DECODER)

    # Forget the last 3 positions and write different tokens there (as after a speculative rejection).
    model.rollback(len(DECODER) - 3)
    new_decoder = DECODER[:-3] + [1, 95, 4]
    logits = model.decode(torch.tensor([new_decoder[-3:]]))
    torch.testing.assert_close(logits[0], reference_logits(reference, new_decoder)[0, -3:], atol=atol, rtol=0)
    assert model.encoder_calls == calls + 1  # decode steps reuse the cross-attention keys/values


def test_greedy_generation_matches_reference(t5):
    reference, model, _ = t5
    expected = reference.generate(
        torch.tensor([PROMPT]), max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0
    )[0].tolist()
    assert expected[0] == 0  # the reference's output starts with decoder_start_token_id
    calls = model.encoder_calls
    result = generate(model, PROMPT, max_new_tokens=32, temperature=0.0, ignore_eos=True)
    assert result.tokens == expected[1:]
    assert len(set(result.tokens)) >= 8  # a collapsed model repeating one token would prove little
    assert model.encoder_calls == calls + 1


def test_cross_attention_memory_grows_by_buckets_and_masks_padding(t5):
    """Encoder keys/values are padded to a power-of-two capacity (at least 64) that only grows; the
    padding never changes the logits, and a shorter prompt after a longer one reuses the buffers."""
    reference, model, atol = t5
    long_prompt = (PROMPT * 3)[:70]
    model.setup_caches(1, 8)
    buffers = []
    for prompt, capacity in [(PROMPT, 64), (PROMPT[:5], 64), (long_prompt, 128), (PROMPT, 128)]:
        model.encode(torch.tensor([prompt]))
        buffers.append(model.decoder[0].cross_attn.memory_k)
        assert buffers[-1].shape[2] == capacity and model.memory_mask.sum() == len(prompt)
        logits = model.prefill(torch.tensor([DECODER[:4]]))
        torch.testing.assert_close(logits, reference_logits(reference, DECODER[:4], prompt), atol=atol, rtol=0)
    # Refilled in place while the capacity holds: compiled graphs see the same tensors.
    assert buffers[1] is buffers[0] and buffers[3] is buffers[2] is not buffers[0]


def test_batch_one_prompt_serves_a_batch_of_rows(t5):
    """Beam search: one encoded prompt, the decoder's caches and tokens hold 3 rows."""
    _, model, atol = t5
    steps = torch.tensor([DECODER[:5]])
    model.setup_caches(1, 16)
    model.encode(torch.tensor([PROMPT]))
    single = torch.cat([model.prefill(steps[:, :1]), model.decode(steps[:, 1:])], dim=1)

    model.encode(torch.tensor([PROMPT]))
    model.setup_caches(3, 16)
    rows = steps.expand(3, -1)
    batched = torch.cat([model.prefill(rows[:, :1]), model.decode(rows[:, 1:])], dim=1)
    assert batched.shape == (3, 5, model.vocab_size)
    for row in range(3):
        torch.testing.assert_close(batched[row], batched[0], atol=1e-5, rtol=0)  # BLAS may block rows apart
        # Batched matmuls round differently from batch 1.
        torch.testing.assert_close(batched[row], single[0], atol=atol, rtol=0)


def test_reorder_cache_with_one_prompt_per_row(t5):
    """Encoder states of a batch of prompts follow their rows when beams are reordered."""
    _, model, atol = t5
    prompts = torch.tensor([PROMPT, PROMPT[::-1]])
    model.setup_caches(2, 8)
    model.encode(prompts)
    model.prefill(torch.tensor([[0], [0]]))
    model.reorder_cache(torch.tensor([1, 1]))
    after = model.decode(torch.tensor([[7], [7]]))

    model.encode(prompts[1:])  # the reference: the second prompt alone
    model.setup_caches(1, 8)
    model.prefill(torch.tensor([[0]]))
    expected = model.decode(torch.tensor([[7]]))
    for row in range(2):
        torch.testing.assert_close(after[row], expected[0], atol=atol, rtol=0)


def test_flan_style_checkpoint(reference_dirs, tmp_path):
    """A checkpoint as written for Flan-T5 / T5 v1.1: an untied, unscaled lm_head, `tie_word_embeddings:
    false` and no scale_decoder_outputs in config.json, and encoder/decoder.embed_tokens copies of shared."""
    directory = reference_dirs["t5_v1_1"][1]
    weights = load_file(directory / "model.safetensors")
    assert "lm_head.weight" not in weights  # the fixture's head is tied
    generator = torch.Generator().manual_seed(0)
    weights["lm_head.weight"] = torch.randn(weights["shared.weight"].shape, generator=generator) * 0.2
    for stack in ("encoder", "decoder"):
        weights[f"{stack}.embed_tokens.weight"] = weights["shared.weight"].clone()
    save_file(weights, tmp_path / "model.safetensors")
    config = json.loads((directory / "config.json").read_text())
    del config["scale_decoder_outputs"]
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))

    reference = T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert torch.equal(reference.lm_head.weight, weights["lm_head.weight"])  # really untied
    model = load_model(tmp_path)
    assert not model.config.scale_decoder_outputs
    model.encode(torch.tensor([PROMPT]))
    model.setup_caches(1, 32)
    logits = model.prefill(torch.tensor([DECODER]))
    torch.testing.assert_close(logits, reference_logits(reference, DECODER), atol=ATOL, rtol=0)


def test_bfloat16_is_as_accurate_as_the_reference(reference_dirs):
    """bfloat16 (the GPU default) is far from float32 on these fixtures for any implementation:
    require minispec's error to be no worse than the reference's own in bfloat16."""
    reference, directory = reference_dirs["t5_v1_0"]
    model = load_model(directory, dtype=torch.bfloat16)
    model.encode(torch.tensor([PROMPT]))
    model.setup_caches(1, 32)
    logits = model.prefill(torch.tensor([DECODER]))
    assert logits.dtype == torch.float32 and logits.isfinite().all()
    exact = reference_logits(reference, DECODER)
    reference_bf16 = T5ForConditionalGeneration(reference.config).eval().to(torch.bfloat16)
    reference_bf16.load_state_dict(reference.state_dict())
    reference_error = (reference_logits(reference_bf16, DECODER).float() - exact).abs().max()
    assert (logits - exact).abs().max() <= 1.5 * reference_error


def test_bad_input_raises_clear_errors(reference_dirs):
    model = load_model(reference_dirs["t5_v1_0"][1])
    model.setup_caches(1, 8)
    with pytest.raises(ValueError, match="encode"):
        model.prefill(torch.tensor([[0]]))  # no encoder state yet
    with pytest.raises(ValueError, match="length >= 1"):
        model.encode(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="token ids must be in"):
        model.encode(torch.tensor([[3, 96]]))
    model.encode(torch.tensor([PROMPT, PROMPT]))
    model.setup_caches(3, 8)
    with pytest.raises(ValueError, match="encoded batch of 2"):
        model.prefill(torch.zeros(3, 1, dtype=torch.long))


def test_compiled_decoder_does_not_recompile_for_new_prompt_lengths(reference_dirs):
    """The cross-attention memory is padded to a capacity bucket (64 positions here) and masked: prompts
    of other lengths reuse the compiled graphs and give the same tokens as eager decoding."""
    directory = reference_dirs["t5_v1_0"][1]
    target, draft = minispec.load(directory, compile=True), minispec.load(directory, compile=True)
    eager_target, eager_draft = minispec.load(directory), minispec.load(directory)
    settings = {"gamma": 3, "max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0}

    before = counters["stats"]["unique_graphs"]
    warm = minispec.generate(target, PROMPT, draft=draft, **settings)
    assert warm.tokens == minispec.generate(eager_target, PROMPT, draft=eager_draft, **settings).tokens
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= before + 2  # the target's verify width and the draft's single steps at least

    prompts = [PROMPT[:9], PROMPT + PROMPT[:16]]  # 9 and 40 tokens, warm-up 24: all in the 64 bucket
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs = [minispec.generate(target, prompt, draft=draft, **settings) for prompt in prompts]
    assert counters["stats"]["unique_graphs"] == graphs
    for prompt, out in zip(prompts, outputs):
        assert out.stats["acceptance_rate"] == 1.0  # the draft has the target's weights
        assert out.tokens == minispec.generate(eager_target, prompt, draft=eager_draft, **settings).tokens
    assert outputs[0].tokens != outputs[1].tokens  # outputs that ignore the prompt would prove little
    assert target.decoder[0].cross_attn.memory_k.shape[2] == 64
