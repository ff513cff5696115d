"""The benchmark (python -m minispec.tools.bench): Theorem 3.8 and section 3.5 against hand-computed values,
the JSON/markdown report on tiny checkpoints, the reference comparison, and clean errors; the server's
benchmarks (--workloads, --tp-serve) on servers in this process.

The tiny checkpoints have no tokenizer files, so prompts are given as token ids."""

import inspect
import json
import math
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager

import pytest
import torch
from conftest import make_reference, noisy_copy, save_reference, spread_init

import minispec
from minispec.tools.bench import benchmarks, llamacpp, memory, oneshot, report, served, timing, workloads
from minispec.tools.bench import cli as bench_cli
from minispec.tools.bench.prompts import read_prompts
from minispec.decoding import drafters
from minispec.models import kernels

# Repeats itself, so the lookup drafter finds matches from the first step on.
PROMPTS = [[5, 17, 33, 8, 5, 17, 33, 8, 5], [9, 10, 11, 12, 9, 10, 11]]
PROMPT_FLAGS = [flag for prompt in PROMPTS for flag in ("--prompt-ids", ",".join(map(str, prompt)))]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    gpt2 = make_reference("gpt2")
    t5 = make_reference("t5_v1_1")
    return {
        "gpt2": str(save_reference(gpt2, tmp_path_factory.mktemp("bench_gpt2"))),
        "gpt2_noisy": str(save_reference(noisy_copy(gpt2, seed=1, scale=0.05), tmp_path_factory.mktemp("bench_noisy"))),
        "t5": str(save_reference(t5, tmp_path_factory.mktemp("bench_t5"))),
        "t5_noisy": str(save_reference(noisy_copy(t5, seed=1, scale=0.05), tmp_path_factory.mktemp("bench_t5_noisy"))),
    }


