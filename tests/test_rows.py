"""Row invariance (models/kernels.py): every row of a forward over k tokens, or over several batch rows,
computes bit for bit what a 1-token forward of that token computes, in every dtype, so speculative
greedy decoding and speculative beam search equal their plain versions by construction, ties included."""

import itertools

import pytest
import torch

import minispec
from minispec.models import kernels
from conftest import noisy_copy, save_reference

FAMILIES = ["gpt2", "llama", "llama_gqa", "qwen2", "qwen3", "gemma3", "t5_v1_1"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54, 29, 88, 16, 70, 45, 9, 31, 66, 24, 81, 50, 38]
CONTINUATION = [7, 19, 44, 3, 61, 28, 90, 12, 55, 36]


@pytest.fixture
def threads(request):
    """Kernels may split work by thread count: the tests run on 1 thread (conftest), users on all."""
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def one_token_at_a_time(model, start, tokens):
    """Logits [n, vocab] of `tokens`, each computed in its own 1-token forward after `start`."""
    model.prefill(start)
    return torch.cat([model.decode(tokens[:, i:i + 1])[0] for i in range(tokens.shape[1])])


def mismatched_rows(model):
    """Every (batch rows, width) a decoder uses, against 1-token forwards: the rows that differ."""
    start = model.encode(torch.tensor([PROMPT], device=model.device))
    tokens = torch.tensor([CONTINUATION], device=model.device)
    model.ensure_caches(4, 64)
    expected = one_token_at_a_time(model, start, tokens)
    bad = []
    for rows, width in itertools.product((1, 3, 4), range(1, 10)):  # beams are batch rows
        model.prefill(start.expand(rows, -1))
        logits = model.decode(tokens[:, :width].expand(rows, -1))
        bad += [(rows, width, i) for i in range(width) if not torch.equal(logits[:, i], expected[i].expand(rows, -1))]
    return bad


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_row_computes_as_it_would_alone(reference_dirs, kind, dtype, threads, attention):
    model = minispec.load(reference_dirs[kind][1], dtype=dtype)
    with torch.inference_mode():
        assert mismatched_rows(model) == []


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("kind", ["llama_gqa", "qwen2", "qwen3", "gemma3"])
def test_quantized_rows_compute_as_they_would_alone(reference_dirs, kind, mode):
    model = minispec.load(reference_dirs[kind][1], quantize=mode)
    with torch.inference_mode():
        assert mismatched_rows(model) == []


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_features", [576, 1536, 4096])
def test_a_linear_gives_each_row_what_it_gives_alone_at_real_sizes(in_features, dtype, threads):
    """The tiny models' layers are narrow, and oneDNN picks kernels by size: a 1-row product can sum
    differently from products of 2+ rows once K >= 1152 (kernels.PACKED_MIN_ROWS), and with AMX tiles
    bfloat16 products of 33+ rows differently from shorter ones (kernels.PACKED_MAX_ROWS). Real models'
    widths, 1 to 72 rows (more than two blocks), each row bit for bit what it gives alone."""
    if not kernels.can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(1536, in_features, generator=generator) / in_features ** 0.5).to(dtype)
    x = torch.randn(72, in_features, generator=generator).to(dtype)
    alone = torch.cat([kernels.linear(x[i:i + 1], weight, None, packed=True) for i in range(72)])
    assert [rows for rows in range(1, 73)
            if not torch.equal(kernels.linear(x[:rows], weight, None, packed=True), alone[:rows])] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_compiled_rows_compute_as_they_would_alone(reference_dirs, dtype):
    """torch.compile'd forwards (one graph per width): widths 4 and 9 against compiled 1-token steps."""
    model = minispec.load(reference_dirs["llama_gqa"][1], dtype=dtype, compile=True)
    start, tokens = torch.tensor([PROMPT]), torch.tensor([CONTINUATION])
    model.ensure_caches(1, 64)
    with torch.inference_mode():
        expected = one_token_at_a_time(model, start, tokens)
        for width in (4, 9):
            model.prefill(start)
            logits = model.decode(tokens[:, :width])[0]
            assert [i for i in range(width) if not torch.equal(logits[i], expected[i])] == [], width


def test_the_row_test_fails_without_row_invariance(reference_dirs, monkeypatch):
    """The bug planted: BLAS matmuls (no packed weights) and unpadded attention rows, in float32."""
    model = minispec.load(reference_dirs["llama_gqa"][1])
    monkeypatch.setattr(kernels, "ATTENTION_ROW_BLOCK", 1)
    for module in model.modules():
        if getattr(module, "packed", False):
            monkeypatch.setattr(module, "packed", False)
    with torch.inference_mode():
        assert mismatched_rows(model) != []


