"""Benchmarks of the server (python -m minispec.serve) as its clients see it, each configuration in a
server process of its own, talked to over HTTP.

--tp-serve N: the target sharded over N processes (`--tp N`, gloo on the CPU) against one process, with
1 and 8 (--clients) concurrent clients each sending --requests requests of the bench's prompts: tokens/s,
p50/p99 request latency, and rank 0's seconds in broadcasting the calls its shards mirror (/health).
--serve-load: the server with --draft against the same server with --draft none, for each --clients count:
whether speculation keeps paying as the batch fills (the goal: at least GOAL_UNDER_LOAD of plain at every width).
"""

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NamedTuple

from minispec.loaders import loads_model

from .prompts import read_prompts
from .report import md_table, yes_no

STARTUP_SECONDS = 600  # loading a large checkpoint (and its quantized copy) takes a while
GOAL_UNDER_LOAD = 0.98  # of the plain server's tokens/s, at every number of clients
MODEL_FLAGS = ("target", "device", "dtype", "quantize", "draft_quantize", "group_size", "threads")


class Answer(NamedTuple):
    """One streamed request as its client saw it: the text, seconds to the end and to the first text,
    the usage and the server's `speculative` field."""
    text: str
    seconds: float
    ttft: float
    usage: dict
    speculative: dict


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_flags(args, draft, *more):
    """The server's flags for the bench's model flags and `draft` (its gamma; its tree only if --tree was given;
    --draft-quantize only if `draft` loads a model)."""
    keys = [key for key in MODEL_FLAGS if getattr(args, key) and (key != "draft_quantize" or loads_model(draft))]
    flags = [f"--{key.replace('_', '-')}={getattr(args, key)}" for key in keys]  # the baselines load no draft
    tree = [f"--tree={args.tree}"] if args.tree else []
    return [*flags, f"--draft={draft}", f"--gamma={args.gamma[0]}", *tree, *(["--compile"] if args.compile else []),
            *map(str, more)]


@contextmanager
def serving(flags, ranks=1):
    """python -m minispec.serve with `flags` on a free port (over `ranks` processes, as torchrun starts
    them); yields its address once /health answers; SIGTERM to rank 0 at the end stops every rank."""
    port, env = free_port(), dict(os.environ)
    if ranks > 1:
        env.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        flags = [*flags, f"--tp={ranks}"]
    command = [sys.executable, "-m", "minispec.serve", *flags, f"--port={port}"]
    with tempfile.TemporaryFile("w+") as log:
        processes = [subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=subprocess.DEVNULL, stderr=log) for rank in range(ranks)]
        address = f"127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + STARTUP_SECONDS
            while health(address) is None:
                if any(p.poll() is not None for p in processes) or time.monotonic() > deadline:
                    log.seek(0)
                    lines = log.read().strip().splitlines() or ["it did not answer"]
                    raise ValueError(f"the server ({' '.join(flags)}) failed to start: {lines[-1]}")
                time.sleep(0.2)
            yield address
        finally:
            processes[0].send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def health(address):
    """The server's /health, or None while it does not answer."""
    try:
        connection = http.client.HTTPConnection(address, timeout=5)
        connection.request("GET", "/health")
        return json.loads(connection.getresponse().read())
    except (OSError, ValueError, http.client.HTTPException):
        return None


def stream(address, path, body):
    """POST `body` to `path`, streamed: the Answer. A refusal or an error event is a ValueError."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start, ttft, text, usage, speculative = time.perf_counter(), None, [], {}, {}
    connection = http.client.HTTPConnection(address, timeout=3600)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise ValueError(f"the server refused a request ({response.status}): {response.read()[:300]!r}")
    for line in response:
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise ValueError(f"a request failed: {chunk['error']['message']}")
        for choice in chunk["choices"]:
            piece = choice.get("text") or choice.get("delta", {}).get("content")
            if piece:
                ttft = time.perf_counter() - start if ttft is None else ttft
                text.append(piece)
        usage = chunk.get("usage") or usage
        speculative = chunk.get("speculative", speculative)
    seconds = time.perf_counter() - start
    return Answer("".join(text), seconds, seconds if ttft is None else ttft, usage, speculative)


def sampling_fields(args):
    """The request's fields for the bench's settings."""
    return {"max_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
            "top_p": args.top_p, "seed": args.seed, "ignore_eos": args.ignore_eos}


def percentile(values, q):
    """The nearest-rank percentile (the largest value for p99 of fewer than 100)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def tp_serve_benchmark(args):
    """Tokens/s and latency of 1 and --tp-serve processes for each --clients count; broadcast time."""
    prompts = read_prompts(args)
    runs = []
    for ranks in (1, args.tp_serve):
        threads = args.threads or len(os.sched_getaffinity(0))
        flags = server_flags(args, args.draft, f"--batch-size={max(args.clients)}")
        flags = [f for f in flags if not f.startswith("--threads=")] + [f"--threads={max(threads // ranks, 1)}"]
        with serving(flags, ranks) as address:
            hello = {"prompt": "Hello", "max_tokens": 4, "temperature": 0}
            stream(address, "/v1/completions", hello)  # the first call's setup is not the benchmark's
            runs += [clients_run(address, args, prompts, ranks, clients) for clients in args.clients]
    for run in runs:
        alone = next(r for r in runs if r["processes"] == 1 and r["clients"] == run["clients"])
        run["identical_to_one_process"] = run["texts"] == alone["texts"] if args.temperature == 0 else None
    result = {"settings": {**vars(args), "prompts": len(prompts)}, "runs": runs}
    return result, tp_serve_table(args, runs)