def run_bench(tmp_path, capsys, *argv):
    out = tmp_path / "bench.json"
    code = bench_cli.main([*argv, "--device", "cpu", "--max-new-tokens", str(NEW_TOKENS), "--json-out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(out.read_text()), captured.out


def finite_numbers(value):
    if isinstance(value, dict):
        return all(finite_numbers(v) for v in value.values())
    if isinstance(value, list):
        return all(finite_numbers(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


# --- Theorem 3.8 and section 3.5 ----------------------------------------------------------------------
def test_predicted_speedup_is_theorem_3_8():
    # α = 0.8, c = 0.05: γ = 1 -> (1 - 0.64) / (0.2 · 1.05) = 0.36 / 0.21; γ = 3 -> 0.5904 / 0.23
    assert benchmarks.predicted_speedup(0.8, 1, 0.05) == pytest.approx(0.36 / 0.21)
    assert benchmarks.predicted_speedup(0.8, 3, 0.05) == pytest.approx(0.5904 / 0.23)
    assert benchmarks.predicted_speedup(0.0, 4, 0.25) == pytest.approx(1 / 2)  # nothing accepted: pure draft cost
    assert benchmarks.predicted_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)  # the α -> 1 limit: (γ+1)/(γc+1)
    assert benchmarks.predicted_speedup(1 - 1e-12, 4, 0.25) == pytest.approx(5 / 2, rel=1e-6)  # continuous at 1
    assert benchmarks.predicted_speedup(0.6, 2, 0.0) == pytest.approx(1 + 0.6 + 0.36)  # c = 0: 1 + α + α²


def test_ratio_factors_multiply_to_measured_over_predicted():
    # α = 0.8, γ = 3, c = 0.1: i.i.d. tokens per call (1 - 0.8^4) / 0.2 = 2.952, predicted 2.952 / 1.3.
    # Measured: 2.5 tokens per call, a verify forward of 1.2 steps, decode speedup 1.5.
    f = benchmarks.ratio_factors(0.8, 3, 0.1, verify_cost=1.2, tokens_per_call=2.5, decode_speedup=1.5)
    assert f["tokens_per_call"] == pytest.approx(2.5 / 2.952)
    assert f["verify_cost"] == pytest.approx(1.3 / 1.5)  # (1 + γc) / (verify cost + γc)
    assert f["loop"] == pytest.approx(1.5 / (2.5 / 1.5))  # measured / what 2.5 tokens per 1.5 steps imply
    assert math.prod(f.values()) == pytest.approx(1.5 / benchmarks.predicted_speedup(0.8, 3, 0.1))


def test_best_gamma_maximizes_theorem_3_8():
    # α = 0.8, c = 0.05: 1 - 0.8^(γ+1) over 0.2(1 + 0.05γ) is 3.0396, 3.0823, 3.0921, 3.0780 at γ = 6..9.
    gamma, speedup = benchmarks.best_gamma(0.8, 0.05)
    assert gamma == 8
    assert speedup == pytest.approx((1 - 0.8**9) / (0.2 * 1.4))
    # α = 0.5, c = 0.3: γ = 1 gives 1.5 / 1.3 = 1.154 > γ = 2's 0.875 / 0.8 = 1.094.
    assert benchmarks.best_gamma(0.5, 0.3) == (1, pytest.approx(1.5 / 1.3))
    # α < c: no γ helps (Corollary 3.9); the best is still γ = 1, at (1 + α) / (1 + c) < 1.
    gamma, speedup = benchmarks.best_gamma(0.1, 0.5)
    assert (gamma, speedup) == (1, pytest.approx(1.1 / 1.5))
    assert speedup < 1
    # A free drafter that is always right: the more guesses the better, up to the search limit.
    assert benchmarks.best_gamma(1.0, 0.0) == (16, pytest.approx(17.0))


def test_memory_bandwidth_helpers(dirs, tmp_path):
    """A decode step reads each weight once, of an embedding table one row (all of it when it is
    also the output head), and the keys and values of the positions so far."""
    def row(embedding):
        return embedding.weight[0].numel()

    target = minispec.load(dirs["gpt2"], device="cpu")  # head tied to wte; wpe is looked up
    target.setup_caches(1, 64)
    weights = (sum(p.numel() for p in target.parameters()) - target.wpe.weight.numel() + row(target.wpe)) * 4
    # 2 layers x (keys + values) x 4 heads x 8 dims x 10 positions x 4 bytes
    assert memory.decode_bytes(target, 10) == weights + 2 * 2 * 4 * 8 * 10 * 4
    target.setup_caches(3, 64)  # caches kept from a batch: a request still decodes in one row
    assert memory.decode_bytes(target, 10) == weights + 2 * 2 * 4 * 8 * 10 * 4
    for kind in ("llama", "llama_gqa"):  # untied head / tied head
        llama = minispec.load(save_reference(make_reference(kind), tmp_path / kind))
        llama.setup_caches(1, 64)
        table = llama.tok_embeddings
        tied = llama.head is table
        assert tied == (kind == "llama_gqa")
        everything = sum(p.numel() for p in llama.parameters())
        assert memory.decode_bytes(llama, 0) == (everything if tied else everything - table.weight.numel() + row(table)) * 4
    t5 = minispec.load(dirs["t5"], device="cpu")  # the encoder runs once per request, not per step
    t5.setup_caches(1, 64)
    decoder = sum(p.numel() for name, p in t5.named_parameters() if not name.startswith("encoder"))
    looked_up = [t5.embed, t5.decoder_position_bias]
    decoder -= sum(m.weight.numel() - row(m) for m in looked_up)
    assert memory.decode_bytes(t5, 0) == decoder * 4
    assert memory.peak_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert memory.peak_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert memory.peak_bandwidth("NVIDIA H200") == 4.8e12
    assert memory.peak_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert memory.peak_bandwidth("NVIDIA GH200 480GB") is None  # not an H200
    assert memory.peak_bandwidth("Some Future GPU") is None
    on_cpu = memory.bandwidth(target, 10, 1e-3)  # bytes and bytes/s; no datasheet peak
    assert on_cpu["bytes_per_step"] == memory.decode_bytes(target, 10)
    assert on_cpu["achieved_bytes_per_s"] == pytest.approx(on_cpu["bytes_per_step"] / 1e-3)
    assert on_cpu["peak_bytes_per_s"] is None and on_cpu["fraction_of_peak"] is None
    assert on_cpu["limit_bytes_per_s"] == memory.read_bandwidth(torch.device("cpu"))
    assert on_cpu["fraction_of_limit"] == pytest.approx(on_cpu["achieved_bytes_per_s"] / on_cpu["limit_bytes_per_s"])


def test_read_bandwidth_is_a_streaming_read():
    """The measured limit is what a sum over a buffer far larger than the caches reaches: plausible for
    any CPU (more than 1 GB/s, less than 1 TB/s), and within 2x of another streaming read of the same
    buffer, a max (different arithmetic, the same bytes). A limit measured over a cache-sized buffer, or
    counting bytes wrongly, lands outside. A copy was the yardstick once, but a copy writes too, and its
    cost against a read varies by machine: CI measured a sum 6.3x a copy's read rate. Measured afresh
    beside each other, round after round, the best of as many reads each: other work on the machine slows
    both alike."""
    assert 1e9 < memory.read_bandwidth(torch.device("cpu")) < 1e12
    buffer = torch.ones(memory.READ_BUFFER_BYTES["cpu"] // 4)
    limit, fastest = 0.0, float("inf")
    for _ in range(3):
        limit = max(limit, memory.read_bandwidth.__wrapped__(torch.device("cpu")))  # not the process's cached one
        for _ in range(memory.READ_ROUNDS):  # the fastest of as many reads as the limit is
            start = time.perf_counter()
            buffer.amax().item()
            fastest = min(fastest, time.perf_counter() - start)
    max_read_rate = buffer.numel() * 4 / fastest
    assert 1 / 2 < limit / max_read_rate < 2


def test_memory_does_not_grow_with_generated_tokens(dirs, tmp_path, capsys):
    """A lean loop: a 100-token speculative generation peaks at no more live tensor bytes than a
    16-token one beyond what attention over 84 more positions needs, and keeps no more after it.
    Measured tensor by tensor: a loop that kept one [γ+1, vocab] logits tensor per step (1.5 KiB here,
    36 more steps: 54 KiB) fails both checks; one that kept a single token id per step fails the second."""
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", dirs["gpt2_noisy"],
                              *PROMPT_FLAGS[:2], "--gamma", "3", "--repeats", "1", "--memory-tokens", "100")
    memory = result["memory"]
    assert (memory["short_tokens"], memory["long_tokens"]) == (16, 100)
    assert memory["peak_short_bytes"] > 0  # the prompt's forward, at least
    # Attention reads the cache up to each step's last token (kernels.attend_cache): a few float32
    # [4 padded rows, 4 heads, positions] temporaries grow by 84 positions (rounded up to whole blocks).
    attention = 4 * (4 * 4 * (100 - 16 + kernels.KEY_BLOCK) * 4)
    assert 0 <= memory["peak_long_bytes"] - memory["peak_short_bytes"] <= attention
    # What a request leaves behind (the drafter's last logits, its unseen tokens) is replaced by the next
    # request's, so the two differ by a few token ids at most (64 bytes: 8 of them); one int64 kept per
    # step would add 8 bytes for each of the long generation's 36 extra steps (288 bytes).
    assert abs(memory["kept_long_bytes"] - memory["kept_short_bytes"]) <= 64
    assert "peak memory:" in table and "kept after them:" in table


def test_memory_measure_sees_every_tensor():
    """The measurement itself can fail: it sees a kept 4000-byte tensor, a 4 MiB temporary, and a free."""
    cpu, kept = torch.device("cpu"), []
    assert memory.tensor_memory(cpu, lambda: kept.append(torch.ones(1000))) == (4000, 4000)
    peak, left = memory.tensor_memory(cpu, lambda: torch.ones(1 << 20).sum())
    assert peak >= 4 << 20 and left == 0
    assert memory.tensor_memory(cpu, kept.clear) == (0, -4000)  # freed what was there before


def test_prefill_seconds_separate_the_prompt_forward(dirs):
    """A prefill made 0.3 s slower shows up in prefill_seconds (up to the first step's tokens), and only there."""
    target = minispec.load(dirs["gpt2"])
    decode_rows = target.decode_rows
    target.decode_rows = lambda feed, *args, **kwargs: (
        time.sleep(0.3 if not any(feed.lengths) else 0), decode_rows(feed, *args, **kwargs))[1]
    args = bench_cli.parse_args(["--target", "-", "--draft", "lookup", "--max-new-tokens", str(NEW_TOKENS)])
    for draft in (None, "lookup"):
        start = time.perf_counter()  # the runner's clock: stats["seconds"] starts later, after generate's checks
        tokens, stats = benchmarks.minispec_runner(target, draft, 3, args)((PROMPTS[0], 0))
        wall = time.perf_counter() - start
        assert len(tokens) == NEW_TOKENS
        assert 0.3 <= stats["prefill_seconds"] <= wall < stats["prefill_seconds"] + 0.3


def test_time_generation_takes_the_prefill_out(monkeypatch):
    """On a fake clock: 2 prompts, each 10 tokens in 3 s of which the prefill took 2 s and gave 4
    tokens -> 20 tokens / 6 s end to end, (20 - 8) tokens / (6 - 4) s in the decode phase."""
    now = [0.0]
    monkeypatch.setattr(memory.time, "perf_counter", lambda: now[0])

    def runner(stats):
        def run_one(prompt):
            now[0] += 3.0
            return [7] * 10, stats
        return run_one

    timed = timing.time_generation({"spec": runner({"prefill_seconds": 2.0, "first_call_tokens": 4}),
                                   "untimed": runner({})}, PROMPTS, 3, "cpu")
    assert timed["spec"]["tokens_per_second_repeats"] == [20 / 6] * 3
    assert timed["spec"]["decode_tokens_per_second"] == pytest.approx(12 / 2)
    assert timed["untimed"]["decode_tokens_per_second"] is None  # no prefill times, no decode phase


# --- the report -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("draft", ["same_weights", "lookup"])
def test_auto_gamma_row_beside_the_fixed_ones(dirs, tmp_path, capsys, draft):
    """--gamma auto 2: the auto row reports the policy (histogram of guesses per step, expected tokens
    per call) and is predicted by section 3.5's best fixed γ; every row has a speedup per prompt."""
    draft_arg = dirs["gpt2"] if draft == "same_weights" else "lookup"
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", draft_arg,
                              "--gamma", "auto", "2", *PROMPT_FLAGS)
    assert finite_numbers(result)
    auto, fixed = result["rows"]
    assert auto["gamma"] == "auto" and fixed["gamma"] == 2
    assert auto["identical_to_autoregressive"] is True
    steps = sum(auto["guesses_histogram"])
    assert steps > 0 and auto["mean_guesses"] == pytest.approx(
        sum(k * n for k, n in enumerate(auto["guesses_histogram"])) / steps)
    assert auto["predicted_speedup"] == pytest.approx(auto["best_gamma_predicted_speedup"])
    assert set(auto["cost_model"]) == {"t_draft", "t_verify"} and auto["expected_tokens_per_call"] >= 1
    for row in result["rows"]:
        for speedups in row["per_prompt_speedup"], row["per_prompt_speedup_fastest"]:
            assert len(speedups) == len(PROMPTS) and all(x > 0 for x in speedups)
    assert len(auto["acceptance_by_confidence"]) == 5
    assert "| auto (mean" in table and "auto: guesses per step" in table and "acceptance by the drafter's" in table
    assert sum(re.match(r"\| prompt \d", line) is not None for line in table.splitlines()) == len(PROMPTS)


def test_row_invariance_price(dirs, tmp_path, capsys):
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--gamma", "2",
                              "--row-invariance-price", *PROMPT_FLAGS)
    price = result["row_invariance_price"]
    assert set(price) == {"with", "without"} and all(set(t) == {"1", "4", "9"} for t in price.values())
    assert all(s > 0 for t in price.values() for s in t.values())
    assert re.search(r"row invariance: target forward with / without \(ms\): 1 tokens [\d.]+ / [\d.]+ ", table)
    assert kernels.ATTENTION_ROW_BLOCK == 4  # restored


def test_batch_sizes_table(dirs, tmp_path, capsys):
    """--batch-sizes: total tokens/s per batch size, plain and speculative, with the same outputs."""
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--gamma", "3",
                              "--batch-sizes", "1", "3", "--repeats", "1", *PROMPT_FLAGS)
    assert [row["batch"] for row in result["batches"]] == [1, 3]
    assert all(row["identical"] is True and row["plain_tokens_per_second"] > 0 and
               row["speculative_tokens_per_second"] > 0 for row in result["batches"])
    assert re.search(r"^\| 3 \| [\d.]+ \| [\d.]+x \| [\d.]+ \| [\d.]+x \| yes \|$", table, re.M)