def targets_and_noisy_drafts(tmp_path_factory, device="cpu"):
    """Per family and half dtype: a target and a noisy copy as its draft, both loaded in that dtype."""
    from conftest import make_reference

    out = {}
    for kind in FAMILIES:
        reference = make_reference(kind)
        target_dir = save_reference(reference, tmp_path_factory.mktemp(kind))
        draft_dir = save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path_factory.mktemp("noisy"))
        for dtype in (torch.bfloat16, torch.float16):
            out[kind, dtype] = tuple(minispec.load(d, device=device, dtype=dtype) for d in (target_dir, draft_dir))
    return out


@pytest.fixture(scope="module")
def low_precision(tmp_path_factory):
    return targets_and_noisy_drafts(tmp_path_factory)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_speculative_equals_plain_greedy_in_half_precision(low_precision, kind, dtype):
    assert speculative_mismatches(*low_precision[kind, dtype], [1, 3, 8, "auto"], ["lookup", "ngram", "int8"]) == []


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5_v1_1"])
def test_speculative_beam_search_equals_plain_beam_search_in_bfloat16(low_precision, kind):
    assert beam_mismatches(*low_precision[kind, torch.bfloat16]) == []


def speculative_mismatches(target, noisy, gammas, drafters):
    """The (draft, γ) whose greedy speculative output differs from plain greedy (tests/test_cuda.py too)."""
    plain = minispec.generate(target, PROMPT, max_new_tokens=40, ignore_eos=True).tokens
    assert len(set(plain)) >= 8
    return [(getattr(draft, "name", draft), gamma) for draft, gamma in itertools.product([noisy, *drafters], gammas)
            if minispec.generate(target, PROMPT, draft=draft, gamma=gamma, max_new_tokens=40,
                                 ignore_eos=True).tokens != plain]


def beam_mismatches(target, noisy):
    """The γ at which speculative beam search differs from plain beam search."""
    settings = {"beams": 4, "max_new_tokens": 16, "ignore_eos": True}
    plain = minispec.generate(target, PROMPT, **settings).tokens
    return [gamma for gamma in (3, "auto")
            if minispec.generate(target, PROMPT, draft=noisy, draft_beams=8, gamma=gamma, **settings).tokens != plain]


def near_tie_mismatches(target, draft, step, epsilons):
    """Make token b's head row token a's plus ε·noise, where a is plain greedy's token at `step`: near
    ε = 0 the two logits are a rounding step apart. Returns the ε at which speculative greedy (γ = 3,
    a copy of the target as its draft, so `step` is scored inside a 4-token verify) differs from plain
    greedy."""
    plain = minispec.generate(target, PROMPT, max_new_tokens=step + 4, ignore_eos=True).tokens
    a = plain[step]
    b = (a + 1) % target.vocab_size
    heads = target.head.weight, draft.head.weight
    saved = heads[0][b].clone()
    noise = torch.randn(saved.shape[0], generator=torch.Generator().manual_seed(0))
    bad = []
    try:
        for epsilon in epsilons:
            with torch.no_grad():
                for head in heads:
                    head[b] = head[a] + epsilon * noise
            settings = {"max_new_tokens": step + 2, "ignore_eos": True}
            if minispec.generate(target, PROMPT, draft=draft, gamma=3, **settings).tokens != \
                    minispec.generate(target, PROMPT, **settings).tokens:
                bad.append(epsilon)
    finally:
        with torch.no_grad():
            for head in heads:
                head[b] = saved
    return bad


EPSILONS = [i * 1e-7 for i in range(-30, 31)]


def test_near_ties_go_the_same_way_in_plain_and_speculative_greedy(reference_dirs):
    target, draft = (minispec.load(reference_dirs["llama"][1]) for _ in range(2))  # float32, untied head
    assert near_tie_mismatches(target, draft, step=6, epsilons=EPSILONS) == []


def test_near_ties_split_without_row_invariance(reference_dirs, monkeypatch):
    """The same scan with the bug planted: some ε must split the two (else the scan shows nothing)."""
    target, draft = (minispec.load(reference_dirs["llama"][1]) for _ in range(2))
    monkeypatch.setattr(kernels, "ATTENTION_ROW_BLOCK", 1)
    for module in target.modules():
        if getattr(module, "packed", False):
            monkeypatch.setattr(module, "packed", False)
    assert near_tie_mismatches(target, draft, step=6, epsilons=EPSILONS) != []
