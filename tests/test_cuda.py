"""CUDA only (skipped elsewhere, so CI never runs these): compiled decoding with CUDA graphs must give
the tokens eager decoding gives, for plain, speculative and beam-search decoding. CUDA graphs reuse
their output buffers on every replay, so any logits read after a later replay would show up here.
A speculative step must make one host sync, counted by torch's own sync debug mode. The bench's
memory and bandwidth figures must be plausible.
The CPU suite's central claims are checked again here on the GPU, whose kernels differ: greedy
speculative decoding (every family, bfloat16 and float16) and speculative beam search equal their plain
versions, batched requests each get what they get alone, every token of a tree computes what its path
computes, and trees and draft heads give plain greedy's tokens.
"""

import json
import warnings

import pytest
import torch
import transformers

import minispec
from conftest import make_reference, noisy_copy, save_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]
FAMILIES = ["gpt2", "llama", "llama_gqa", "qwen2", "qwen3", "t5_v1_1"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    reference = make_reference("llama_gqa")
    return (save_reference(reference, tmp_path_factory.mktemp("cuda_target")),
            save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path_factory.mktemp("cuda_noisy")))


def load_pair(checkpoints, compile):
    target, draft = checkpoints
    options = dict(device="cuda", dtype=torch.float32, compile=compile)
    return minispec.load(target, **options), minispec.load(draft, **options)