def test_beams_table(dirs, tmp_path, capsys):
    """--beams: plain beam search against speculative per prompt and γ, the same result."""
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", dirs["gpt2"], "--gamma", "auto",
                              "2", "--beams", "2", "--draft-beams", "3", "--repeats", "1", *PROMPT_FLAGS)
    assert [(row["prompt"], row["gamma"]) for row in result["beams"]] == [
        (i + 1, g) for i in range(len(PROMPTS)) for g in ("auto", 2)]
    for row in result["beams"]:
        assert row["identical"] is True and row["seconds"] > 0 and row["speedup_fastest"] > 0
        # the draft is the target itself: every guess survives, so γ = 2 makes 3 beam steps a call
        assert row["gamma"] == "auto" or row["target_calls"] < row["plain_target_calls"]
    assert row["guesses_histogram"] is None and result["beams"][0]["guesses_histogram"] is not None
    assert re.search(r"^\| 1 \| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+x \| \d+ \(\d+\) \| - \| yes \|$",
                     table, re.M)


def test_drafters_side_by_side(dirs, tmp_path, capsys):
    """Several --draft values: one row each against the same plain decoding, greedy output identical,
    acceptance by guess position (the target's own weights as the draft: every guess survives), and a
    guess's cost against a target step (a Medusa head's too)."""
    from minispec.heads import save_draft_head
    from minispec.tools import train_heads as train

    target = minispec.load(dirs["gpt2"])
    medusa, hf = train.new_head("medusa", target, 2)
    save_draft_head(medusa, hf, tmp_path / "medusa")
    drafts = ["lookup", "ngram", "int8", dirs["gpt2"], str(tmp_path / "medusa")]
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", *drafts, "--gamma", "3",
                              "--repeats", "1", *PROMPT_FLAGS)
    assert [row["draft"] for row in result["rows"]] == drafts
    for row in result["rows"]:
        assert row["identical_to_plain"] is True and row["speedup"] > 0 and row["guess_cost"] > 0
        assert len(row["acceptance_by_position"]) == 3
    same = result["rows"][3]
    assert same["acceptance_by_position"] == [1.0, 1.0, 1.0] and same["tokens_per_target_call"] > 3
    assert re.search(r"^\| `int8` \| [\d.]+ \| [\d.]+x \| yes \| [\d.]+ \| [\d.]+ \| [\d.]+( \| ([\d.]+|-)){4} \| "
                     r"[\d.]+ \|$", table, re.M)


def test_drafters_quantize_only_the_draft_models(dirs, tmp_path, capsys):
    """--draft-quantize beside a model-free drafter: the model is quantized, the model-free one runs as it is
    (not refused as a model-free --draft with --draft-quantize alone is)."""
    result, _ = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", dirs["gpt2"],
                          "--draft-quantize", "int8", "--gamma", "2", "--repeats", "1", *PROMPT_FLAGS)
    assert [row["draft"] for row in result["rows"]] == ["lookup", dirs["gpt2"]]
    assert all(row["identical_to_plain"] is True for row in result["rows"])


def test_bench_prices_a_call_as_its_draft_forwards_and_a_verification_as_wide_as_its_guesses():
    """The bench's cost columns: draft ms per call = forwards per call x a forward's ms; verify ms = a target
    forward of 1 + guesses per call tokens, interpolated between the widths timed."""
    from types import SimpleNamespace

    from minispec.tools.bench.drafters import cost_cells, drafter_row
    stats = [{"verified_at": [4, 2], "accepted_at": [2, 1], "target_calls": 8, "proposed": 6, "new_tokens": 12,
              "draft_calls": 4}]
    spec = {"stats": stats, "tokens_per_second": 12.0, "decode_tokens_per_second": 10.0, "outputs": [[1]],
            "request_seconds": [1.0, 2.0]}
    plain = {"tokens_per_second": 10.0, "outputs": [[1]], "request_seconds": [1.5, 2.0]}
    cost = {"guess_cost": 0.4, "target_step_ms": 80.0, "forward_ms": {1: 80.0, 2: 84.0, 4: 90.0}, "draft_ms": 30.0,
            "per_forward": True}
    row = drafter_row("d", spec, plain, cost, SimpleNamespace(tree=None, temperature=0))
    assert row["draft_forwards_per_call"] == 0.5 and row["draft_ms_per_call"] == 15.0
    assert row["verify_ms_per_call"] == pytest.approx(83.0)  # 1.75 tokens: between the 1- and 2-token forwards
    assert row["ms_per_call"] == pytest.approx(1.5 / 10.0 * 1e3)
    assert row["speedup_by_request"] == [1.5, 1.0]
    cells = cost_cells(row)
    assert cells[4:7] == ["15.0 (0.19x)", "83.0 (1.04x)", "98.0 (1.23x)"]
    assert cells[-2:] == [f"{1.5 * 80 / 98:.2f}x", f"{1.5 ** 0.5:.2f}x"]


def test_drafters_with_a_tree_beside_their_chains(dirs, tmp_path, capsys):
    """--tree N: each drafter runs as a chain and with trees, in the same rounds, two rows: the tree's
    nodes per target call, and its tokens per call and speed over its chain's (the speedup column over
    plain decoding for both). Greedy output is plain's either way; the target's own weights as the draft
    accept their whole chain, which a tree's spine is: the same tokens per call."""
    drafts = ["lookup", "ngram", dirs["gpt2"]]
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", *drafts, "--gamma", "3",
                              "--tree", "8", "--repeats", "1", *PROMPT_FLAGS)
    rows = result["rows"]
    assert [(row["draft"], row["tree"]) for row in rows] == [(d, tree) for d in drafts for tree in (None, 8)]
    for chain, tree in zip(rows[::2], rows[1::2]):
        assert chain["identical_to_plain"] is True and tree["identical_to_plain"] is True
        assert chain["tree_nodes_per_call"] is None and "speed_vs_chain" not in chain
        assert 0 < tree["tree_nodes_per_call"] <= 8
        assert tree["tokens_per_target_call_vs_chain"] == pytest.approx(
            tree["tokens_per_target_call"] / chain["tokens_per_target_call"])
        assert tree["speed_vs_chain"] == pytest.approx(tree["speedup"] / chain["speedup"])
    assert rows[-1]["tokens_per_target_call_vs_chain"] == 1.0 and rows[-1]["tokens_per_target_call"] > 3
    assert "| tree nodes/call | tok/call vs chain | speed vs chain |" in table
    cells = r"( \| ([\d.]+x?|-|yes)){11}"  # tok/s to guess cost
    assert re.search(rf"^\| `ngram`{cells} \| - \| - \| - \|$", table, re.M)
    assert re.search(rf"^\| `ngram` tree{cells} \| [\d.]+ \| [\d.]+x \| [\d.]+x \|$", table, re.M)


def test_draft_bytes_per_step_for_a_model_draft(dirs, tmp_path, capsys):
    """The target's own int8 copy as the draft: its bytes per step are its own (int8 weights, fewer than
    the float32 target's), and a model-free drafter has none."""
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "int8", "--gamma", "2",
                              "--repeats", "1", *PROMPT_FLAGS)
    draft, target = result["draft_memory_bandwidth"], result["memory_bandwidth"]
    copy = drafters.make_drafter("int8", minispec.load(dirs["gpt2"])).model
    copy.setup_caches(1, 64)
    assert draft["bytes_per_step"] == memory.decode_bytes(copy, result["step_position"]) < target["bytes_per_step"]
    assert draft["achieved_bytes_per_s"] > 0
    assert re.search(r"^draft decode step: [\d.]+ ms, [\d.]+ MB read, [\d.]+ GB/s = \d+% of the [\d.]+ GB/s "
                     r"measured$", table, re.M)
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--gamma", "2",
                              "--repeats", "1", *PROMPT_FLAGS)
    assert result["draft_memory_bandwidth"] is None and "draft decode step" not in table