def serve_load_benchmark(args):
    """Tokens/s of the server with --draft and with --draft none (a batch as wide as the most --clients), per
    --clients count."""
    prompts, runs = read_prompts(args), []
    for draft in (args.draft, "none"):
        with serving(server_flags(args, draft, f"--batch-size={max(args.clients)}")) as address:
            stream(address, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})  # setup
            runs += [dict(clients_run(address, args, prompts, 1, clients), draft=draft) for clients in args.clients]
    rows = []
    for clients in args.clients:
        spec, plain = (next(r for r in runs if r["clients"] == clients and r["draft"] == d) for d in (args.draft, "none"))
        rows.append({"clients": clients, "speculative": spec["tokens_per_second"], "plain": plain["tokens_per_second"],
                     "ratio": spec["tokens_per_second"] / plain["tokens_per_second"],
                     "identical": spec["texts"] == plain["texts"] if args.temperature == 0 else None})
    lines = [f"target `{args.target}`, the server with --draft {args.draft} against --draft none, --batch-size "
             f"{max(args.clients)}, {args.max_new_tokens} new tokens a request, --requests {args.requests} per client", ""]
    lines += md_table(["clients", f"{args.draft} tok/s", "none tok/s", "x plain", "same output"],
                      ([r["clients"], f"{r['speculative']:.1f}", f"{r['plain']:.1f}", f"{r['ratio']:.2f}x",
                        yes_no(r["identical"])] for r in rows))
    lines += ["", f"the goal: at least {GOAL_UNDER_LOAD}x plain at every number of clients"]
    return {"settings": {**vars(args), "prompts": len(prompts)}, "rows": rows, "runs": runs}, "\n".join(lines)


def clients_run(address, args, prompts, ranks, clients):
    """`clients` threads, each sending --requests requests one after another (the prompts in turn)."""
    before = (health(address).get("tp") or {}).get("broadcasts")
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda i: stream(address, "/v1/completions", {
            "prompt": prompts[i % len(prompts)], **sampling_fields(args)}), range(clients * args.requests)))
    wall = time.perf_counter() - start
    after = (health(address).get("tp") or {}).get("broadcasts")
    latency = [a.seconds for a in answers]
    run = {"processes": ranks, "clients": clients, "requests": len(answers), "seconds": wall,
           "tokens_per_second": sum(a.usage["completion_tokens"] for a in answers) / wall,
           "p50_seconds": percentile(latency, 50), "p99_seconds": percentile(latency, 99),
           "texts": [a.text for a in answers]}
    if after is not None:
        traffic = {key: after[key] - before[key] for key in after}
        run.update(broadcasts=traffic, broadcast_ms_per_forward=traffic["seconds"] * 1e3 / max(traffic["forwards"], 1),
                   broadcast_share=traffic["seconds"] / wall)
    return run


def tp_serve_table(args, runs):
    lines = [f"target `{args.target}`, draft `{args.draft}`, {args.max_new_tokens} new tokens a request, "
             f"--requests {args.requests} per client; the server over 1 and {args.tp_serve} processes", ""]
    rows = ([r["processes"], r["clients"], r["requests"], f"{r['tokens_per_second']:.1f}", f"{r['p50_seconds']:.2f}",
             f"{r['p99_seconds']:.2f}",
             f"{r['broadcast_ms_per_forward']:.2f}" if "broadcasts" in r else "-",
             f"{r['broadcast_share']:.1%}" if "broadcasts" in r else "-", yes_no(r["identical_to_one_process"])]
            for r in runs)
    lines += md_table(["processes", "clients", "requests", "tok/s", "p50 s", "p99 s", "broadcast ms/forward",
                       "broadcast share", "same as 1 process"], rows)
    lines += ["", "broadcast: rank 0's seconds sending the calls the other ranks mirror (serve/group.py), per sharded "
              "forward and as a share of the wall time; the sums inside a forward: python -m minispec.tools.bench.tp"]
    return "\n".join(lines)
