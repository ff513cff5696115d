"""The server (python -m minispec.serve) as its clients see it, each configuration a server process of its
own talked to over HTTP: --tp-serve N (the target over N processes, `--tp N`, against one: tokens/s, p50/p99
latency, rank 0's broadcast time) and --serve-load (--draft against --draft none as the batch fills)."""

import http.client
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import NamedTuple

from minispec.loaders import loads_model

from .prompts import read_prompts
from .report import md_table, title

STARTUP_SECONDS = 600  # loading a large checkpoint (and its quantized copy) takes a while
GOAL_UNDER_LOAD = 0.98  # of the plain server's tokens/s, at every number of clients
RESAMPLES = 10_000  # bootstrap resamples of the rounds for the geometric mean's 95% interval
MODEL_FLAGS = ("target", "device", "dtype", "quantize", "draft_quantize", "group_size", "threads", "max_model_len")


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
    return [*(f"--{key.replace('_', '-')}={getattr(args, key)}" for key in keys), f"--draft={draft}",
            f"--gamma={args.gamma[0]}", *([f"--tree={args.tree}"] if args.tree else []),
            *(["--compile"] if args.compile else []), *more]


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


def request(address, args, prompt):
    """One streamed request for `prompt`: a chat's user message with --chat (text prompts only)."""
    if args.chat and isinstance(prompt, str):
        return stream(address, "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": prompt}], **sampling_fields(args)})
    return stream(address, "/v1/completions", {"prompt": prompt, **sampling_fields(args)})


def percentile(values, q):
    """The nearest-rank percentile (the largest value for p99 of fewer than 100)."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def tp_serve_benchmark(args):
    """The server over N processes (--tp N) against one, for each --clients count."""
    prompts, runs = read_prompts(args), []
    threads = args.threads or len(os.sched_getaffinity(0))
    for ranks in (1, args.tp_serve):  # a batch as wide as the most clients; each process its share of the threads
        flags = [flag for flag in server_flags(args, args.draft, f"--batch-size={max(args.clients)}")
                 if not flag.startswith("--threads=")]
        with serving([*flags, f"--threads={max(threads // ranks, 1)}"], ranks) as address:
            stream(address, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})  # setup
            runs += [dict(clients_run(address, args, prompts, clients), processes=ranks, draft=args.draft)
                     for clients in args.clients]
    for i, run in enumerate(runs):  # one process's runs first, one per --clients count
        alone = runs[i % len(args.clients)]
        run["identical_to_one_process"] = run["texts"] == alone["texts"] if args.temperature == 0 else None
    lines = [title(args, None, f"--requests {args.requests} per client; the server over 1 and {args.tp_serve} "
                   "processes"), ""]
    lines += md_table([("processes", "{processes}"), ("clients", "{clients}"), ("requests", "{requests}"),
                       ("tok/s", "{tokens_per_second:.1f}"), ("p50 s", "{p50_seconds:.2f}"),
                       ("p99 s", "{p99_seconds:.2f}"), ("broadcast ms/forward", "{broadcast_ms_per_forward:.2f}"),
                       ("broadcast share", "{broadcast_share:.1%}"),
                       ("same as 1 process", "{identical_to_one_process}")], runs)
    lines += ["", "broadcast: rank 0's seconds sending the calls the other ranks mirror (serve/group.py), per sharded "
              "forward and as a share of the wall time; the sums inside a forward: python -m minispec.tools.bench.tp"]
    return {"settings": {**vars(args), "prompts": len(prompts)}, "runs": runs}, "\n".join(lines)


def serve_load_benchmark(args):
    """The server with --draft against --draft none, for each --clients count: --repeats rounds, each on a
    fresh pair of servers both up at once, the two sides interleaved (which goes first alternates), so that
    a slower minute of the machine falls on both; the median ratio and its range."""
    n, runs, prompts = len(args.clients), [], read_prompts(args)
    for repeat in range(args.repeats):
        flags = [server_flags(args, draft, f"--batch-size={max(args.clients)}") for draft in (args.draft, "none")]
        with serving(flags[0]) as speculative, serving(flags[1]) as plain:
            addresses = {args.draft: speculative, "none": plain}
            for address in addresses.values():
                stream(address, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 0})  # setup
            sent = 0  # each run's prompts follow the last run's: a server's drafter never saw them
            for i, clients in enumerate(args.clients):
                order = [args.draft, "none"][::1 if (repeat + i) % 2 == 0 else -1]
                done = {draft: dict(clients_run(addresses[draft], args, prompts, clients, sent),
                                    processes=1, draft=draft, repeat=repeat) for draft in order}
                runs += [done[args.draft], done["none"]]
                sent += clients * args.requests
    rows = [load_row(clients, runs[2 * i::2 * n], runs[2 * i + 1::2 * n], args)
            for i, clients in enumerate(args.clients)]
    lines = [title(args, None, f"the server against --draft none, --batch-size {max(args.clients)}, --requests "
                   f"{args.requests} per client, {args.repeats} rounds of fresh servers (median, range; the rounds' "
                   "geometric mean and its bootstrap interval)"), ""]
    lines += md_table([("clients", "{clients}"), (f"{args.draft} tok/s", "{speculative:.1f}"),
                       ("none tok/s", "{plain:.1f}"), ("x plain", "{ratio:.2f}x ({low:.2f}-{high:.2f})"),
                       ("geometric mean (95% interval)", "{mean:.3f}x ({mean_low:.3f}-{mean_high:.3f})"),
                       (f"{args.draft} steps guessed", "{guessed_share:.1%}"),
                       ("same output", "{identical}")], rows)
    lines += ["", f"the goal: at least {GOAL_UNDER_LOAD}x plain at every number of clients"]
    settings = {**vars(args), "prompts": len(prompts)}
    return {"settings": settings, "runs": runs, "rows": rows}, "\n".join(lines)


def load_row(clients, speculative, plain, args):
    """One --clients count's row over the rounds: median tokens/s of each side, the median ratio and range, the
    geometric mean ratio and its interval, and the share of the speculative side's steps that guessed."""
    ratios = sorted(s["tokens_per_second"] / p["tokens_per_second"] for s, p in zip(speculative, plain))
    mean, (below, above) = statistics.geometric_mean(ratios), interval(ratios)
    return {"clients": clients, "speculative": statistics.median(s["tokens_per_second"] for s in speculative),
            "guessed_share": statistics.fmean(s["guessed_share"] for s in speculative),
            "plain": statistics.median(p["tokens_per_second"] for p in plain), "ratio": statistics.median(ratios),
            "low": ratios[0], "high": ratios[-1], "mean": mean, "mean_low": below, "mean_high": above,
            "identical": all(s["texts"] == p["texts"] for s, p in zip(speculative, plain))
            if args.temperature == 0 else None}


