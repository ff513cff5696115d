"""The shared model interface (models/base.py), for every family: prefill can skip the output head for
positions whose logits nobody reads, without changing the cache or the logits it does return; the
oneDNN-packed copies of the linear layers' weights (models/kernels.py) follow their weights."""

import pytest
import torch

import minispec
from conftest import TINY_CONFIGS
from minispec import native
from minispec.models import base, kernels

PROMPT = torch.tensor([[5, 17, 33, 8, 90, 41, 2, 63]])
DECODER = torch.tensor([[0, 5, 17, 33, 8, 90]])  # T5: decoder tokens after the encoded prompt


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_prefill_logits_for_the_last_positions_only(reference_dirs, kind):
    model = minispec.load(reference_dirs[kind][1])
    model.setup_caches(1, 16)
    start = model.encode(PROMPT)
    tokens = DECODER if model.is_encoder_decoder else start
    full = model.prefill(tokens)
    after_full = model.decode(torch.tensor([[7]]))
    for logits_for in (0, 1, 3):
        last = model.prefill(tokens, logits_for=logits_for)
        assert last.shape == (1, logits_for, model.vocab_size)
        torch.testing.assert_close(last, full[:, full.shape[1] - logits_for:], atol=1e-5, rtol=0)
        assert model.length == tokens.shape[1]  # the cache holds every token, whatever was returned
        torch.testing.assert_close(model.decode(torch.tensor([[7]])), after_full, atol=1e-5, rtol=0)


def packed_modules(model):
    return [module for module in [*model.modules(), model.head] if getattr(module, "packed", False)]


def test_packed_weights_follow_their_weights_through_conversions(reference_dirs):
    """The oneDNN-packed copy of a weight is found by its address: it must go with the weight's data,
    not with its Parameter, or `.half()`, `.to()` and `param.data = ...` leave stale copies alive, and a
    new tensor placed at a freed address gets another weight's matrix."""
    model, unpacked = (minispec.load(reference_dirs["llama"][1]) for _ in range(2))
    assert packed_modules(model), "this CPU packs float32 weights"
    for module in packed_modules(unpacked):
        module.packed = False
    for m in (model, unpacked):
        m.setup_caches(1, 16)
        m.prefill(PROMPT)
    old = [kernels._PACKED[module.weight.data_ptr()] for module in packed_modules(model)]
    for m in (model, unpacked):
        m.half().float()  # the Parameters stay; their data is new (rounded), packed again on first use
    torch.testing.assert_close(model.prefill(PROMPT), unpacked.prefill(PROMPT), atol=1e-4, rtol=0)
    assert not any(entry is kept for entry in old for kept in kernels._PACKED.values())  # none stays alive
    layer = next(module for module in model.modules() if isinstance(module, base.Linear) and module.packed)
    x = torch.randn(3, layer.in_features)
    for _ in range(3):  # new data, often at the address the last one freed
        layer.weight.data = torch.randn_like(layer.weight)
        torch.testing.assert_close(layer(x), x @ layer.weight.T, atol=1e-4, rtol=1e-4)


def test_only_a_tied_embedding_is_packed(reference_dirs):
    """An input embedding is only indexed; packing it would copy the largest matrix for nothing."""
    untied = minispec.load(reference_dirs["llama"][1])
    tied = minispec.load(reference_dirs["gpt2"][1])
    assert not isinstance(untied.head, base.Embedding) and isinstance(tied.head, base.Embedding)
    assert not any(isinstance(module, base.Embedding) for module in packed_modules(untied))
    assert tied.head.packed


@pytest.mark.parametrize("threads", [1, 2])
def test_rms_norm_in_one_call_is_the_formula_and_row_invariant(threads):
    """float32 on a CPU, RMSNorm is one call of minispec's (layer.cpp): the formula to float32's
    rounding, and each row's numbers those of the row alone, whatever the row count."""
    if not native.available():
        pytest.skip("minispec's CPU kernels cannot be built here")
    generator = torch.Generator().manual_seed(0)
    norm = base.RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=generator) + 0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape, scale in [((1, 1, 576), 1.0), ((3, 5, 576), 30.0), ((70, 576), 1e-3)]:
            x = torch.randn(shape, generator=generator) * scale
            y = norm(x)
            wide = x.double()
            exact = norm.weight.double() * wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)
            torch.testing.assert_close(y.double(), exact, rtol=3e-6, atol=1e-7)
            rows = x.reshape(-1, 576)
            assert all(torch.equal(norm(row[None]), y.reshape(-1, 576)[i:i + 1]) for i, row in enumerate(rows))
    finally:
        torch.set_num_threads(before)


def test_compile_leaves_inductors_settings_to_the_user(reference_dirs):
    """CachedLM.compile changes no global setting of inductor's: a model loaded without compile and
    compiled later finds the instruction-set probe as the user left it (a load that compiles skips it:
    minispec.native.install, tests/test_compile.py)."""
    config, saved = torch._inductor.config.cpp, torch._inductor.config.cpp.vec_isa_ok
    try:
        config.vec_isa_ok = None
        minispec.load(reference_dirs["llama"][1]).compile()
        assert config.vec_isa_ok is None
    finally:
        config.vec_isa_ok = saved
