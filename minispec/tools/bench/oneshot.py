"""Requests each in a fresh process, as users of run.py make them: nothing a process learnt helps the next
but what it left on disk (gamma="auto"'s costs: decoding/profiles.py). --one-shot: plain and each --gamma
per prompt, the auto runs from a profiles folder made empty for the bench; --threads-under-load: the default
threads and each --threads setting beside a busy core (OpenMP reads its wait policy when a process starts)."""

import json
import os
import statistics
import signal
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from minispec import generate
from minispec.decoding.drafters import SELF_DRAFT_MODES, make_drafter
from minispec.loaders import load_models
from minispec.loading.chat import chat_prompt

from . import llamacpp
from .benchmarks import decoding_settings
from .prompts import prompt_ids_of, read_prompts
from .report import md_table, progress, title

SETTINGS = ("target", "device", "dtype", "compile", "quantize", "draft_quantize", "group_size", "threads", "chat",
            "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "beams", "draft_beams")
GOAL = 0.8  # --threads-under-load: the default's tokens/s against the best setting's
CALL_GOAL = 1.3  # --one-shot --llama-cpp: a plain call's wall time against llama-completion's, at most
RUN_SECONDS = 1800  # one request's process, load included: past this it is hung


def run_request(spec):
    """In the fresh process: load, generate once; what the bench reads back."""
    start = time.perf_counter()
    target, draft = load_models(Namespace(**{**spec, "draft": spec["draft"] or "none",
                                             "draft_quantize": spec["draft_quantize"] if spec["draft"] else None}))
    if draft in SELF_DRAFT_MODES:  # the target's quantized copy is made once per target: part of loading
        make_drafter(draft, target)
    loaded, start = time.perf_counter() - start, time.perf_counter()
    search = dict(beams=spec["beams"], draft_beams=spec["draft_beams"] if spec["draft"] else None) \
        if spec["beams"] else {}
    out = generate(target, prompt_ids_of(target, spec["prompt"], spec["chat"]), draft=draft,
                   gamma=spec["gamma"] or "auto", seed=spec["seed"], **decoding_settings(Namespace(**spec)), **search)
    # the prompt as llama.cpp reads it: a chat turn spelled out, its markers the special tokens they are
    text = target.tokenizer.decode(chat_prompt(target.tokenizer, spec["prompt"])) if spec["chat"] and \
        isinstance(spec["prompt"], str) else spec["prompt"]
    return {"load_seconds": loaded, "seconds": time.perf_counter() - start, "tokens": out.tokens,
            "guesses_histogram": out.stats.get("guesses_histogram"), "text": text}


# Forked from this small process, the command's own peak is its ru_maxrss: a child spawned from the bench
# itself would count the bench's resident memory too (Linux keeps the forked image's peak across exec).
MEASURE = """import json, os, sys, time
start = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as report:
    json.dump([os.waitstatus_to_exitcode(status), time.perf_counter() - start, usage.ru_maxrss], report)
"""


def run_measured(command, env=None, timeout=RUN_SECONDS):
    """(exit status, stdout, stderr, wall seconds, peak resident MiB) of a command in a fresh process, as a
    user's shell would see it: startup, imports and load included."""
    with tempfile.TemporaryDirectory() as folder:
        files = [os.path.join(folder, name) for name in ("out", "err", "report")]
        with open(files[0], "wb") as out, open(files[1], "wb") as err:
            process = subprocess.Popen([sys.executable, "-c", MEASURE, files[2], *command], env=env, stdout=out,
                                       stderr=err, start_new_session=True)  # a group: a timeout ends the command too
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                raise ValueError(f"{command[0]} took more than {timeout} s for one request") from None
        text = [Path(name).read_text(errors="replace") for name in files[:2]]
        if process.returncode:
            return process.returncode, *text, None, None
        with open(files[2]) as report:
            code, wall, peak = json.load(report)
    return code, *text, wall, peak / 1024  # Linux counts ru_maxrss in KiB


def in_fresh_process(spec, env):
    code, out, err, wall, peak = run_measured([sys.executable, "-m", "minispec.tools.bench.oneshot",
                                               json.dumps(spec)], env)
    if code:
        lines = err.strip().splitlines() or [f"exit status {code}"]
        raise ValueError(f"a one-shot run failed: {lines[-1]}")
    return {**json.loads(out), "wall_seconds": wall, "peak_mib": peak}


def llama_completion(args, program, text):
    """llama.cpp's plain decoding of the same prompt, as one call of its own program: its wall and peak."""
    arguments = llamacpp.common_arguments(args.target, args.max_new_tokens, torch.get_num_threads(), args.seed,
                                          args.ignore_eos)
    code, out, err, wall, peak = run_measured([str(program), *arguments, *llamacpp.PLAIN, "-p", text])
    if code:
        last = (out + err).strip().splitlines()[-1:] or ["no output"]
        raise ValueError(f"{program} failed (exit {code}): {last[0]}")
    return {"wall_seconds": wall, "peak_mib": peak}


def fresh_rounds(args, configs, env, what, peer=None):
    """{(config, prompt index): a run per round}: each prompt in a fresh process with each config's
    settings in turn, round after round, so that a slow phase of the machine hits all alike; peer(text of
    the first config's prompt), where given, runs after them as config "llama.cpp"."""
    prompts = read_prompts(args)
    names = [*configs, *(["llama.cpp"] if peer else [])]
    runs = {(name, i): [] for name in names for i in range(len(prompts))}
    with progress(len(runs) * args.repeats, what) as bar:
        for _ in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for name, config in configs.items():
                    spec = {**{key: getattr(args, key) for key in SETTINGS}, "prompt": prompt, **config}
                    runs[name, i].append(in_fresh_process(spec, env))
                    bar.update(1)
                if peer:
                    runs["llama.cpp", i].append(peer(runs[next(iter(configs)), i][-1]["text"]))
                    bar.update(1)
    return runs


def one_shot_benchmark(args):
    """Every request in a fresh process, plain against each --gamma (with --beams: beam search), per prompt."""
    configs = {"plain": dict(draft=None, gamma=None), **{str(g): dict(draft=args.draft, gamma=g) for g in args.gamma}}
    peer = None
    if args.llama_cpp is not None:
        program = llamacpp.find_programs(args.llama_cpp)["plain"]
        peer = partial(llama_completion, args, program)
    with tempfile.TemporaryDirectory() as profiles:
        runs = fresh_rounds(args, configs, dict(os.environ, MINISPEC_PROFILES=profiles), "one-shot", peer)
    rows = []
    for i in range(len(read_prompts(args))):
        plain = runs["plain", i]
        row = {"prompt": i + 1, "plain_seconds": statistics.median(r["seconds"] for r in plain),
               "load_seconds": statistics.median(r["load_seconds"] for r in plain),
               "wall_seconds": statistics.median(r["wall_seconds"] for r in plain),
               "peak_mib": max(r["peak_mib"] for r in plain), "configs": {}}
        if peer:
            row["llama_cpp"] = {"wall_seconds": statistics.median(r["wall_seconds"] for r in runs["llama.cpp", i]),
                                "peak_mib": max(r["peak_mib"] for r in runs["llama.cpp", i])}
        for name in list(configs)[1:]:
            done = runs[name, i]
            later = [r["seconds"] for r in done[1:]]  # auto's first run starts from nothing, later ones from it
            row["configs"][name] = {
                "seconds": statistics.median(r["seconds"] for r in done), "first_seconds": done[0]["seconds"],
                "later_seconds": statistics.median(later) if later else None,
                "guesses_histograms": [r["guesses_histogram"] for r in done],
                "identical": all(r["tokens"] == plain[0]["tokens"] for r in done + plain)
                if args.temperature == 0 else None}
        rows.append(row)
    search = [f"beam search of width {args.beams}"] if args.beams else []
    lines = [title(args, None, *search, f"each request in a fresh process, {args.repeats} rounds: seconds of the "
                   "request (median; for auto, the first run and the median of the later ones) and x plain"), ""]
    peer_columns = [("llama.cpp wall s", lambda row: f"{row['llama_cpp']['wall_seconds']:.2f}"),
                    ("llama.cpp MiB", lambda row: f"{row['llama_cpp']['peak_mib']:.0f}"),
                    ("x llama.cpp", lambda row: f"{row['wall_seconds'] / row['llama_cpp']['wall_seconds']:.2f}")]
    lines += md_table([("prompt", "{prompt}"), ("load s", "{load_seconds:.2f}"), ("plain s", "{plain_seconds:.2f}"),
                       ("plain wall s", "{wall_seconds:.2f}"), ("peak MiB", "{peak_mib:.0f}"),
                       *(peer_columns if peer else []),
                       *((f"γ = {name}", lambda row, name=name: config_cell(name, row)) for name in list(configs)[1:]),
                       ("same output", lambda row: None if args.temperature else
                        all(c["identical"] for c in row["configs"].values()))], rows)
    result = {"settings": vars(args), "one_shot": rows}
    if peer:  # the figure: a user's call (process start to exit) against llama-completion's
        ratio = statistics.geometric_mean(row["wall_seconds"] / row["llama_cpp"]["wall_seconds"] for row in rows)
        result["wall_over_llama_cpp"] = ratio
        lines += ["", f"plain call, wall time: {ratio:.2f}x llama-completion's (geometric mean over the prompts; "
                      f"{'meets' if ratio <= CALL_GOAL else 'misses'} the goal of at most {CALL_GOAL}x)"]
    return result, "\n".join(lines)


def config_cell(name, row):
    config, plain = row["configs"][name], row["plain_seconds"]
    if name == "auto" and config["later_seconds"] is not None:
        return (f"first {config['first_seconds']:.2f} ({plain / config['first_seconds']:.2f}x), "
                f"later {config['later_seconds']:.2f} ({plain / config['later_seconds']:.2f}x)")
    return f"{config['seconds']:.2f} ({plain / config['seconds']:.2f}x)"


@contextmanager
def one_core_busy():
    """Another process spinning on this process's last CPU, for the duration."""
    cpu = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nprint(flush=True)\nwhile True:\n    pass"
    process = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
    process.stdout.readline()  # spinning from now on: the first run is timed beside it too
    try:
        yield cpu
    finally:
        process.kill()
        process.wait()


def threads_benchmark(args):
    """Tokens/s with the default threads and each --threads setting while another process keeps one core
    busy, each request in a fresh process (the goal: the default at least 0.8x the best setting's)."""
    cpus = len(os.sched_getaffinity(0))
    configs = {name: dict(draft=args.draft, gamma=args.gamma[0], threads=threads)
               for name, threads in {"default": None, **{str(n): n for n in range(1, cpus + 1)}}.items()}
    env = dict(os.environ)
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):  # the default as a user gets it: minispec's choice
        env.pop(name, None)
    with one_core_busy():
        runs = fresh_rounds(args, configs, env, "threads")

    def rate(name, r):  # round r's tokens/s over the prompts
        done = [runs[key][r] for key in runs if key[0] == name]
        return sum(len(d["tokens"]) for d in done) / sum(d["seconds"] for d in done)

    rates = {name: [rate(name, r) for r in range(args.repeats)] for name in configs}
    medians = {name: statistics.median(r) for name, r in rates.items()}
    best = max(medians[str(n)] for n in range(1, cpus + 1))
    result = {"settings": vars(args), "cpus": cpus, "tokens_per_second": medians, "repeats": rates,
              "default_over_best": medians["default"] / best, "goal": GOAL}
    lines = [title(args, None, f"γ = {args.gamma[0]}", f"one of {cpus} CPUs held by a spinning process, each "
                   f"request in a fresh process, median of {args.repeats} rounds"), ""]
    lines += md_table([("threads", "{threads}"), ("tok/s", "{rate:.1f}"), ("x best", "{x_best:.2f}")],
                      [{"threads": name, "rate": rate, "x_best": rate / best} for name, rate in medians.items()])
    verdict = "meets" if result["default_over_best"] >= GOAL else "misses"
    lines += ["", f"default: {result['default_over_best']:.2f}x the best setting ({verdict} the goal of {GOAL}x)"]
    return result, "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run_request(json.loads(sys.argv[1]))))
