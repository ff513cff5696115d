"""minispec's own CPU kernels (minispec/native): for quantized layers (qlinear.cpp), its
arithmetic against a float64 re-computation of what it promises, every row as it would be alone,
the packed layout's token lookup, and the fallback where it cannot be built; for float32 ones
(flinear.cpp), against float64 and in its order of sums (tests/test_rows.py checks its rows); for
attention over a KV cache (attention.cpp), against float64 attention and in its canonical order; a
quantized Llama layer in one call (layer.cpp), against the modules."""

import logging

import pytest
import torch

import minispec
from minispec.models.base import Feed
from minispec import native
from minispec.models import backend, kernels, quant
from minispec.models.llama import Llama

pytestmark = pytest.mark.skipif(not native.available(), reason="minispec's CPU kernel cannot be built here")


def promised(x, q, scales, offsets, group):
    """What the kernel computes, in float64: each row of x rounded to int8 in blocks of 32 (the block's
    largest |x| becomes 127) against q * scales, plus the exact x against the offsets."""
    blocks = x.view(x.shape[0], -1, 32).double()
    step = blocks.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(blocks / torch.where(step > 0, step, 1)) * step).view_as(x)
    weight = q.double().view(q.shape[0], -1, group) * scales.double()[..., None]
    y = rounded @ weight.view(q.shape[0], -1).T
    if offsets is not None:
        y += x.double() @ offsets.double().repeat_interleave(group, dim=1).T
    return y