@pytest.mark.parametrize("draft", ["lookup", "same_weights"])
def test_report_has_every_field(dirs, tmp_path, capsys, draft):
    draft_arg = dirs["gpt2"] if draft == "same_weights" else "lookup"
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", draft_arg,
                              "--gamma", "1", "3", *PROMPT_FLAGS)
    assert finite_numbers(result)
    assert result["settings"]["gammas"] == [1, 3] and result["settings"]["repeats"] == 3
    ar = result["autoregressive"]
    assert len(ar["tokens_per_second_repeats"]) == 3
    assert ar["tokens_per_second"] == pytest.approx(sorted(ar["tokens_per_second_repeats"])[1])  # the median
    expected = [minispec.generate(minispec.load(dirs["gpt2"]), p, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens
                for p in PROMPTS]
    assert ar["outputs"] == expected
    assert result["target_step_s"] > 0
    assert 0 < result["prefill_s"] and ar["decode_tokens_per_second"] > 0
    assert result["step_position"] == len(PROMPTS[0]) + NEW_TOKENS // 2
    assert result["memory_bandwidth"]["fraction_of_peak"] is None  # CPU: no datasheet peak
    # The target's forward at every width a tree or a chain verifies, against the measured limit
    widths = result["forward_bandwidth"]
    assert list(widths) == ["1", "2", "4", "8", "16"]  # γ + 1 = 2 and 4 among them
    for width in widths.values():
        assert width["bytes_per_step"] == result["memory_bandwidth"]["bytes_per_step"]
        assert width["fraction_of_limit"] == pytest.approx(width["achieved_bytes_per_s"] / width["limit_bytes_per_s"])
    assert re.search(r"^target forward by tokens fed \(ms, share of the measured read bandwidth\): 1: [\d.]+ ms \d+%, "
                     r"2: .*, 16: [\d.]+ ms \d+%$", table, re.M)
    assert [row["gamma"] for row in result["rows"]] == [1, 3]
    for row in result["rows"]:
        gamma = row["gamma"]
        assert row["identical_to_autoregressive"] is True
        assert row["outputs"] == expected
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / ar["tokens_per_second"])
        assert 0 <= row["alpha"] <= 1 and 0 <= row["acceptance_rate"] <= 1
        assert 1 <= row["tokens_per_target_call"] <= gamma + 1
        assert row["c"] == pytest.approx(row["draft_step_s"] / result["target_step_s"]) and row["c"] > 0
        assert row["verify_cost_ratio"] == pytest.approx(row["verify_step_s"] / result["target_step_s"])
        assert row["predicted_speedup"] == pytest.approx(benchmarks.predicted_speedup(row["alpha"], gamma, row["c"]))
        assert row["decode_tokens_per_second"] > 0  # its arithmetic: test_time_generation_takes_the_prefill_out
        assert row["decode_speedup"] == pytest.approx(row["decode_tokens_per_second"] / ar["decode_tokens_per_second"])
        assert row["measured_over_predicted"] == pytest.approx(row["decode_speedup"] / row["predicted_speedup"])
        assert math.prod(row["measured_over_predicted_factors"].values()) == pytest.approx(row["measured_over_predicted"])
        assert 1 <= row["decode_tokens_per_target_call"] <= gamma + 1
        assert f"- γ = {gamma}: " in table
        assert (row["best_gamma"], row["best_gamma_predicted_speedup"]) == \
            benchmarks.best_gamma(row["alpha"], row["c"])
        assert row["best_gamma_predicted_speedup"] >= row["predicted_speedup"]
        if draft == "same_weights":
            # Every guess accepted: each target call, the prefill too, yields γ + 1 tokens (fewer at the end).
            assert row["alpha"] == pytest.approx(1.0) and row["acceptance_rate"] == 1.0
            assert row["tokens_per_target_call"] == NEW_TOKENS / math.ceil(NEW_TOKENS / (gamma + 1))
        else:
            assert row["acceptance_rate"] > 0  # the repeating prompts give the lookup drafter hits
    lines = table.splitlines()
    assert any(line.startswith("| γ | AR tok/s | spec tok/s | speedup | decode speedup | α |") for line in lines)
    assert sum(line.startswith("| 1 |") or line.startswith("| 3 |") for line in lines) == 2
    assert "reference" not in result


