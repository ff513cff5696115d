"""What the served workloads decided (python -m minispec.tools.bench --workloads; the figures in
docs/results.md): the server drafts with `suffix` when no draft is given, which matched or beat `lookup`
on the agent loop, the code edits and novel chat."""

import re
from contextlib import contextmanager

from test_bench import in_process, run_bench, served_dirs  # noqa: F401 (served_dirs: a fixture)

from minispec.serve.__main__ import parse_args
from minispec.tools.bench import workloads
from minispec.tools.bench.cli import parse_args as bench_args
from minispec.tools.bench.served import server_flags
from minispec.tools.bench.workloads import SOURCES, source, summaries


def test_the_server_drafts_with_suffix_by_default():
    assert parse_args(["--target", "any"]).draft == "suffix"
    assert parse_args(["--target", "any", "--draft", "lookup"]).draft == "lookup"


def test_summaries_quote_documents_that_recur_across_the_traffic():
    """Each request a question over documents retrieved from one pool (verbatim, with the figures to
    quote); a follow-up (every other request) starts with the documents of the one before (a prefix the
    cache keeps); every document of the pool comes back within the traffic."""
    requests = [summaries(i, []) for i in range(12)]
    assert requests == [summaries(i, []) for i in range(12)] and len({r[1]["content"] for r in requests}) == 12
    assert all(r[0] == requests[0][0] and "verbatim" in r[0]["content"] for r in requests)
    retrieved = [[k for k in range(SOURCES) if source(k) in r[1]["content"]] for r in requests]
    assert all(len(picks) >= 2 for picks in retrieved) and set().union(*retrieved) == set(range(SOURCES))
    for i in range(0, 12, 2):
        top = "\n\n".join(requests[i][1]["content"].split("\n\n")[:2])
        assert requests[i + 1][1]["content"].startswith(top) and len(top) > 400, i
    assert sum(source(5) in r[1]["content"] for r in requests) >= 3  # a document the drafter has seen before
    assert re.search(r"revenue of 120 million euros", source(0)) and "by 21 votes to 4" in source(1)
    assert "(issue #426)" in source(2)


def test_summaries_served_on_a_tiny_model_cache_off_for_plain_and_the_best(served_dirs, tmp_path, capsys,
                                                                         monkeypatch):
    """--workloads summaries --cache-off best: each drafter with the prefix cache on, then only plain and
    the fastest of them with it off; at temperature 0 every server answers alike; the cache holds the
    system prompt and the shared first document. The servers of a pass are up at once and take each
    request in turn, the first server rotating, so that the machine's slower minutes fall on all alike."""
    starts, calls, up, stream = [], [], {}, workloads.stream
    fake = in_process()

    @contextmanager
    def serving(flags):  # the servers up now by address, each as its start's index (a port may come back)
        starts.append(flags)
        with fake(flags) as address:
            up[address] = len(starts) - 1
            yield address

    monkeypatch.setattr(workloads, "serving", serving)
    monkeypatch.setattr(workloads, "stream", lambda address, *rest: calls.append(up[address]) or stream(address, *rest))
    result, table = run_bench(tmp_path, capsys, "--target", served_dirs[0], "--draft", "suffix", "--workloads",
                              "summaries", "--requests", "4", "--threads", "1", "--cache-off", "best")
    runs = result["workloads"]["summaries"]["runs"]
    best = min(runs[1:3], key=lambda r: r["seconds"])["draft"]
    assert [(r["draft"], r["prefix_cache"]) for r in runs] == [("none", True), ("lookup", True), ("suffix", True),
                                                               ("none", False), (best, False)]
    assert len(starts) == 5 and sum("--prefix-cache-mb=0" in flags for flags in starts) == 2
    assert all(r["texts"] == runs[0]["texts"] and r["identical_to_plain"] for r in runs)
    assert all(r["cached_share"] > 0.3 for r in runs[:3]) and runs[3]["cached_share"] == 0
    assert runs[0]["ttft_cut"] is not None and [r["ttft_cut"] is None for r in runs[1:3]] == [best != "lookup",
                                                                                               best != "suffix"]
    assert (runs[4]["vs_lookup"] is None) == (best == "suffix")
    assert "| summaries | `none` | off |" in table
    # the first pass: the three drafters and plain without the cache, each said hello; then the fifth alone
    assert calls[:4] == [0, 1, 2, 3] and calls[4:20] == [(i + k) % 4 for i in range(4) for k in range(4)]
    assert calls[20:] == [4] * 5


def test_the_bench_quantizes_only_drafts_that_load_a_model():
    """--draft-quantize goes to the servers whose draft loads a model (alone or beside a cheap drafter):
    the server refuses it with none, lookup or suffix, the baselines every workload runs."""
    args = bench_args(["--target", "t", "--draft", "suffix", "d", "d,suffix", "--workloads", "--quantize", "int4",
                       "--draft-quantize", "int4"])
    quantized = {draft: "--draft-quantize=int4" in server_flags(args, draft)
                 for draft in ("none", "lookup", "suffix", "d", "d,suffix")}
    assert quantized == {"none": False, "lookup": False, "suffix": False, "d": True, "d,suffix": True}
    assert all("--quantize=int4" in server_flags(args, draft) for draft in quantized)
    assert workloads.label("/models/m.gguf,suffix") == "m.gguf,suffix" and workloads.label("none") == "none"
    # servers up at once each hold a KV cache for their context: --max-model-len goes to every one, if given
    assert not any(flag.startswith("--max-model-len") for flag in server_flags(args, "none"))
    args = bench_args(["--target", "t", "--draft", "suffix", "--workloads", "--max-model-len", "4096"])
    assert "--max-model-len=4096" in server_flags(args, "suffix")
