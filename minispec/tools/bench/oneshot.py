"""Requests each in a fresh process, as users of run.py make them: nothing a process learnt helps the next
but what it left on disk (gamma="auto"'s costs: decoding/profiles.py). --one-shot: plain and each --gamma
per prompt, the auto runs from a profiles folder made empty for the bench; --threads-under-load: the default
threads and each --threads setting beside a busy core (OpenMP reads its wait policy when a process starts)."""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from contextlib import contextmanager

from minispec import generate
from minispec.decoding.drafters import SELF_DRAFT_MODES, make_drafter
from minispec.loaders import load_models

from .benchmarks import decoding_settings
from .prompts import prompt_ids_of, read_prompts
from .report import md_table, progress, title

SETTINGS = ("target", "device", "dtype", "compile", "quantize", "draft_quantize", "group_size", "threads", "chat",
            "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "beams", "draft_beams")
GOAL = 0.8  # --threads-under-load: the default's tokens/s against the best setting's


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
    return {"load_seconds": loaded, "seconds": time.perf_counter() - start, "tokens": out.tokens,
            "guesses_histogram": out.stats.get("guesses_histogram")}


def in_fresh_process(spec, env):
    done = subprocess.run([sys.executable, "-m", "minispec.tools.bench.oneshot", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(f"a one-shot run failed: {lines[-1]}")
    return json.loads(done.stdout)


def fresh_rounds(args, configs, env, what):
    """{(config, prompt index): a run per round}: each prompt in a fresh process with each config's
    settings in turn, round after round, so that a slow phase of the machine hits all alike."""
    prompts = read_prompts(args)
    runs = {(name, i): [] for name in configs for i in range(len(prompts))}
    with progress(len(runs) * args.repeats, what) as bar:
        for _ in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for name, config in configs.items():
                    spec = {**{key: getattr(args, key) for key in SETTINGS}, "prompt": prompt, **config}
                    runs[name, i].append(in_fresh_process(spec, env))
                    bar.update(1)
    return runs


def one_shot_benchmark(args):
    """Every request in a fresh process, plain against each --gamma (with --beams: beam search), per prompt."""
    configs = {"plain": dict(draft=None, gamma=None), **{str(g): dict(draft=args.draft, gamma=g) for g in args.gamma}}
    with tempfile.TemporaryDirectory() as profiles:
        runs = fresh_rounds(args, configs, dict(os.environ, MINISPEC_PROFILES=profiles), "one-shot")
    rows = []
    for i in range(len(runs) // len(configs)):
        plain = runs["plain", i]
        row = {"prompt": i + 1, "plain_seconds": statistics.median(r["seconds"] for r in plain),
               "load_seconds": statistics.median(r["load_seconds"] for r in plain), "configs": {}}
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
    lines += md_table([("prompt", "{prompt}"), ("load s", "{load_seconds:.2f}"), ("plain s", "{plain_seconds:.2f}"),
                       *((f"γ = {name}", lambda row, name=name: config_cell(name, row)) for name in list(configs)[1:]),
                       ("same output", lambda row: None if args.temperature else
                        all(c["identical"] for c in row["configs"].values()))], rows)
    return {"settings": vars(args), "one_shot": rows}, "\n".join(lines)


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