def k_quant_like(form, n, k, generator):
    """A weight as GGUF's K-quants store it: per 256 inputs an fp16 step for the scales (and one for the
    mins), each group a multiple of it: Q4_K's int4 in groups of 32, 6-bit multiples, the largest 63
    (its offsets the mins, negated), Q5_K's the same over values 0..31; Q6_K's int8 in groups of 16,
    signed 8-bit ones, the largest -128. Narrower than 256 inputs: the float32 values alone."""
    group, largest, low, high = (16, -128, -128, 127) if form == "int8 q6_k" else (32, 63, 0, 63)
    spans, per_span = max(k // 256, 1), min(k, 256) // group
    steps = (torch.rand(n, spans, 2, 1, generator=generator) * 0.02 + 1e-3).half().float()
    multiples = torch.randint(low, high + 1, (n, spans, 2, per_span), generator=generator).float()
    multiples[..., 0] = largest
    multiples[0, 0, 1] = 0  # a super-block without mins: a zero step
    values = (steps * multiples).view(n, spans, 2, per_span)
    if form != "int8 q6_k":
        q = torch.randint(0, 16, (n, k), generator=generator, dtype=torch.uint8) if form == "int4 q4_k" \
            else torch.randint(0, 32, (n, k), generator=generator, dtype=torch.int8)
        return q, values[:, :, 0].reshape(n, -1), -values[:, :, 1].reshape(n, -1), group
    q = torch.randint(-32, 32, (n, k), generator=generator, dtype=torch.int8)
    return q, values[:, :, 0].reshape(n, -1), None, group


def stored(form, n, k, generator):
    weight = torch.randn(n, k, generator=generator)
    if "_k" in form:
        return k_quant_like(form, n, k, generator)
    if form in ("int5 q5_0", "int5 q5_1"):  # GGUF's 5-bit values: -16..15, or 0..31 with mins
        signed = form == "int5 q5_0"
        q = torch.randint(-16 if signed else 0, 16 if signed else 32, (n, k), generator=generator, dtype=torch.int8)
        scales = (torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3).half().float()
        offsets = None if signed else -(torch.rand(n, k // 32, generator=generator) * 0.3).half().float()
        return q, scales, offsets, 32
    if form in ("int4 q4_1", "int8 q8_0"):  # GGUF's: scales (and mins) stored in float16
        q, scales, offsets, group = stored("int4 g32" if form == "int4 q4_1" else "int8 g32", n, k, generator)
        return q, scales.half().float(), None if offsets is None else offsets.half().float(), group
    if form.startswith("int4"):
        parts = quant.quantize_int4(weight, int(form[6:]))
        return quant.unpack_int4(parts["qweight"]), parts["scales"], parts["offsets"], int(form[6:])
    group = {"int8 per channel": k, "int8 g32": 32, "int8 g16": 16, "int8 g16 offsets": 16}[form]
    parts = quant.quantize_int8(weight, group)
    offsets = torch.randn(n, k // group, generator=generator) if "offsets" in form else None
    return parts["qweight"], parts["scales"].view(n, -1), offsets, group


FORMS = ["int4 g32", "int4 g64", "int4 q4_k", "int4 q4_1", "int5 q5_0", "int5 q5_1", "int5 q5_k", "int8 per channel",
         "int8 g32", "int8 g16", "int8 g16 offsets", "int8 q6_k", "int8 q8_0"]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("shape", [(70, 512), (8, 64), (3, 128)])  # out_features not a multiple of the tile
def test_kernel_computes_what_it_promises(form, shape):
    """Within float32 summation error (1e-6 of the largest output) of the float64 re-computation:
    a lost block, a swapped nibble or a wrong scale is off by far more."""
    generator = torch.Generator().manual_seed(len(form) + shape[0])
    n, k = shape
    q, scales, offsets, group = stored(form, n, k, generator)
    x = torch.randn(7, k, generator=generator)
    x[2, :32] = 0  # an all-zero block
    y = native.qlinear(x, *native.pack(q, scales, offsets), group)[:, :n]
    expected = promised(x, q, scales, offsets, group)
    assert (y.double() - expected).abs().max() <= 1e-6 * expected.abs().max()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", FORMS)
def test_every_row_computes_as_it_would_alone(form, threads):
    """1 to 17 rows (a decode step, verifies, batches): each row's outputs bit for bit its 1-row ones."""
    generator = torch.Generator().manual_seed(3)
    q, scales, offsets, group = stored(form, 40, 256, generator)
    packed = native.pack(q, scales, offsets)
    x = torch.randn(17, 256, generator=generator)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([native.qlinear(x[i:i + 1], *packed, group) for i in range(len(x))])
        for rows in range(2, len(x) + 1):
            assert torch.equal(native.qlinear(x[:rows], *packed, group), alone[:rows]), rows
    finally:
        torch.set_num_threads(saved)


AMX = {"amx_tile", "amx_int8"} <= set(native.cpu_flags().split())


@pytest.mark.skipif(not AMX, reason="the CPU has no AMX-INT8: every call takes the VNNI path")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("form", FORMS)
def test_rows_through_amx_tiles_are_bit_for_bit_those_of_one_row(form, threads):
    """16 to 70 rows (a prefill's: AMX's tiles of 16 rows, whole and ragged) against each row alone (the
    VNNI path): the same integer sums and float steps, so the same bits, for every weight format; 40
    output columns (a partial tile) and 288 inputs (9 blocks) where the format's groups allow."""
    generator = torch.Generator().manual_seed(11)
    k = 512 if "_k" in form else 320 if form == "int4 g64" else 288
    q, scales, offsets, group = stored(form, 40, k, generator)
    packed = native.pack(q, scales, offsets)
    x = torch.randn(70, k, generator=generator)
    x[20, :32] = 0  # an all-zero block
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([native.qlinear(x[i:i + 1], *packed, group) for i in range(len(x))])
        for rows in range(16, len(x) + 1):
            assert torch.equal(native.qlinear(x[:rows], *packed, group), alone[:rows]), rows
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("shape", [(70, 512), (49, 64), (64, 576), (3, 1536)])  # whole tiles of 32 and partial ones
def test_the_float_kernel_computes_a_linear_layer(shape):
    """flinear.cpp: x @ w.T + b within float32 summation error of float64, for 0 to 30 rows (its blocks
    of up to 12 rows, whole and partial); the bias added after the sum."""
    generator = torch.Generator().manual_seed(shape[0])
    n, k = shape
    w, b, x = (torch.randn(*size, generator=generator) for size in ((n, k), (n,), (30, k)))
    packed = native.float_pack(w)
    for rows in (0, 1, 5, 12, 13, 30):
        y = native.float_product(x[:rows].contiguous(), packed, b, n)
        expected = x[:rows].double() @ w.double().T + b.double()
        assert y.shape == (rows, n) and torch.allclose(y.double(), expected, rtol=0, atol=1e-5 * k ** 0.5)
    assert torch.equal(native.float_product(x, packed, b, n), native.float_product(x, packed, None, n) + b)


def test_each_float_output_is_one_chain_of_fused_multiply_adds():
    """What makes the float kernel row-invariant and the same on every instruction set, bit for bit:
    output j of a row is fma(x[K-1], w[j, K-1], ... fma(x[0], w[j, 0], 0)), then + b[j]. A float32 fma
    is emulated in float64 (the product of two float32s is exact there; the sum is rounded twice, which
    differs from one rounding only at rare ties, none in these numbers)."""
    generator = torch.Generator().manual_seed(0)
    w, b, x = (torch.randn(*size, generator=generator) for size in ((40, 96), (40,), (14, 96)))
    chain = torch.zeros(14, 40)
    for k in range(96):
        chain = (x[:, k:k + 1].double() * w[:, k].double() + chain.double()).float()
    assert torch.equal(native.float_product(x, native.float_pack(w), b, 40), chain + b)


@pytest.mark.parametrize("form", ["int4 q4_k", "int8 q6_k"])
def test_k_quant_scales_are_packed_in_two_levels_with_the_same_results(form, monkeypatch):
    """GGUF K-quants' scales and mins kept as int8 multiples of a step per 256 inputs (4.75 bits a
    weight for Q4_K against 6, 8.75 for Q6_K as int8 against 10), the kernel's numbers bit for bit those
    of the float32 values they replace; minispec's own quantizers' free scales stay in one level."""
    generator = torch.Generator().manual_seed(5)
    q, scales, offsets, group = k_quant_like(form, 70, 512, generator)
    two = native.pack(q, scales, offsets)
    steps = 2 if offsets is not None else 1  # the scales' step, and the offsets' where there are offsets
    assert two[1].dtype == torch.int8 and two[3].shape == (-(-70 // native.TILE), 2, steps, native.TILE)
    assert two[3].dtype == torch.float16  # a K-quant's super-block scales, as the file stores them
    monkeypatch.setattr(native, "two_level", lambda values, group: None)
    one = native.pack(q, scales, offsets)
    assert one[1].dtype == torch.float32 and one[3] is None
    saved = 1 - sum(t.nbytes for t in two if t is not None) / sum(t.nbytes for t in one if t is not None)
    assert saved > (0.2 if form == "int4 q4_k" else 0.12), saved
    x = torch.randn(9, 512, generator=generator)
    assert torch.equal(native.qlinear(x, *two, group), native.qlinear(x, *one, group))
    monkeypatch.undo()
    tokens = torch.tensor([0, 69, 33])
    if form == "int8 q6_k":  # an embedding looks its rows up from either form alike
        assert all(torch.equal(a, b) for a, b in zip(native.rows_of(tokens, *two), native.rows_of(tokens, *one))
                   if a is not None)
    parts = quant.quantize_int4(torch.randn(8, 512, generator=generator), 32)
    assert native.pack(quant.unpack_int4(parts["qweight"]), parts["scales"], parts["offsets"])[3] is None


@pytest.mark.parametrize("form", ["int4 q4_1", "int8 q8_0"])
def test_float16_scales_are_packed_as_float16_with_the_same_results(form, monkeypatch):
    """Scales and mins that are float16 values (GGUF's Q4_1, Q8_0) kept in float16: a sixth fewer bytes
    for Q4_1, the kernel's numbers and an embedding's rows bit for bit those of float32 tables;
    minispec's own quantizers' free scales stay float32."""
    generator = torch.Generator().manual_seed(8)
    q, scales, offsets, group = stored(form, 70, 512, generator)
    halves = native.pack(q, scales, offsets)
    monkeypatch.setattr(native, "fits_half", lambda values: False)
    floats = native.pack(q, scales, offsets)
    monkeypatch.undo()
    assert halves[1].dtype == torch.float16 and floats[1].dtype == torch.float32
    saved = 1 - sum(t.nbytes for t in halves if t is not None) / sum(t.nbytes for t in floats if t is not None)
    assert saved > (0.15 if form == "int4 q4_1" else 0.05), saved
    x = torch.randn(9, 512, generator=generator)
    assert torch.equal(native.qlinear(x, *halves, group), native.qlinear(x, *floats, group))
    tokens = torch.tensor([0, 69, 33])
    assert all(torch.equal(a, b) for a, b in zip(native.rows_of(tokens, *halves), native.rows_of(tokens, *floats))
               if a is not None)
    assert native.pack(*stored("int4 g32", 8, 512, generator)[:3])[1].dtype == torch.float32


def test_six_bit_weights_take_three_quarters_of_the_bytes_for_the_same_numbers(monkeypatch):
    """An int8 weight whose values fit 6 bits (GGUF's Q6_K) is packed in 6: 3/4 of int8's bytes, the
    kernel's outputs and an embedding's rows bit for bit those of the int8 packing."""
    generator = torch.Generator().manual_seed(6)
    q, scales, offsets, group = k_quant_like("int8 q6_k", 70, 512, generator)
    q[3, :64] = -32  # both ends of the range
    q[4, :64] = 31
    six = native.pack(q, scales, offsets)
    monkeypatch.setattr(native, "six_bits", lambda q: False)
    eight = native.pack(q, scales, offsets)
    monkeypatch.undo()
    assert six[0].numel() * 4 == eight[0].numel() * 3
    x = torch.randn(9, 512, generator=generator)
    assert torch.equal(native.qlinear(x, *six, group), native.qlinear(x, *eight, group))
    tokens = torch.tensor([0, 69, 3, 4])
    rows = native.rows_of(tokens, *six)
    assert torch.equal(rows[0], q[tokens])
    assert all(torch.equal(a, b) for a, b in zip(rows, native.rows_of(tokens, *eight)) if a is not None)
    q[5, 7] = 32  # one value past 6 bits: int8's packing
    assert native.pack(q, scales, offsets)[0].shape == eight[0].shape


@pytest.mark.parametrize("form", ["int5 q5_0", "int5 q5_1", "int5 q5_k"])
def test_five_bit_weights_take_five_eighths_of_the_bytes_for_the_same_numbers(form, monkeypatch):
    """An int8 weight whose values fit 5 bits (GGUF's Q5_0: -16..15; Q5_1, Q5_K: 0..31 with mins) is
    packed in 5: 5/8 of int8's bytes, the kernel's outputs and an embedding's rows bit for bit those of
    the 6-bit and int8 packings."""
    generator = torch.Generator().manual_seed(9)
    q, scales, offsets, group = stored(form, 70, 512, generator)
    low, high = (-16, 15) if offsets is None else (0, 31)
    q[3, :64], q[4, :64] = low, high  # both ends of the range
    five = native.pack(q, scales, offsets)
    monkeypatch.setattr(native, "five_bits", lambda q, offsets: False)
    six = native.pack(q, scales, offsets)
    monkeypatch.setattr(native, "six_bits", lambda q: False)
    eight = native.pack(q, scales, offsets)
    monkeypatch.undo()
    assert five[0].numel() * 8 == eight[0].numel() * 5 and six[0].numel() * 4 == eight[0].numel() * 3
    x = torch.randn(9, 512, generator=generator)
    y = native.qlinear(x, *five, group)
    assert torch.equal(y, native.qlinear(x, *six, group)) and torch.equal(y, native.qlinear(x, *eight, group))
    tokens = torch.tensor([0, 69, 3, 4])
    rows = native.rows_of(tokens, *five)
    assert torch.equal(rows[0], q[tokens])
    assert all(torch.equal(a, b) for a, b in zip(rows, native.rows_of(tokens, *eight)) if a is not None)
    q[5, 7] = low - 1  # one value past 5 bits: 6-bit's packing
    assert native.pack(q, scales, offsets)[0].shape == six[0].shape


def test_token_rows_come_out_of_the_packed_layout():
    """An int8 embedding kept in the kernel's layout looks its rows up from it, exactly."""
    generator = torch.Generator().manual_seed(4)
    q, scales, offsets, _ = stored("int8 g16 offsets", 42, 64, generator)
    tokens = torch.tensor([[0, 41, 5], [7, 7, 40]])
    rows, row_scales, row_offsets = native.rows_of(tokens, *native.pack(q, scales, offsets))
    assert torch.equal(rows, q[tokens]) and torch.equal(row_scales, scales[tokens])
    assert torch.equal(row_offsets, offsets[tokens])


def test_without_a_compiler_pytorch_kernels_serve(monkeypatch, caplog):
    monkeypatch.setattr(native, "compiler", lambda: None)
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="minispec"):
            assert not native.available()
            assert not native.takes(64, 32)
            native.install()
        assert caplog.messages == ["minispec: no C++ compiler found: PyTorch's slower kernels serve instead of minispec's own"]
        assert type(backend.current()) is backend.PyTorch
        layer = quant.Int4Linear(quant.quantize_int4(torch.randn(16, 64), 32))
        assert not layer.native and layer(torch.randn(2, 64)).shape == (2, 16)
    finally:
        monkeypatch.undo()
        native.available.cache_clear()
        native.install()
    assert backend.current() is native.NATIVE


def test_a_failed_build_leaves_no_library(monkeypatch, tmp_path, caplog):
    """A compiler that fails: one logged line naming its first error (not the caret under the code that
    ends its output), and nothing in the cache that a later load would take."""
    monkeypatch.setenv("MINISPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "build_command", lambda cxx, out: ["sh", "-c", "echo 'x.cpp:1: error: no AVX2' >&2; echo '  ^~~~' >&2; exit 1"])
    native.available.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="minispec"):
            assert not native.available()
        assert "could not build its CPU kernels (x.cpp:1: error: no AVX2)" in caplog.text
        assert not list((tmp_path / "kernels").iterdir())
    finally:
        native.available.cache_clear()



@pytest.mark.parametrize("version, standard", [("2.13.0", "-std=c++17"), ("2.14.1+cu130", "-std=c++20"),
                                               ("3.0.0a0", "-std=c++20")])
def test_the_kernels_build_in_the_standard_torch_needs(monkeypatch, version, standard):
    """torch 2.14's ATen.h refuses C++17: built as C++17 there, the kernels failed and PyTorch's served."""
    monkeypatch.setattr(torch, "__version__", version)
    command = native.build_command("c++", "out.so")
    assert native.cxx_standard() == standard and command.count(standard) == 1
    assert not [flag for flag in command if flag.startswith("-std=") and flag != standard]

# --- attention over a KV cache (attention.cpp) --------------------------------------------------------

def exact_attention(q, k, v, mask, scale):
    """q [B, H, R, d] over k, v [B, H, P, d] (keys in position order) in float64."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale + mask.double()
    return scores.softmax(-1) @ v.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d", [128, 80, 64, 32, 16, 20, 8])  # 16 x 8, 5 (not unrolled), 4, 2, 1 and none
def test_attention_is_attention(dtype, d):
    """Grouped rows over a causal mask, a head dim in whole vectors of 16 and not: float64's numbers
    to float32 rounding (the inputs taken in `dtype`)."""
    generator = torch.Generator().manual_seed(d)
    B, H, T, group, P = 2, 2, 5, 3, 96
    q, k, v = (torch.randn(B, H, n, d, generator=generator).to(dtype) for n in (group * T, 128, 128))
    positions = torch.tensor([[40, 41, 42, 43, 44], [90, 91, 92, 93, 94]])
    mask = kernels.additive(kernels.causal_mask(positions, P)).repeat(1, group, 1)[:, None]  # [B, 1, R, P]
    got = kernels.backend_attend(q, k, v, mask, None, None)
    want = exact_attention(q.float(), k[:, :, :P].float(), v[:, :, :P].float(), mask, d ** -0.5)
    assert got.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(got.double(), want, atol=tolerance, rtol=tolerance)


def test_attention_reads_positions_through_slots_in_position_order():
    """A token tree's node reading its ancestors from scattered slots gets, bit for bit, what the same
    keys at consecutive slots give; reading more positions (masked) or sharing the call with other rows
    changes nothing; a row that may read nothing is zeros."""
    generator = torch.Generator().manual_seed(0)
    d, P = 64, 64
    q = torch.randn(1, 1, 3, d, generator=generator)
    k, v = torch.randn(1, 1, P, d, generator=generator), torch.randn(1, 1, P, d, generator=generator)
    order = torch.randperm(P, generator=generator)
    scattered_k, scattered_v = torch.empty_like(k), torch.empty_like(v)
    scattered_k[:, :, order], scattered_v[:, :, order] = k, v  # position p now in slot order[p]
    mask = kernels.additive(torch.arange(P) <= torch.tensor([[50], [20], [-1]]))[None, None]  # row 2 reads nothing
    in_order = native.attend(q, k, v, mask, None, 0.125)
    through_slots = native.attend(q, scattered_k, scattered_v, mask, order.view(1, 1, P).contiguous(), 0.125)
    assert torch.equal(in_order, through_slots)
    assert torch.equal(in_order[0, 0, 2], torch.zeros(d))
    alone = native.attend(q[:, :, :1].contiguous(), k, v, mask[:, :, :1, :32 * 2], None, 0.125)
    assert torch.equal(alone, in_order[:, :, :1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [128, 64, 16, 24])  # tiles of 2, 4 and 8 rows; 24: one row at a time
@pytest.mark.parametrize("n", [0, 1, 3])  # slots: none, one list for every row, one per token (a tree's)
def test_attention_of_a_row_is_the_same_alone_as_in_a_tile_of_rows(dtype, d, n):
    """Rows computed together share their keys' and values' loads: each row's numbers must still be, bit
    for bit, what it gets alone. A prefill-shaped causal mask over grouped rows (3 heads x 7 tokens, rows
    group-major), values holding NaN where no row or only some rows of a tile may read, a row that may read
    nothing."""
    generator = torch.Generator().manual_seed(d + n)
    B, H, group, T, S = 2, 2, 3, 7, 48
    R, P = group * T, 40
    q = torch.randn(B, H, R, d, generator=generator)
    k, v = (torch.randn(B, H, S, d, generator=generator).to(dtype) for _ in range(2))
    positions = torch.tensor([[30, 31, 32, 33, 34, 35, 36], [3, 9, 10, 20, 21, 22, 38]])
    mask = kernels.additive(kernels.causal_mask(positions, P)).repeat(1, group, 1)[:, None].repeat(1, H, 1, 1)
    mask[1, 0, 4] = float("-inf")  # reads nothing
    slots = None
    if n:  # positions 37 and 39 in slots 46 and 47, the others in some 38 of slots 0..45
        def token_slots(base):
            return torch.cat([base[:37], torch.tensor([S - 2]), base[37:38], torch.tensor([S - 1])])
        slots = torch.stack([torch.stack([token_slots(torch.randperm(S - 2, generator=generator)[:P - 2])
                                          for _ in range(n)]) for _ in range(B)])
    at_37, at_39 = (S - 2, S - 1) if n else (37, 39)
    v[0, :, at_39] = float("nan")  # read by no row of batch row 0
    v[1, :, at_37] = float("nan")  # read by batch row 1's rows at position 38 only
    together = native.attend(q, k, v, mask, slots, d ** -0.5)
    reads_nan = torch.zeros(B, H, R, dtype=torch.bool)
    reads_nan[1, :, T - 1::T] = True
    assert torch.equal(together.isnan().any(-1), reads_nan) and torch.equal(together[1, 0, 4], torch.zeros(d))
    for r in range(R):
        row_slots = None if slots is None else slots[:, r % n:r % n + 1].contiguous()
        alone = native.attend(q[:, :, r:r + 1].contiguous(), k, v, mask[:, :, r:r + 1], row_slots, d ** -0.5)
        torch.testing.assert_close(alone, together[:, :, r:r + 1], rtol=0, atol=0, equal_nan=True)
    for tokens in (2, 3):  # a head's rows in tiles of 2 and 4 (a decode step's few rows)
        rows = tokens * max(n, 1)
        fewer = native.attend(q[:, :, :rows].contiguous(), k, v, mask[:, :, :rows], slots, d ** -0.5)
        torch.testing.assert_close(fewer, together[:, :, :rows], rtol=0, atol=0, equal_nan=True)


def canonical_scores(products):
    """Scores from products [..., d] float32 as attention.cpp adds them: by lane over d's whole vectors
    of 16 in order, the 16 lanes in a fixed tree (a[i] = v[i] + v[i + 8], c[j] = a[j] + a[j + 4],
    (c0 + c2) + (c1 + c3)), then plus the products past the last whole vector, added in order."""
    whole = products.shape[-1] // 16 * 16
    v = torch.zeros(products.shape[:-1] + (16,))
    for j in range(0, whole, 16):
        v = v + products[..., j:j + 16]
    a = v[..., :8] + v[..., 8:]
    c = a[..., :4] + a[..., 4:]
    rest = torch.zeros(products.shape[:-1])
    for j in range(whole, products.shape[-1]):
        rest = rest + products[..., j]
    return ((c[..., 0] + c[..., 2]) + (c[..., 1] + c[..., 3])) + rest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("d", [24, 64, 128])  # one row at a time (a `rest`), tiles of 8 and 4 rows
@pytest.mark.parametrize("n", [0, 3])  # slots: none, one per token (a tree's)
def test_attention_adds_each_score_in_the_canonical_order(dtype, d, n):
    """Every score the kernel computes is, bit for bit, canonical_scores' for 1..40 positions (whole
    blocks of 16 and their tails), masks with holes, slots: its output equals its output from keys that
    hold those scores as they are (row r's query the r-th unit vector, its score the r-th element of the
    key it reads: products by 1 and by 0 add to it in any order), the same weights of the same values.
    The products of 12-bit queries and 8-bit keys are exact: fused or not, the additions alone round."""
    generator = torch.Generator().manual_seed(d + n)
    B, H, R, S = 1, 2, 9, 48
    mantissa, exponent = torch.frexp(torch.randn(B, H, R, d, generator=generator))
    q = torch.ldexp(torch.round(mantissa * 2 ** 12) / 2 ** 12, exponent)
    k = torch.randn(B, H, S, d, generator=generator).to(torch.bfloat16).to(dtype)
    v = torch.randn(B, H, S, d, generator=generator).to(dtype)
    units = torch.eye(R, d).expand(B, H, R, d).contiguous()
    for P in range(1, 41):
        mask = kernels.additive(torch.rand(B, H, R, P, generator=generator) < 0.7)
        slots = torch.stack([torch.randperm(S, generator=generator)[:P] for _ in range(n)])[None] if n else None
        read = (slots[:, torch.arange(R) % n] if n else torch.arange(P).expand(B, R, P))[:, None].expand(B, H, R, P)
        keys = k.float()[torch.arange(B)[:, None, None, None], torch.arange(H)[:, None, None], read]  # [B, H, R, P, d]
        scores = canonical_scores(q[:, :, :, None, :] * keys)
        holding = torch.zeros(B, H, S, d)
        holding[torch.arange(B)[:, None, None, None], torch.arange(H)[:, None, None], read,
                torch.arange(R)[:, None].expand(R, P)] = scores
        got = native.attend(q, k, v, mask, slots, d ** -0.5)
        torch.testing.assert_close(got, native.attend(units, holding, v.float(), mask, slots, d ** -0.5),
                                   rtol=0, atol=0, msg=lambda m: f"{P} positions: {m}")


def test_attention_refuses_what_it_cannot_read():
    q, k = torch.zeros(1, 1, 2, 8), torch.zeros(1, 1, 32, 8)
    with pytest.raises(RuntimeError, match="mask must be float32"):
        native.attend(q, k, k, torch.zeros(1, 1, 2, 64), None, 1.0)  # more positions than the cache holds
    with pytest.raises(RuntimeError, match="slots must be int64"):
        native.attend(q, k, k, torch.zeros(1, 1, 2, 32), torch.zeros(1, 3, 32, dtype=torch.long), 1.0)
    with pytest.raises(RuntimeError, match="a slot outside the cache"):
        native.attend(q, k, k, torch.zeros(1, 1, 2, 32), torch.full((1, 2, 32), 32), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_keep_moves_a_path_as_indexing_would(dtype):
    """A tree's accepted path (slots 9, 10, 13, 17 of row 1) moved to positions 7.. of every cache: what
    cache[row, :, 7:11] = cache[row, :, slots] does, the other row and positions untouched."""
    generator = torch.Generator().manual_seed(4)
    caches = [torch.randn(2, 3, 32, 16, generator=generator).to(dtype) for _ in range(4)]
    expected = [cache.clone() for cache in caches]
    slots = [9, 10, 13, 17]
    for cache in expected:
        cache[1, :, 7:11] = cache[1, :, slots]
    native.keep(caches, 1, slots, 7)
    assert all(torch.equal(cache, want) for cache, want in zip(caches, expected))


def test_keep_refuses_what_would_overwrite_before_reading():
    cache = torch.zeros(1, 1, 32, 8)
    with pytest.raises(RuntimeError, match="slots must increase"):
        native.keep([cache], 0, [5, 4], 2)
    with pytest.raises(RuntimeError, match="slots must increase, each at or after its destination"):
        native.keep([cache], 0, [3, 4], 4)
    with pytest.raises(RuntimeError, match="the slots inside it"):
        native.keep([cache], 0, [31, 32], 4)
    with pytest.raises(RuntimeError, match="the slots inside it"):
        native.keep([cache.transpose(2, 3)], 0, [5], 4)


def every_forward(model):
    """Logits of the forwards decoding makes: a prompt, a 1-token step, a 3-token verify, a batch of two
    rows at their own lengths, and a token tree beside a chain."""
    prompt = torch.tensor([[5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]])
    model.ensure_caches(2, 64)
    out = [model.prefill(prompt), model.decode(torch.tensor([[7]])), model.decode(torch.tensor([[19, 44, 3]]))]
    model.decode_rows(Feed(prompt[:, :5], [0]), first_row=1)
    out.append(model.decode_rows(Feed(torch.tensor([[61, 28], [90, 90]]), [16, 5], [2, 1])))
    out.append(model.decode_rows(Feed(torch.tensor([[12, 55, 36, 71], [7, 19, 19, 19]]), [18, 6], [4, 2], parents=[[-1, 0, 0, 1], [-1, 0]])))
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("mode", ["int8", "int4", None])
@pytest.mark.parametrize("kind", ["llama", "llama_gqa", "qwen2"])  # multi-head; grouped, intermediate 96; biases
def test_a_layer_in_one_call_computes_what_the_modules_compute(reference_dirs, kind, mode, threads, monkeypatch):
    """Every forward decoding makes, bit for bit: the one-call layer (layer.cpp) against the modules
    it stands in for (the modules' RMSNorm is the same one call, their silu the same PyTorch's, their
    products the same kernels), quantized and float32."""
    model = minispec.load(reference_dirs[kind][1], quantize=mode)
    calls = []
    monkeypatch.setattr(native, "llama_layers", lambda *args, original=native.llama_layers: calls.append(1) or original(*args))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            fused = every_forward(model)
            assert len(calls) == 6  # all six forwards ran their layers in one call
            monkeypatch.setattr(Llama, "fused_layers", lambda self, x: None)
            modules = every_forward(model)
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 6  # and the modules none
    for a, b in zip(fused, modules):
        assert torch.equal(a, b)


def test_the_one_call_taps_the_states_the_modules_tap(reference_dirs, monkeypatch):
    """An EAGLE-3 head reads the states entering some of the target's layers (and the last one's output):
    the one call returns them, in layer order whatever order they are asked in, bit for bit."""
    model = minispec.load(reference_dirs["llama_gqa"][1], quantize="int8")
    tokens, layers = torch.tensor([[5, 17, 33, 8, 90, 41]]), model.config.n_layers
    model.ensure_caches(1, 64)
    with torch.inference_mode():
        fused = model.features(tokens, torch.arange(6), taps=(layers, 0, 1))
        monkeypatch.setattr(Llama, "fused_layers", lambda self, x: None)
        modules = model.features(tokens, torch.arange(6), taps=(0, 1, layers))
    assert fused[1].shape[-1] == 3 * model.config.dim
    assert torch.equal(fused[0], modules[0]) and torch.equal(fused[1], modules[1])


def test_the_one_call_layer_takes_what_it_can_compute(reference_dirs):
    """float32 activations on a CPU, weights quantized for minispec's kernel or packed for oneDNN, and
    no gradient: a bfloat16 model and a head in training run the modules."""
    x = torch.zeros(1, 1, 32)

    def loaded(**options):
        model = minispec.load(reference_dirs["llama"][1], **options)
        model.ensure_caches(1, 8)
        return model
    for mode in ("int8", None):
        assert loaded(quantize=mode).fused_layers(x) is not None
    assert loaded(dtype=torch.bfloat16).fused_layers(x.bfloat16()) is None
    with torch.enable_grad():
        assert loaded().fused_layers(x.requires_grad_()) is None


def test_with_minispec_native_0_a_load_installs_pytorchs_operations(reference_dirs, monkeypatch):
    """MINISPEC_NATIVE=0: the backend a load chooses is PyTorch's, whose model runs no kernel of
    minispec's (no one-call layer, no quantized kernel, nothing in huge pages); the next load where they
    build takes them again."""
    monkeypatch.setenv("MINISPEC_NATIVE", "0")
    native.available.cache_clear()
    try:
        model = minispec.load(reference_dirs["llama"][1], quantize="int8")
        model.ensure_caches(1, 8)
        assert backend.current() is backend.PYTORCH
        assert model.fused_layers(torch.zeros(1, 1, 32)) is None and not model.layers[0].attention.wqkv.native
    finally:
        monkeypatch.undo()
        native.available.cache_clear()
    assert minispec.load(reference_dirs["llama"][1]) and backend.current() is native.NATIVE


def test_a_weight_written_in_place_is_read_again(reference_dirs, monkeypatch):
    """The one-call layer keeps its layers' tensors (the packed copies among them) and their layout
    from forward to forward; a weight written since (a test, a merged adapter) is packed and taken again, as the
    modules do."""
    model = minispec.load(reference_dirs["llama"][1])
    prompt = torch.tensor([[5, 17, 33, 8, 90, 41]])
    model.ensure_caches(1, 64)
    with torch.inference_mode():
        model.prefill(prompt)
        stack = model._stack
        model.prefill(prompt)
        assert model._stack is stack  # laid out once while nothing changes
    with torch.no_grad():
        model.layers[1].feed_forward.w2.weight.mul_(1.5)
    with torch.inference_mode():
        fused = model.prefill(prompt)
        assert model._stack is not stack
        monkeypatch.setattr(Llama, "fused_layers", lambda self, x: None)
        assert torch.equal(fused, model.prefill(prompt))