def interval(ratios):
    """A 95% bootstrap interval of the rounds' geometric mean ratio: a round's two servers differ by more
    than the engines do on a shared machine, so only many rounds tell a 2% loss from noise."""
    draw = random.Random(0)
    means = sorted(statistics.geometric_mean(draw.choices(ratios, k=len(ratios))) for _ in range(RESAMPLES))
    return means[int(0.025 * RESAMPLES)], means[int(0.975 * RESAMPLES) - 1]


def guessed_steps(answer):
    """(the steps that asked for guesses, all steps) of one answer: gamma="auto"'s histogram of k, else every
    step under a fixed gamma and none without a draft."""
    speculative = answer.speculative
    histogram = speculative.get("guesses_histogram")
    if histogram:
        return sum(histogram[1:]), sum(histogram)
    steps = speculative.get("target_calls", 0)
    return (steps if isinstance(speculative.get("gamma"), int) and speculative["gamma"] > 0 else 0), steps


def clients_run(address, args, prompts, clients, first=0):
    """`clients` threads, each sending --requests requests one after another (the prompts in turn from
    `first`; with --chat as a user's message)."""
    before = (health(address).get("tp") or {}).get("broadcasts")
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        answers = list(pool.map(lambda i: request(address, args, prompts[(first + i) % len(prompts)]),
                                range(clients * args.requests)))
    wall = time.perf_counter() - start
    after = (health(address).get("tp") or {}).get("broadcasts")
    latency = [a.seconds for a in answers]
    counts = [guessed_steps(answer) for answer in answers]
    guessed, steps = sum(g for g, _ in counts), sum(n for _, n in counts)
    run = {"clients": clients, "requests": len(answers), "seconds": wall,
           "guessed_share": guessed / steps if steps else 0.0,
           "tokens_per_second": sum(a.usage["completion_tokens"] for a in answers) / wall,
           "p50_seconds": percentile(latency, 50), "p99_seconds": percentile(latency, 99),
           "texts": [a.text for a in answers]}
    if after is not None:
        traffic = {key: after[key] - before[key] for key in after}
        run.update(broadcasts=traffic, broadcast_ms_per_forward=traffic["seconds"] * 1e3 / max(traffic["forwards"], 1),
                   broadcast_share=traffic["seconds"] / wall)
    return run