def test_prompts_file_of_token_ids(dirs, tmp_path, capsys):
    """The prompts file run.py's --prompts-file reads: JSON lines of token ids."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(prompt) for prompt in PROMPTS))
    result, _ = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "ngram", "--prompts", str(prompts),
                          "--repeats", "1", "--temperature", "0.8")
    assert result["settings"]["prompts"] == 2
    row = result["rows"][0]
    assert row["gamma"] == "auto" and row["identical_to_autoregressive"] is None  # sampled: not comparable
    assert all(len(tokens) == NEW_TOKENS for tokens in row["outputs"])


# --- the reference implementation -------------------------------------------------------------------------
@pytest.mark.parametrize("target, draft", [("gpt2", "gpt2_noisy"), ("gpt2", "lookup"), ("t5", "t5_noisy"),
                                           ("t5", "lookup")])
def test_reference_outputs_are_identical_when_greedy(dirs, tmp_path, capsys, target, draft):
    draft_arg = dirs[draft] if draft in dirs else draft
    result, table = run_bench(tmp_path, capsys, "--target", dirs[target], "--draft", draft_arg, "--gamma", "2", "4",
                              "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--compare-reference")
    reference = result["reference"]
    assert reference["autoregressive"]["identical"] is True
    assert reference["autoregressive"]["tokens_per_second"] > 0
    assert [a["gamma"] for a in reference["assisted"]] == [2, 4]
    for assisted in reference["assisted"]:
        assert assisted["identical"] is True
        assert assisted["speedup"] == pytest.approx(
            assisted["tokens_per_second"] / reference["autoregressive"]["tokens_per_second"])
    assert "reference autoregressive:" in table and "| ref assisted tok/s |" in table
    assert table.count("| yes |") == 2


def test_reference_has_no_ngram_counterpart(dirs, tmp_path, capsys):
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "ngram", "--repeats", "1",
                              "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--compare-reference")
    assert result["reference"]["autoregressive"]["identical"] is True
    assert result["reference"]["assisted"] == []
    assert "| - | - | - |" in table


def sampled_outputs(directory, seeds=(0,), **settings):
    """minispec.generate's tokens for each of PROMPTS and each seed, as the bench's requests order them."""
    target = minispec.load(directory)
    return [minispec.generate(target, prompt, max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0,
                              seed=seed, **settings).tokens for prompt in PROMPTS for seed in seeds]


def test_seeds_sample_each_prompt_several_times(dirs, tmp_path, capsys):
    """--seed 5 --seeds 3 at temperature 1: every decoder generates each prompt with seeds 5, 6 and 7."""
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--gamma", "2",
                              "--temperature", "1", "--seed", "5", "--seeds", "3", "--repeats", "1", *PROMPT_FLAGS)
    assert result["settings"]["seeds"] == 3 and "2 prompts x 3 seeds" in table
    expected = sampled_outputs(dirs["gpt2"], seeds=(5, 6, 7))
    assert result["autoregressive"]["outputs"] == expected
    assert len({tuple(tokens) for tokens in expected}) == 6  # six different samples
    assert result["rows"][0]["outputs"] == sampled_outputs(dirs["gpt2"], seeds=(5, 6, 7), draft="lookup", gamma=2)


def test_top_k_and_top_p_reach_every_decoder(dirs, tmp_path, capsys):
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--gamma", "2",
                              "--temperature", "1", "--top-k", "20", "--top-p", "0.8", "--repeats", "1", *PROMPT_FLAGS)
    assert (result["settings"]["top_k"], result["settings"]["top_p"]) == (20, 0.8)
    assert "temperature 1.0, top-k 20, top-p 0.8" in table
    expected = sampled_outputs(dirs["gpt2"], top_k=20, top_p=0.8)
    assert result["autoregressive"]["outputs"] == expected
    assert result["rows"][0]["outputs"] == sampled_outputs(dirs["gpt2"], top_k=20, top_p=0.8, draft="lookup", gamma=2)
    assert expected != sampled_outputs(dirs["gpt2"])  # the settings change the samples


# --- bad input -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--gamma", "0"], "--gamma values must be >= 1"),
    (["--repeats", "0"], "--repeats, --max-new-tokens and --seeds must be >= 1"),
    (["--seeds", "0"], "--repeats, --max-new-tokens and --seeds must be >= 1"),
    (["--temperature", "-1"], "temperature must be a number >= 0"),
    (["--temperature", "1", "--top-p", "0"], "top_p must be a number in (0, 1]"),
    ([], "has no tokenizer files: give prompts as token ids"),  # the built-in text prompts
    (["--prompts", "/nonexistent/prompts.json"], "--prompts /nonexistent/prompts.json"),
    (["--prompt-ids", "1,2,500"], "prompt token ids must be in [0, 96)"),
    (["--device", "tpu9"], "device 'tpu9' is not a torch device"),
    (["--batch-sizes", "0"], "--batch-sizes must be >= 1"),
    (["--beams", "0"], "--beams must be >= 1"),
    (["--beams", "2", "--batch-sizes", "2"], "--batch-sizes is a benchmark of its own"),
    (["--one-shot", "--batch-sizes", "2"], "--batch-sizes is a benchmark of its own"),
    (["--draft", "lookup", "ngram", "--one-shot"], "several --draft values are a benchmark of their own"),
    (["--tree", "0"], "--tree must be >= 1"),
    (["--llama-cpp", "/nonexistent", "--prompt-ids", "1,2"], "--llama-cpp compares greedy decoding of text prompts"),
    (["--llama-cpp", "/nonexistent"], "--llama-cpp needs --target as a GGUF file"),
    (["--llama-cpp", "/nonexistent", "--draft", "lookup", "ngram"], "--llama-cpp goes with the main table"),
    (["--workloads", "--requests", "1"], "--workloads needs --requests >= 2"),
    (["--workloads", "agent", "--one-shot"], "--workloads, --tp-serve and --serve-load are benchmarks of their own"),
    (["--serve-load", "--tp-serve", "2"], "--workloads, --tp-serve and --serve-load are benchmarks of their own"),
    (["--features", "--beams", "2"], "--features is a benchmark of its own"),
    (["--tp-serve", "1"], "--tp-serve must be >= 2"),
    (["--tp-serve", "2", "--clients", "0"], "--requests and --clients must be >= 1"),
    (["--workloads", "--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
])
def test_bad_input_is_named(dirs, tmp_path, capsys, flags, message):
    device = [] if "--device" in flags else ["--device", "cpu"]
    code = bench_cli.main(["--target", dirs["gpt2"], "--draft", "lookup", *device,
                           "--json-out", str(tmp_path / "out.json"), *flags])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_bad_prompts_file(dirs, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"not": "a prompt"}))
    assert bench_cli.main(["--target", dirs["gpt2"], "--draft", "lookup", "--prompts", str(prompts)]) == 2
    assert "a JSON line must be a string or a list of token ids" in capsys.readouterr().err


def test_missing_reference_implementation_is_named(dirs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    code = bench_cli.main(["--target", dirs["gpt2"], "--draft", "lookup", "--device", "cpu", "--repeats", "1",
                           "--max-new-tokens", "4", "--prompt-ids", "1,2,3", "--compare-reference",
                           "--json-out", str(tmp_path / "out.json")])
    assert code == 2
    assert "pip install transformers" in capsys.readouterr().err


@pytest.mark.skipif("compile" not in inspect.signature(minispec.load).parameters,
                    reason="minispec.load has no compile option yet")
def test_compile_flag(dirs, tmp_path, capsys):
    """--compile: the outputs are plain decoding's, and the warm-up pass, which compiles the graphs, is
    reported apart from the timed rounds (compiling takes seconds, decoding this model milliseconds)."""
    torch._dynamo.reset()  # graphs an earlier test compiled for these shapes would make the warm-up a lookup
    with torch._inductor.config.patch(fx_graph_cache=False):  # nor may the disk cache compile it in no time
        result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--compile",
                                  "--gamma", "1", "--repeats", "1", "--prompt-ids", ",".join(map(str, PROMPTS[0])))
    assert result["settings"]["compile"] is True
    assert result["rows"][0]["identical_to_autoregressive"] is True
    plain = result["autoregressive"]
    assert plain["warmup_seconds"] > 5 * sum(plain["request_seconds"])
    assert re.search(r"^warm-up pass over the prompts \(compiling the graphs\): plain [\d.]+ s, then γ = 1 [\d.]+ s$",
                     table, re.M)


def test_one_shot_runs_each_request_in_a_fresh_process(dirs, tmp_path, capsys, monkeypatch):
    """--one-shot: every request its own process, plain and each --gamma, same outputs; auto's first
    run starts from an empty profiles folder and its later runs from what the first one kept."""
    runs = []
    in_fresh_process = oneshot.in_fresh_process
    monkeypatch.setattr(oneshot, "in_fresh_process", lambda spec, env: runs.append(
        (spec, env["MINISPEC_PROFILES"], sorted(os.listdir(env["MINISPEC_PROFILES"])))) or in_fresh_process(spec, env))
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--one-shot",
                              "--gamma", "auto", "2", "--repeats", "2", *PROMPT_FLAGS[:2])
    assert len(runs) == 2 * 3  # rounds x (plain, auto, 2), for one prompt
    assert [spec["gamma"] for spec, _, _ in runs[:3]] == [None, "auto", 2]
    assert [spec["draft"] for spec, _, _ in runs[:3]] == [None, "lookup", "lookup"]
    assert runs[1][2] == [] and len(runs[4][2]) == 1  # auto: nothing kept before its first run, a file after
    assert len({folder for _, folder, _ in runs}) == 1 and not os.path.exists(runs[0][1])  # the bench's own, removed
    rows = result["one_shot"]
    assert len(rows) == 1
    for row in rows:
        assert row["plain_seconds"] > 0 and row["load_seconds"] > 0
        assert set(row["configs"]) == {"auto", "2"} and all(c["identical"] for c in row["configs"].values())
        assert row["configs"]["auto"]["first_seconds"] > 0 and row["configs"]["auto"]["later_seconds"] > 0
        # the process as a user's shell sees it: python's start, imports, load and request; torch alone is ~200 MiB
        assert row["wall_seconds"] > row["load_seconds"] + row["plain_seconds"] and row["peak_mib"] > 200
    assert "| prompt | load s | plain s | plain wall s | peak MiB | γ = auto | γ = 2 | same output |" in table
    assert "first " in table


def test_threads_under_load_runs_the_default_and_each_setting_beside_a_busy_core(dirs, tmp_path, capsys, monkeypatch):
    """--threads-under-load: while a process spins on one core, each request in a fresh process with the
    default threads (OpenMP's wait policy left to minispec) and with 1..CPUs threads, taking turns."""
    runs, busy = [], []
    in_fresh_process = oneshot.in_fresh_process

    def spy(spec, env):
        busy.append(sum(1 for pid in os.listdir("/proc") if pid.isdigit() and spinning(pid)))
        runs.append((spec["threads"], env.get("OMP_WAIT_POLICY") or env.get("GOMP_SPINCOUNT")))
        return in_fresh_process(spec, env)

    monkeypatch.setattr(oneshot, "in_fresh_process", spy)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.setenv("GOMP_SPINCOUNT", "300000")
    result, table = run_bench(tmp_path, capsys, "--target", dirs["gpt2"], "--draft", "lookup", "--threads-under-load",
                              "--gamma", "2", "--repeats", "1", *PROMPT_FLAGS[:2])
    cpus = len(os.sched_getaffinity(0))
    assert runs == [(None, None)] + [(n, None) for n in range(1, cpus + 1)]
    assert busy == [1] * len(runs)  # the spinning process, there for every run
    assert not any(spinning(pid) for pid in os.listdir("/proc") if pid.isdigit())  # and gone after
    assert set(result["tokens_per_second"]) == {"default", *map(str, range(1, cpus + 1))}
    best = max(rate for name, rate in result["tokens_per_second"].items() if name != "default")
    assert result["default_over_best"] == pytest.approx(result["tokens_per_second"]["default"] / best)
    assert "| threads | tok/s | x best |" in table and "the goal of 0.8x" in table


def spinning(pid):
    """Whether process `pid` is the bench's spinning one (bench/oneshot.py): a child of this test's process,
    since other programs on a shared machine may run a `while True:` of their own."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            command = file.read()
        with open(f"/proc/{pid}/stat") as file:
            parent = int(file.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return False
    return b"while True:" in command and parent == os.getpid()


def fake_llama_cpp(directory, plain_ms=(500, 400, 600), decoded_s=2.0):
    """Stand-ins for llama.cpp's programs in directory/build/bin: each appends its arguments to calls.txt
    and prints the line llama.cpp prints when done, with or without its log prefix (llama-completion's
    perf lines: its plain rate, a different time on each call; the other two their decode phase)."""
    folder = directory / "build" / "bin"
    folder.mkdir(parents=True)
    times = " ".join(map(str, plain_ms))
    scripts = {
        "llama-completion": f'n=$(wc -l < {directory}/calls.txt); set -- {times}; shift $((n % 3)); '
                            "printf 'a character cut short: \\231\\n'; "  # invalid UTF-8, as random weights write
                            'echo "0.00.788.984 I common_perf_print: prompt eval time = 10.00 ms / 9 tokens"; '
                            'echo "0.00.789.014 I common_perf_print:        eval time =     $1.00 ms /    15 runs   (x)"',
        "llama-speculative": f'echo "0.00.784.475 I decoded   16 tokens in    {decoded_s:.3f} seconds, speed:    8.000 t/s"',
        "llama-lookup": 'echo "decoded   16 tokens in    0.500 seconds, speed:   32.000 t/s" >&2',
    }
    for name, body in scripts.items():
        script = folder / name
        script.write_text(f'#!/bin/bash\necho "$(basename $0) $*" >> {directory}/calls.txt\n{body}\n')
        script.chmod(0o755)
    (directory / "calls.txt").write_text("")


def test_llama_cpp_peer_runs_each_mode_on_the_same_files_and_prompts_in_turn_with_minispec(tmp_path):
    """--llama-cpp: each of llama.cpp's modes on every prompt, greedy, EOS ignored, the same threads and
    new tokens, the draft model only where --draft is a GGUF file, in the same rounds as minispec's own
    runners (request by request, each runner in turn); rates from the lines llama.cpp prints (plain:
    eval runs / eval time; the median of the rounds)."""
    fake_llama_cpp(tmp_path)
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF")
    draft.write_bytes(b"GGUF")
    calls = tmp_path / "calls.txt"
    texts = {(1, 2): "first prompt", (3,): "second"}
    runners = {("llama.cpp", mode): run for mode, run in llamacpp.peer_runners(tmp_path, target, draft, texts, 16, 2, 7).items()}

    def minispec_run(request):
        with calls.open("a") as f:
            f.write("minispec\n")
        return [0] * 16, {"prefill_seconds": 0.0, "first_call_tokens": 1}
    timed = timing.time_generation({("minispec", None): minispec_run, **runners}, [([1, 2], 7), ([3], 7)], 3, "cpu")
    # plain: two prompts per round, 15 runs each; the fake's time cycles with the lines in calls.txt: after
    # the warm-up pass the calls take 600 + 500, 400 + 600, 500 + 400 ms
    plain = timed["llama.cpp", "plain"]
    # (to the timer's own microseconds: time_generation times each call around run_one)
    assert plain["decode_tokens_per_second_repeats"] == pytest.approx([30 / 1.1, 30 / 1.0, 30 / 0.9], rel=1e-3)
    assert plain["decode_tokens_per_second"] == pytest.approx(30 / 1.0, rel=1e-3)
    assert timed["llama.cpp", "speculative"]["decode_tokens_per_second"] == pytest.approx(8.0, rel=1e-3)
    assert timed["llama.cpp", "lookup"]["decode_tokens_per_second"] == pytest.approx(32.0, rel=1e-3)
    lines = calls.read_text().splitlines()
    assert len(lines) == 4 * 2 * 4  # 4 runners x 2 prompts x (warm-up + 3 rounds)
    # each round: minispec's pass, then each of llama.cpp's programs', before the next round
    assert [line.split()[0] for line in lines[8:16]] == ["minispec"] * 2 + ["llama-completion"] * 2 + \
        ["llama-speculative"] * 2 + ["llama-lookup"] * 2
    peers = [line for line in lines if line != "minispec"]
    for call in peers:
        assert f"-m {target} -n 16 -t 2 --temp 0 --ignore-eos -s 7" in call
    assert sum(f"-md {draft}" in call for call in peers) == 8
    assert sum(call.endswith("-p first prompt") for call in peers) == 12
    assert all("-no-cnv" in call for call in peers if call.startswith("llama-completion"))
    assert set(llamacpp.peer_runners(tmp_path, target, "lookup", texts, 16, 2, 0)) == {"plain", "lookup"}


def test_a_measured_run_is_its_process_wall_and_its_own_peak_memory(tmp_path):
    """--one-shot times a call as a user's shell does (process start to exit) and reads that process's own
    peak resident memory, not the largest of every child so far; a hung one is ended at the limit."""
    big = "x = bytearray(300 << 20); x[::4096] = b'1' * len(x[::4096]); import time; time.sleep(0.2); print('big')"
    code, out, err, wall, peak = oneshot.run_measured([sys.executable, "-c", big])
    assert (code, out, err) == (0, "big\n", "") and wall >= 0.2 and peak >= 300
    code, out, _, _, small = oneshot.run_measured([sys.executable, "-c", "import sys; print('small'); sys.exit(3)"])
    assert (code, out) == (3, "small\n") and small < 100
    start = time.perf_counter()
    with pytest.raises(ValueError, match="took more than 0.5 s"):
        oneshot.run_measured([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)
    assert time.perf_counter() - start < 10


def test_one_shot_calls_llama_completion_on_the_same_prompt_in_turn(tmp_path, capsys, monkeypatch):
    """--one-shot --llama-cpp: after minispec's calls of each prompt, llama-completion is called once on the
    same prompt as minispec read it (a chat turn spelled out), greedy, EOS ignored, the same new tokens; the
    table sets a plain call's wall time and peak memory beside llama.cpp's, and the geometric mean of their
    ratio against the goal."""
    fake_llama_cpp(tmp_path)
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    prompts, prompts_file = ["Say hello.", "Name a colour."], tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(prompts) + "\n")
    runs = []

    def in_fresh_process(spec, env):
        runs.append(spec)
        with (tmp_path / "calls.txt").open("a") as f:
            f.write("minispec\n")
        return {"load_seconds": 0.5, "seconds": 1.0, "tokens": [1, 2], "guesses_histogram": None,
                "text": f"<turn>{spec['prompt']}</turn>", "wall_seconds": 2.0 + len(runs), "peak_mib": 700.0}
    monkeypatch.setattr(oneshot, "in_fresh_process", in_fresh_process)
    result, table = run_bench(tmp_path, capsys, "--target", str(target), "--draft", "lookup", "--one-shot",
                              "--gamma", "2", "--repeats", "2", "--prompts", str(prompts_file), "--chat",
                              "--llama-cpp", str(tmp_path))
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 * len(prompts) * 3  # rounds x prompts x (plain, γ = 2, llama.cpp)
    for i, call in enumerate(calls[2::3]):
        assert call.startswith(f"llama-completion -m {target} -n {NEW_TOKENS} -t {torch.get_num_threads()} "
                               "--temp 0 --ignore-eos")
        assert "-no-cnv --no-display-prompt" in call and call.endswith(f"-p <turn>{prompts[i % len(prompts)]}</turn>")
    rows = result["one_shot"]
    assert [row["wall_seconds"] for row in rows] == [(3 + 7) / 2, (5 + 9) / 2]  # the plain runs' medians
    assert all(row["peak_mib"] == 700.0 and 0 < row["llama_cpp"]["wall_seconds"] < 5 for row in rows)
    assert result["wall_over_llama_cpp"] == pytest.approx(statistics.geometric_mean(
        row["wall_seconds"] / row["llama_cpp"]["wall_seconds"] for row in rows))
    assert "| prompt | load s | plain s | plain wall s | peak MiB | llama.cpp wall s | llama.cpp MiB | x llama.cpp |" \
        in table and "the goal of at most 1.3x" in table
    (tmp_path / "calls.txt").unlink()  # stopping at EOS on one side stops it on the other
    run_bench(tmp_path, capsys, "--target", str(target), "--draft", "none", "--one-shot", "--repeats", "1",
              "--prompts", str(prompts_file), "--llama-cpp", str(tmp_path), "--no-ignore-eos")
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    peers = [call for call in calls if call.startswith("llama-completion")]
    assert len(peers) == len(prompts) and not any("--ignore-eos" in call for call in peers)


def test_llama_cpp_without_a_folder_is_found_on_path_or_skipped(tmp_path, capsys, monkeypatch):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    flags = ["--target", str(target), "--draft", "lookup", "--one-shot", "--prompts", "partial", "--llama-cpp"]
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert bench_cli.parse_args(flags).llama_cpp is None
    assert "no llama-completion on PATH: llama.cpp skipped" in capsys.readouterr().err
    fake_llama_cpp(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path / "build" / "bin"))
    assert bench_cli.parse_args(flags).llama_cpp == ""
    assert llamacpp.find_programs("")["plain"] == tmp_path / "build" / "bin" / "llama-completion"


def test_llama_cpp_peer_failures_are_named(tmp_path):
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="no llama-completion in it"):
        llamacpp.find_programs(tmp_path)
    fake_llama_cpp(tmp_path)
    with pytest.raises(ValueError, match="needs --target as a GGUF file"):
        llamacpp.check_files(tmp_path / "missing.gguf", "lookup")
    (tmp_path / "build" / "bin" / "llama-lookup").write_text("#!/bin/bash\necho 'error: unknown model' >&2; exit 1\n")
    with pytest.raises(ValueError, match="llama-lookup failed \\(exit 1\\): error: unknown model"):
        llamacpp.peer_runners(tmp_path, target, "lookup", {(1,): "p"}, 16, 2, 0)["lookup"](([1], 0))


def test_llama_cpp_peer_against_minispec(dirs, tmp_path):
    """minispec's decode phase against llama.cpp's: plain against plain, the best of minispec's plain
    and rows against the best of llama.cpp's modes; in the report, one line."""
    fake_llama_cpp(tmp_path, plain_ms=(500, 500, 500))
    target = tmp_path / "t.gguf"
    target.write_bytes(b"GGUF")
    args = bench_cli.parse_args(["--target", dirs["gpt2"], "--draft", "lookup", "--prompt-ids", "1,2"])
    args.target, args.llama_cpp, args.prompt_ids, args.prompts, args.repeats = target, tmp_path, None, "code", 1
    result = {"autoregressive": {"decode_tokens_per_second": 15.0}, "rows": [{"decode_tokens_per_second": 48.0}]}
    model = minispec.load(dirs["gpt2"])
    prompts = [[i] for i, _ in enumerate(read_prompts(args))]  # its ids (the tiny model has no tokenizer)
    runners = benchmarks.peer_runners(args, model, prompts)
    timed = timing.time_generation({("llama.cpp", mode): run for mode, run in runners.items()},
                                   [(prompts[0], 0)], 1, "cpu")
    peer = benchmarks.peer(timed, result)
    # plain and lookup (--draft lookup: no draft model), each in the warm-up pass and one round
    assert (tmp_path / "calls.txt").read_text().count("-p Rewrite this Python function") == 4
    assert peer["plain_vs_plain"] == pytest.approx(15.0 / 30.0, rel=1e-3)  # llama.cpp plain: 15 runs in 0.5 s
    assert peer["best_vs_best"] == pytest.approx(48.0 / 32.0, rel=1e-3)  # its best: lookup
    line = report.peer_line(peer)
    assert line == (f"llama.cpp, {peer['threads']} threads, decode phase: plain 30.0 tok/s, lookup 32.0 tok/s; "
                    "minispec's plain 0.50x its plain, minispec's best mode 1.50x its best")


# --- the server's benchmarks (served.py): a server per configuration ----------------------------------
@pytest.fixture(scope="module")
def served_dirs(tmp_path_factory):
    """A tiny llama whose byte-level BPE tokenizer (ChatML's special tokens, SmolLM2's chat template, as
    test_serve.py's) is trained on the workloads' own text, so that their prompts are a few hundred
    tokens; and a draft: its noisy copy."""
    import transformers
    from test_chat import SMOLLM2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([m["content"] for messages in workloads.WORKLOADS.values() for i in range(6)
                                   for m in messages(i, ["done"] * i)], trainer)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>")
    hf_tokenizer.chat_template = SMOLLM2
    config = transformers.LlamaConfig(vocab_size=len(hf_tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=2048, bos_token_id=0, eos_token_id=2)
    model = spread_init(transformers.LlamaForCausalLM(config).eval(), seed=0, gain=2.0)
    dirs = tmp_path_factory.mktemp("served_target"), tmp_path_factory.mktemp("served_draft")
    for directory, weights in zip(dirs, (model, noisy_copy(model, seed=1, scale=0.05))):
        hf_tokenizer.save_pretrained(directory)
        save_reference(weights, directory)
    return tuple(map(str, dirs))


def in_process(counted=None):
    """served.serving's stand-in: the server's app (as python -m minispec.serve builds it) on a thread of
    this process, one rank whatever `ranks` says; with `counted`, its /health reports that group's state."""
    from test_serve import uvicorn_serving

    from minispec.heads.learn import Learner
    from minispec.loaders import load_models
    from minispec.serve import __main__ as serve_main
    from minispec.serve.app import build_app
    from minispec.serve.scheduler import Scheduler

    @contextmanager
    def serving(flags, ranks=1):
        args = serve_main.parse_args(flags)
        target, draft = load_models(args)
        learner = None if args.learn_head is None else Learner(target, args.draft, args.learn_head)
        scheduler = Scheduler(target, learner.head if learner else draft, args.gamma, args.batch_size,
                              args.max_model_len, args.max_queue, args.tree, args.prefix_cache_mb, learner)
        scheduler.group = counted if ranks > 1 else None
        with uvicorn_serving(build_app(scheduler, args.target, args.draft), scheduler) as (url, _):
            yield url.removeprefix("http://")
    return serving


def test_workloads_serve_each_drafter_with_and_without_the_prefix_cache(served_dirs, tmp_path, capsys, monkeypatch):
    """--workloads: every workload on a server per drafter (none, lookup, suffix, a draft model) and
    prefix-cache setting; at temperature 0 every server answers every request alike; the prefix cache
    holds the agent's resent conversation when on, nothing when off; the table names each comparison."""
    starts = []
    fake = in_process()
    monkeypatch.setattr(workloads, "serving", lambda flags: starts.append(flags) or fake(flags))
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", "suffix", served_dirs[1],
                              "--workloads", "--requests", "2", "--threads", "1")
    drafts = ["none", "lookup", "suffix", served_dirs[1]]
    assert len(starts) == 4 * 4 * 2 and sum("--prefix-cache-mb=0" in flags for flags in starts) == 4 * 4
    assert list(result["workloads"]) == ["agent", "code", "summaries", "chat"]
    for name, w in result["workloads"].items():
        runs = w["runs"]
        assert [(r["draft"], r["prefix_cache"]) for r in runs] == [(d, c) for c in (True, False) for d in drafts]
        plain = runs[0]
        for r in runs:
            assert len(r["requests"]) == len(r["texts"]) == 2 and all(r["texts"])
            assert r["texts"] == plain["texts"] and r["identical_to_plain"] is True, (name, r["draft"])
            assert r["seconds"] == pytest.approx(sum(h["seconds"] for h in r["halves"]))
            assert 0 < r["mean_ttft"] and all(q["ttft"] <= q["seconds"] for q in r["requests"])
            assert (r["ttft_cut"] is None) == (not r["prefix_cache"]) and finite_numbers(r)
            assert r["vs_plain"] == pytest.approx(plain["seconds"] / r["seconds"])
            assert (r["acceptance_rate"] is None) == (r["draft"] == "none")
            if not r["prefix_cache"]:
                assert r["cached_share"] == 0
            elif name in ("agent", "code"):  # turn 2 resends turn 1's conversation, or the file's start
                cached = [q["prompt_tokens_details"]["cached_tokens"] for q in r["requests"]]
                assert r["cached_share"] > 0.3 and cached[1] > cached[0] + 100, cached
        assert w["best"]["draft"] in drafts[1:] and w["ttft_cut"] == runs[0]["ttft_cut"]
        assert 0 < w["ceiling"] < math.inf
    assert ("| workload | draft | prefix cache | s | x plain | x lookup | x plain 1st / 2nd half | mean TTFT ms | "
            "TTFT cut | tok/call 1st / 2nd half | accept | cached | same as plain |") in table
    assert re.search(r"^- agent: best `.+` [\d.]+x plain \(goal ≥ 3.0x: (meets|misses)\), a drafter right about "
                     r"every answer [\d.]+x; the prefix cache cuts plain's mean TTFT [\d.]+x \(goal ≥ 3.0x: "
                     r"(meets|misses)\)$", table, re.M)


def test_the_workloads_ceiling_verifies_each_answer_in_one_forward_after_plains_first_text(monkeypatch):
    """The ceiling: plain's seconds over each request's time to first text plus one forward of its answer's
    tokens at its prompt's length (an untimed forward first)."""
    calls = []

    class Target:
        device = "cpu"

        def ensure_caches(self, rows, length):
            calls.append(("room", rows, length))

        def decode_rows(self, feed, eager):
            calls.append((feed.tokens.shape, feed.lengths, eager))

    monkeypatch.setattr(workloads, "timed", lambda fn, device: (fn(), 0.5))
    plain = {"seconds": 10.0, "requests": [{"ttft": 1.0, "prompt_tokens": 100, "completion_tokens": 8},
                                           {"ttft": 2.0, "prompt_tokens": 300, "completion_tokens": 5}]}
    assert workloads.ceiling(Target(), plain) == 10.0 / (1.5 + 2.5)
    assert calls == [("room", 1, 305), ((1, 5), [300], True), ("room", 1, 108), ((1, 8), [100], True),
                     ("room", 1, 305), ((1, 5), [300], True)]


def test_workloads_serve_a_draft_head_as_it_learns_in_a_pass_of_its_own(served_dirs, tmp_path, capsys, monkeypatch):
    """--workloads --learn-head: a draft head among --draft serves frozen beside the others and, in a pass of
    its own after them, with the server's --learn-head (its learnt head saved into a folder of the bench's);
    both answer as plain does, and the learner's report comes with its row."""
    from minispec.heads import save_draft_head
    from minispec.tools import train_heads

    head_dir = tmp_path / "head"
    save_draft_head(*train_heads.new_head("eagle", minispec.load(served_dirs[0]), 3), head_dir)
    passes = []
    fake = in_process()

    @contextmanager
    def serving(flags):
        passes.append(flags)
        with fake(flags) as address:
            yield address
    monkeypatch.setattr(workloads, "serving", serving)
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", str(head_dir), "--workloads",
                              "code", "--requests", "2", "--threads", "1", "--cache-off", "best", "--learn-head")
    learning = [flags for flags in passes if any(f.startswith("--learn-head=") for f in flags)]
    assert len(passes) == 3 + 2 + 1 and passes[-1] in learning and len(learning) == 1  # the last pass's, alone
    assert f"--draft={head_dir}" in learning[0] and "--prefix-cache-mb=0" not in learning[0]
    runs = result["workloads"]["code"]["runs"]
    assert [r["draft"] for r in runs][-1] == workloads.LEARNING + str(head_dir) and "learning" not in runs[2]
    learnt = runs[-1]
    assert learnt["identical_to_plain"] is True and runs[2]["identical_to_plain"] is True
    assert learnt["learning"]["training_steps"] > 0 and learnt["acceptance_rate"] is not None
    assert "| code | `head, learning` | on |" in table
    with pytest.raises(ValueError, match="--learn-head goes with --workloads"):
        bench_cli.parse_args(["--target", served_dirs[0], "--draft", "lookup", "--learn-head"])


