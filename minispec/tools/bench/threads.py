"""Threads on a shared machine: decoding's tokens/s with the default number of threads and with each
--threads setting, while another process keeps one core busy (pinned to it, spinning). Each request
runs in a fresh process, as run.py's do (OpenMP reads its wait policy, and torch sizes its thread
pool, when a process starts); settings take turns, round after round. The goal: the default at least
GOAL of the best setting, where OpenMP's spinning threads once made it 10-20x slower.

    python -m minispec.tools.bench --threads-under-load --target T --draft D
"""

import os
import statistics
import subprocess
import sys
from contextlib import contextmanager

from .oneshot import SETTINGS, in_fresh_process
from .prompts import read_prompts
from .report import progress

GOAL = 0.8  # the default's tokens/s against the best setting's


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
    """Tokens/s of the default and of each --threads setting, one core busy, per round; medians."""
    cpus = len(os.sched_getaffinity(0))
    settings = {"default": None, **{str(n): n for n in range(1, cpus + 1)}}
    prompts = read_prompts(args)
    rates = {name: [] for name in settings}
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)  # the default as a user gets it: minispec's choice
    with one_core_busy(), progress(args.repeats * len(settings) * len(prompts), "threads") as bar:
        for _ in range(args.repeats):
            for name, threads in settings.items():
                tokens = seconds = 0
                for prompt in prompts:
                    spec = {key: getattr(args, key) for key in SETTINGS}
                    spec.update(prompt=prompt, draft=args.draft, gamma=args.gamma[0], threads=threads)
                    done = in_fresh_process(spec, env)
                    tokens, seconds = tokens + len(done["tokens"]), seconds + done["seconds"]
                    bar.update(1)
                rates[name].append(tokens / seconds)
    medians = {name: statistics.median(r) for name, r in rates.items()}
    best = max(medians[str(n)] for n in range(1, cpus + 1))
    result = {"settings": vars(args), "cpus": cpus, "tokens_per_second": medians, "repeats": rates,
              "default_over_best": medians["default"] / best, "goal": GOAL}
    return result, threads_table(args, result)


def threads_table(args, result):
    best = max(rate for name, rate in result["tokens_per_second"].items() if name != "default")
    lines = [f"target `{args.target}`, draft `{args.draft}`, γ = {args.gamma[0]}, {args.max_new_tokens} new tokens, "
             f"one of {result['cpus']} CPUs held by a spinning process, each request in a fresh process, median "
             f"of {args.repeats} rounds", "",
             "| threads | tok/s | x best |", "|---|---|---|"]
    lines += [f"| {name} | {rate:.1f} | {rate / best:.2f} |" for name, rate in result["tokens_per_second"].items()]
    verdict = "meets" if result["default_over_best"] >= GOAL else "misses"
    lines += ["", f"default: {result['default_over_best']:.2f}x the best setting ({verdict} the goal of {GOAL}x)"]
    return "\n".join(lines)