@pytest.mark.parametrize("settings", [
    {"max_new_tokens": 40, "ignore_eos": True},
    {"max_new_tokens": 40, "ignore_eos": True, "gamma": 4},
    {"max_new_tokens": 40, "ignore_eos": True, "gamma": 3, "temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"max_new_tokens": 16, "ignore_eos": True, "gamma": 3, "beams": 2, "draft_beams": 4},
    {"max_new_tokens": 40, "ignore_eos": True, "gamma": 3, "tree": 8},
])
def test_cuda_graphs_give_eager_tokens(checkpoints, settings):
    eager_target, eager_draft = load_pair(checkpoints, compile=False)
    target, draft = load_pair(checkpoints, compile=True)
    with_draft = "gamma" in settings
    expected = minispec.generate(eager_target, PROMPT, draft=eager_draft if with_draft else None, **settings)
    for _ in range(3):  # the first run compiles and records; later ones replay the graphs
        out = minispec.generate(target, PROMPT, draft=draft if with_draft else None, **settings)
        assert out.tokens == expected.tokens
        assert out.sequences == expected.sequences
    if with_draft and "beams" not in settings:
        assert out.stats["accepted"] == expected.stats["accepted"]


def steps_and_syncs(target, draft, new_tokens):
    """(target calls, operations the sync debug mode flags) of one greedy request, γ = 3."""
    settings = dict(draft=draft, gamma=3, max_new_tokens=new_tokens, ignore_eos=True)
    minispec.generate(target, PROMPT, **settings)  # compiles and records graphs outside the count
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = minispec.generate(target, PROMPT, **settings)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return out.stats["target_calls"], sum("synchroniz" in str(w.message) for w in caught)


def assert_one_sync_per_step(target, draft):
    (short_steps, short_syncs), (long_steps, long_syncs) = (steps_and_syncs(target, draft, n) for n in (8, 40))
    assert long_steps > short_steps
    assert long_syncs - short_syncs == long_steps - short_steps


@pytest.mark.parametrize("compile", [False, True])
def test_one_sync_per_speculative_step(checkpoints, compile):
    """torch's sync debug mode flags every operation that makes the host wait for the GPU (a value read,
    a blocking copy either way): a speculative step with a model draft has exactly one (its .tolist());
    the rest are per request."""
    assert_one_sync_per_step(*load_pair(checkpoints, compile))


def test_bench_memory_does_not_grow_on_cuda(checkpoints, tmp_path):
    """As on CPU (tests/test_bench.py), from the caching allocator's counters: the loop's own peak of
    allocated bytes is the same for 16 and 64 tokens, and what a request leaves behind differs by less
    than one allocator block (512 bytes) between them."""
    from minispec.tools.bench import cli as bench_cli

    report = tmp_path / "bench.json"
    assert bench_cli.main(["--target", str(checkpoints[0]), "--draft", str(checkpoints[1]), "--device", "cuda",
                           "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "32", "--repeats", "1",
                           "--gamma", "3", "--memory-tokens", "64", "--json-out", str(report)]) == 0
    memory = json.loads(report.read_text())["memory"]
    assert memory["peak_short_bytes"] > 0 and abs(memory["growth"]) < 0.01
    assert abs(memory["kept_long_bytes"] - memory["kept_short_bytes"]) < 512


@pytest.fixture(scope="module")
def checkpoint_200m(tmp_path_factory):
    """A 200M-parameter llama (random weights: bandwidth does not depend on them). In float32 its
    decode step must read 0.67 GB, 0.2 ms at an H100's datasheet 3.35 TB/s: the same order as the
    launch overhead of its ~100 eager kernels, so the step should reach a sizeable fraction of the peak
    and 1 is a bound a wrong byte count or clock can cross. (The tiny checkpoints are all overhead: a
    fraction near 0.0001, which even a 1000-fold error would leave below 1.)"""
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                                      num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16,
                                      max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    return save_reference(transformers.LlamaForCausalLM(config).eval(), tmp_path_factory.mktemp("cuda_200m"))


def test_bench_bandwidth_is_a_fraction_of_the_peak(checkpoint_200m, tmp_path):
    """The decode step's achieved bandwidth (the bytes it must read over its median time) lies in (0, 1]
    of the datasheet peak memory.PEAK_BANDWIDTH gives for this GPU: above 1 the byte count or the clock
    is wrong, since nothing reads DRAM faster than its peak."""
    from minispec.tools.bench import cli as bench_cli, memory

    report = tmp_path / "bench.json"
    assert bench_cli.main(["--target", str(checkpoint_200m), "--draft", "lookup", "--device", "cuda",
                           "--dtype", "float32", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "32",
                           "--repeats", "1", "--json-out", str(report)]) == 0
    result = json.loads(report.read_text())
    bandwidth = result["memory_bandwidth"]
    name = torch.cuda.get_device_name()
    peak = memory.peak_bandwidth(name)
    assert peak is not None, f"{name} is not in memory.PEAK_BANDWIDTH: add its datasheet bandwidth"
    assert bandwidth["device_name"] == name and bandwidth["peak_bytes_per_s"] == peak
    target = minispec.load(checkpoint_200m, device="cuda", dtype=torch.float32)
    target.setup_caches(1, 64)  # decode_bytes reads the caches' head count and dimensions, not their length
    assert bandwidth["bytes_per_step"] == memory.decode_bytes(target, result["step_position"])
    assert bandwidth["achieved_bytes_per_s"] == pytest.approx(bandwidth["bytes_per_step"] / result["target_step_s"])
    print(f"{name}: {bandwidth['achieved_bytes_per_s'] / 1e9:.0f} GB/s, {bandwidth['fraction_of_peak']:.2f} of peak")
    assert 0 < bandwidth["fraction_of_peak"] <= 1
    assert bandwidth["fraction_of_peak"] == pytest.approx(bandwidth["achieved_bytes_per_s"] / peak)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_row_computes_as_it_would_alone_on_cuda(reference_dirs, kind, dtype):
    """Row invariance on CUDA (models/kernels.py: products in blocks of CUDA_ROW_BLOCK rows): 1-9 tokens,
    1/3/4 rows."""
    from test_rows import mismatched_rows

    model = minispec.load(reference_dirs[kind][1], device="cuda", dtype=dtype)
    with torch.inference_mode():
        assert mismatched_rows(model) == []


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_rows_compute_as_they_would_alone_on_cuda(reference_dirs, mode):
    from test_rows import mismatched_rows

    model = minispec.load(reference_dirs["llama_gqa"][1], device="cuda", quantize=mode)
    with torch.inference_mode():
        assert mismatched_rows(model) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_linear_gives_each_row_what_it_gives_alone_at_a_real_size(dtype):
    """A 1B model's down projection (K = 8192, where cuBLAS splits K differently by row count), 1 to
    200 rows: each row bit for bit its 1-row product. Padding rows to a multiple of 16, as minispec once
    did, fails this on an H100 (float32 from 17 rows, bfloat16 from 128)."""
    from minispec.models import kernels

    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(2048, 8192, device="cuda", generator=generator).to(dtype) / 90
    x = torch.randn(200, 8192, device="cuda", generator=generator).to(dtype)
    alone = torch.cat([kernels.linear(x[i:i + 1], weight, None, packed=False) for i in range(200)])
    for rows in list(range(1, 80)) + [128, 129, 200]:
        assert torch.equal(kernels.linear(x[:rows], weight, None, packed=False), alone[:rows]), rows


@pytest.fixture(scope="module")
def low_precision(tmp_path_factory):
    from test_rows import targets_and_noisy_drafts

    return targets_and_noisy_drafts(tmp_path_factory, device="cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_speculative_equals_plain_greedy_on_cuda(low_precision, kind, dtype):
    """gamma="auto" included: on a GPU it times the draft's step before the first guess."""
    from test_rows import speculative_mismatches

    assert speculative_mismatches(*low_precision[kind, dtype], [1, 3, 8, "auto"], ["lookup", "int8"]) == []


@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5_v1_1"])
def test_speculative_beam_search_equals_plain_beam_search_on_cuda(low_precision, kind):
    from test_rows import beam_mismatches

    assert beam_mismatches(*low_precision[kind, torch.bfloat16]) == []


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5_v1_1"])
def test_batched_requests_each_get_what_they_get_alone_on_cuda(low_precision, kind, temperature):
    """As tests/test_engine.py on CPU, in bfloat16: plain and with a draft model, 6 rows and 2 at a time."""
    from test_engine import PROMPTS

    target, noisy = low_precision[kind, torch.bfloat16]
    for draft in (None, noisy):
        settings = {"max_new_tokens": 20, "ignore_eos": True, "temperature": temperature, "seed": 3,
                    "draft": draft, "gamma": 3}
        alone = [minispec.generate(target, prompt, **settings).tokens for prompt in PROMPTS]
        for batch_size in (None, 2):
            together = minispec.generate(target, PROMPTS, batch_size=batch_size, **settings)
            assert [out.tokens for out in together] == alone, f"draft={draft is not None} batch_size={batch_size}"


# --- token trees and draft heads on CUDA (tests/test_tree.py and tests/test_heads.py on CPU) ------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_tree_token_computes_what_its_path_computes_on_cuda(reference_dirs, kind, dtype):
    """The tree mask under CUDA's kernels: every node's logits bit for bit a 1-token forward's over its path."""
    from test_tree import mismatched_tree_tokens

    model = minispec.load(reference_dirs[kind][1], device="cuda", dtype=dtype)
    with torch.inference_mode():
        assert mismatched_tree_tokens(model) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tree_decoding_equals_plain_greedy_on_cuda(low_precision, kind, dtype):
    from test_rows import PROMPT as ROWS_PROMPT

    target, noisy = low_precision[kind, dtype]
    settings = {"max_new_tokens": 40, "ignore_eos": True}
    plain = minispec.generate(target, ROWS_PROMPT, **settings).tokens
    cases = [(draft, 3, tree) for draft in (noisy, "lookup", "ngram", "int8") for tree in (4, 16)]
    cases.append((noisy, "auto", "auto"))
    mismatches = [(getattr(draft, "name", draft), gamma, tree) for draft, gamma, tree in cases
                  if minispec.generate(target, ROWS_PROMPT, draft=draft, gamma=gamma, tree=tree,
                                       **settings).tokens != plain]
    assert mismatches == []


@pytest.fixture(scope="module")
def head_dirs(reference_dirs, tmp_path_factory):
    """The tiny GQA llama and its random EAGLE, EAGLE-3 and Medusa heads (tests/test_heads.py's writers)."""
    from test_heads import write_eagle, write_eagle3, write_medusa

    directory = reference_dirs["llama_gqa"][1]
    hf = json.loads((directory / "config.json").read_text())
    return directory, {
        "eagle": write_eagle(tmp_path_factory.mktemp("eagle"), hf)[0],
        "eagle3": write_eagle3(tmp_path_factory.mktemp("eagle3"), hf, draft_vocab=list(range(1, hf["vocab_size"], 2)),
                               layer_ids=[0, 1])[0],
        "medusa": write_medusa(tmp_path_factory.mktemp("medusa"), hf["hidden_size"], hf["vocab_size"])[0]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "medusa"])
def test_greedy_with_a_head_and_its_trees_is_plain_greedy_on_cuda(head_dirs, kind, dtype):
    from test_heads import PROMPT as HEAD_PROMPT

    directory, heads = head_dirs
    target = minispec.load(directory, device="cuda", dtype=dtype)
    head = minispec.load_draft_head(heads[kind], target)
    prompts = [HEAD_PROMPT, HEAD_PROMPT[:5], [3, 4, 5]]
    settings = {"max_new_tokens": 24, "ignore_eos": True}
    plain = [minispec.generate(target, prompt, **settings).tokens for prompt in prompts]
    for gamma, tree in ((1, None), (3, None), ("auto", None), (3, 4), (3, 16), ("auto", "auto")):
        alone = [minispec.generate(target, prompt, draft=head, gamma=gamma, tree=tree, **settings) for prompt in prompts]
        assert [out.tokens for out in alone] == plain, (gamma, tree)
    together = minispec.generate(target, prompts, draft=head, gamma=3, tree=16, batch_size=2, **settings)
    assert [out.tokens for out in together] == plain


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_compiled_target_drafting_with_a_head_gives_eager_tokens(head_dirs, kind):
    """CUDA graphs reuse their outputs on replay: the hidden states a head reads must be read before."""
    from test_heads import PROMPT as HEAD_PROMPT

    directory, heads = head_dirs
    eager = minispec.load(directory, device="cuda", dtype=torch.float32)
    target = minispec.load(directory, device="cuda", dtype=torch.float32, compile=True)
    eager_head, head = minispec.load_draft_head(heads[kind], eager), minispec.load_draft_head(heads[kind], target)
    for tree in (None, 8):
        settings = {"max_new_tokens": 24, "ignore_eos": True, "gamma": 3, "tree": tree}
        expected = minispec.generate(eager, HEAD_PROMPT, draft=eager_head, **settings)
        for _ in range(2):
            out = minispec.generate(target, HEAD_PROMPT, draft=head, **settings)
            assert out.tokens == expected.tokens, tree
            assert out.stats["accepted"] == expected.stats["accepted"], tree


def test_one_sync_per_step_with_a_head(head_dirs):
    directory, heads = head_dirs
    target = minispec.load(directory, device="cuda")
    assert_one_sync_per_step(target, minispec.load_draft_head(heads["eagle"], target))


@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_beside_a_quantized_target_an_int8_head_drafts_plain_greedy_on_cuda(head_dirs, quantize):
    from minispec.models.quant import Int8Linear
    from test_heads import PROMPT as HEAD_PROMPT

    directory, heads = head_dirs
    target = minispec.load(directory, device="cuda", dtype=torch.bfloat16, quantize=quantize)
    head = minispec.load_draft_head(heads["eagle"], target)
    assert isinstance(head.layers[0].feed_forward.w2, Int8Linear)
    settings = {"max_new_tokens": 24, "ignore_eos": True}
    plain = minispec.generate(target, HEAD_PROMPT, **settings).tokens
    for gamma, tree in ((3, None), (3, 16), ("auto", "auto")):
        out = minispec.generate(target, HEAD_PROMPT, draft=head, gamma=gamma, tree=tree, **settings)
        assert out.tokens == plain and out.stats["proposed"] > 0, (gamma, tree)