def test_workloads_are_deterministic_and_repeat_themselves():
    """The same requests every time; the agent's conversation grows by each answer and tool result; each
    code edit resends the file as the edit before it left it; summaries share sources; chats never repeat."""
    agent = [workloads.agent(i, ["A"] * i) for i in range(3)]
    assert agent == [workloads.agent(i, ["A"] * i) for i in range(3)]
    assert [len(m) for m in agent] == [2, 4, 6] and agent[2][:4] == agent[1] and agent[2][2]["content"] == "A"
    first, second = (workloads.code(i, [])[0]["content"] for i in range(2))
    assert first.endswith("Rename the function clean_names to clean_names_all. Answer with the whole updated file "
                          "and nothing else.") and "def clean_names(" in first
    assert "def clean_names_all(" in second and "In parse_dates, change the default limit from 10 to 15." in second
    assert second[:second.index("def clean_names")] == first[:first.index("def clean_names")]
    summaries = [workloads.summaries(i, [])[1]["content"] for i in range(2)]
    assert workloads.source(1) in summaries[0] and workloads.source(1) in summaries[1]
    chats = [workloads.chat(i, [])[0]["content"] for i in range(32)]
    assert len(set(chats)) == 32


class Counted:
    """A tensor-parallel group's /health state whose broadcasts grow by the same traffic at each look."""

    def __init__(self):
        self.looks = 0

    @property
    def state(self):
        self.looks += 1
        return {"ranks": 2, "state": "ok", "broadcasts": {"calls": 5 * self.looks, "forwards": 2 * self.looks,
                                                          "seconds": 0.01 * self.looks}}

    def stop(self):
        pass


def test_tp_serve_compares_the_sharded_server_with_one_process(served_dirs, tmp_path, capsys, monkeypatch):
    """--tp-serve: one process, then N (here a stand-in whose /health counts broadcasts), for each
    --clients count: tokens/s, latency percentiles, broadcast time per forward, same greedy output."""
    starts = []
    fake = in_process(Counted())
    monkeypatch.setattr(served, "serving", lambda flags, ranks: starts.append((flags, ranks)) or fake(flags, ranks))
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", "lookup", "--tp-serve", "2",
                              "--clients", "1", "3", "--requests", "2", "--threads", "2")
    assert [ranks for _, ranks in starts] == [1, 2]
    assert "--threads=2" in starts[0][0] and "--threads=1" in starts[1][0] and "--batch-size=3" in starts[0][0]
    runs = result["runs"]
    assert [(r["processes"], r["clients"], r["requests"]) for r in runs] == [(1, 1, 2), (1, 3, 6), (2, 1, 2), (2, 3, 6)]
    for r in runs:
        assert r["tokens_per_second"] > 0 and 0 < r["p50_seconds"] <= r["p99_seconds"] and r["identical_to_one_process"]
        assert ("broadcasts" in r) == (r["processes"] == 2)
    assert runs[2]["broadcasts"] == {"calls": 5, "forwards": 2, "seconds": pytest.approx(0.01)}
    assert runs[2]["broadcast_ms_per_forward"] == pytest.approx(5.0)
    assert ("| processes | clients | requests | tok/s | p50 s | p99 s | broadcast ms/forward | broadcast share | "
            "same as 1 process |") in table


def test_serve_load_compares_the_speculative_server_with_plain_at_each_width(served_dirs, tmp_path, capsys,
                                                                             monkeypatch):
    """--serve-load: per round a fresh server with --draft and one with --draft none, both up at once with a
    batch as wide as the most clients; for each --clients count the two run one after the other, which goes
    first alternating, each run on the prompts after the last run's; per count the median ratio, its range,
    same greedy output."""
    starts, calls, sides = [], [], {}
    fake = in_process()

    @contextmanager
    def serving(flags, ranks=1):
        starts.append(flags)
        with fake(flags, ranks) as address:
            sides[address] = "lookup" if "--draft=lookup" in flags else "none"
            yield address
    monkeypatch.setattr(served, "serving", serving)
    clients_run = served.clients_run
    monkeypatch.setattr(served, "clients_run", lambda address, args, prompts, clients, first=0: calls.append(
        (sides[address], clients, first)) or clients_run(address, args, prompts, clients, first))
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", "lookup", "--serve-load",
                              "--clients", "1", "3", "--requests", "2", "--repeats", "2")
    sides = [("--draft=lookup" in flags, "--draft=none" in flags) for flags in starts]
    assert sides == [(True, False), (False, True)] * 2
    assert all("--batch-size=3" in flags for flags in starts)
    assert [(r["draft"], r["clients"], r["requests"], r["repeat"]) for r in result["runs"]] == [
        (draft, clients, 2 * clients, repeat)
        for repeat in (0, 1) for clients in (1, 3) for draft in ("lookup", "none")]
    assert calls == [("lookup", 1, 0), ("none", 1, 0), ("none", 3, 2), ("lookup", 3, 2),
                     ("none", 1, 0), ("lookup", 1, 0), ("lookup", 3, 2), ("none", 3, 2)]
    for row in result["rows"]:
        assert row["low"] <= row["ratio"] <= row["high"] and row["identical"]
        assert row["low"] <= row["mean_low"] <= row["mean"] <= row["mean_high"] <= row["high"]
    runs = result["runs"]
    ratios = [s["tokens_per_second"] / p["tokens_per_second"] for s, p in zip(runs[0::4], runs[1::4])]
    assert result["rows"][0]["ratio"] == pytest.approx(sum(ratios) / 2)  # the median of two
    assert result["rows"][0]["mean"] == pytest.approx((ratios[0] * ratios[1]) ** 0.5)
    assert [row["clients"] for row in result["rows"]] == [1, 3]
    assert [0 <= row["guessed_share"] <= 1 for row in result["rows"]] == [True, True]
    assert sum(r["guessed_share"] for r in runs if r["draft"] == "lookup") > 0
    assert all(r["guessed_share"] == 0 for r in runs if r["draft"] == "none")
    assert ("| clients | lookup tok/s | none tok/s | x plain | geometric mean (95% interval) | lookup steps guessed "
            "| same output |" in table and "0.98x plain" in table)


def test_the_steps_guessed_are_read_from_auto_histograms_and_a_fixed_gamma():
    def answer(**speculative):
        return served.Answer("", 1.0, 0.1, {}, speculative)
    assert served.guessed_steps(answer(gamma="auto", guesses_histogram=[7, 2, 1], target_calls=10)) == (3, 10)
    assert served.guessed_steps(answer(gamma=2, guesses_histogram=None, target_calls=8)) == (8, 8)
    assert served.guessed_steps(answer(gamma=None, guesses_histogram=None, target_calls=8)) == (0, 8)
    assert served.guessed_steps(answer()) == (0, 0)


def test_features_price_each_feature_plain_and_speculative_against_the_request_without_it(served_dirs, tmp_path,
                                                                                           capsys):
    """--features: every feature of a request (logprobs, penalties, a JSON schema, n, the couplings) timed plain
    and with the draft; each against the same request without it; greedy ones the same output either way."""
    pytest.importorskip("llguidance")
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", "lookup", "--features",
                              "--repeats", "1", "--gamma", "2", "--prompts", "partial")
    rows = {row["feature"]: row for row in result["features"]}
    assert list(rows) == list(benchmarks.FEATURES)
    assert rows["none"]["plain_cost"] == rows["none"]["speculative_cost"] == 1.0
    for name, row in rows.items():
        assert row["plain"] > 0 and row["speculative"] > 0
        assert row["identical"] is (None if "temperature" in benchmarks.FEATURES[name] else True), name
    assert "| feature | plain tok/s | x without it | speculative tok/s | x without it | x plain | same output |" in table


def test_served_percentile_is_the_nearest_rank():
    assert served.percentile([3, 1, 2, 4], 50) == 2 and served.percentile([3, 1, 2, 4], 99) == 4
    assert served.percentile(list(range(1, 201)), 99) == 198
