"""One-shot runs, as users of run.py make them: every request in a fresh process, so that nothing a
process learnt or allocated helps the next but what it left on disk (gamma="auto"'s costs, kept per
pair: decoding/profiles.py). Plain decoding, each --gamma (auto, fixed γ) and each prompt take turns,
round after round. The auto runs share a profiles folder made empty for the bench, so its first round
is a first run on this machine and the later ones are later runs. A request's time is its generate
call's; the process start and loading the models (a self-draft's quantized copy included) are left
out, the loading reported apart.

    python -m minispec.tools.bench --one-shot --target T --draft D --gamma auto 3 [--beams 4 --draft-beams 8]
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from minispec import generate
from minispec.loaders import load_target_and_draft
from minispec.decoding.drafters import SELF_DRAFT_MODES, make_drafter
from minispec.loading.weights import DTYPES

from .prompts import prompt_ids_of, read_prompts
from .report import progress, yes_no

SETTINGS = ("target", "device", "dtype", "compile", "quantize", "draft_quantize", "group_size", "chat",
            "max_new_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "beams", "draft_beams")


def run_request(spec):
    """In the fresh process: load, generate once; what the bench reads back."""
    if spec.get("threads"):  # as run.py's --threads sets them (bench/threads.py)
        torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    target, draft = load_target_and_draft(spec["target"], spec["draft"] or "none", spec["device"],
                                          DTYPES.get(spec["dtype"]), spec["compile"], spec["quantize"],
                                          spec["draft_quantize"] if spec["draft"] else None, spec["group_size"])
    if draft in SELF_DRAFT_MODES:  # the target's quantized copy is made once per target: part of loading
        make_drafter(draft, target)
    loaded = time.perf_counter() - start
    search = dict(beams=spec["beams"], draft_beams=spec["draft_beams"] if spec["draft"] else None) \
        if spec["beams"] else {}
    start = time.perf_counter()
    out = generate(target, prompt_ids_of(target, spec["prompt"], spec["chat"]), draft=draft,
                   gamma=spec["gamma"] or "auto", max_new_tokens=spec["max_new_tokens"],
                   temperature=spec["temperature"], top_k=spec["top_k"], top_p=spec["top_p"], seed=spec["seed"],
                   ignore_eos=spec["ignore_eos"], **search)
    return {"load_seconds": loaded, "seconds": time.perf_counter() - start, "tokens": out.tokens,
            "guesses_histogram": out.stats.get("guesses_histogram")}


def in_fresh_process(spec, env):
    done = subprocess.run([sys.executable, "-m", "minispec.tools.bench.oneshot", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    if done.returncode:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise ValueError(f"a one-shot run failed: {lines[-1]}")
    return json.loads(done.stdout)


def one_shot_benchmark(args):
    """Seconds per request, each in its own process: plain, then each --gamma, per prompt and round."""
    configs = {"plain": None, **{str(g): g for g in args.gamma}}
    prompts = read_prompts(args)
    runs = {(name, i): [] for name in configs for i in range(len(prompts))}
    with tempfile.TemporaryDirectory() as profiles, progress(len(runs) * args.repeats, "one-shot") as bar:
        env = dict(os.environ, MINISPEC_PROFILES=profiles)
        for _ in range(args.repeats):
            for i, prompt in enumerate(prompts):
                for name, gamma in configs.items():
                    spec = {key: getattr(args, key) for key in SETTINGS}
                    spec.update(prompt=prompt, draft=None if gamma is None else args.draft, gamma=gamma)
                    runs[name, i].append(in_fresh_process(spec, env))
                    bar.update(1)
    rows = []
    for i in range(len(prompts)):
        plain = runs["plain", i]
        row = {"prompt": i + 1, "plain_seconds": statistics.median(r["seconds"] for r in plain),
               "load_seconds": statistics.median(r["load_seconds"] for r in plain), "configs": {}}
        for name in configs:
            if name == "plain":
                continue
            done = runs[name, i]
            # auto's first run starts from nothing; later runs from what the runs before them kept
            first, later = done[0]["seconds"], [r["seconds"] for r in done[1:]]
            row["configs"][name] = {
                "seconds": statistics.median(r["seconds"] for r in done), "first_seconds": first,
                "later_seconds": statistics.median(later) if later else None,
                "guesses_histograms": [r["guesses_histogram"] for r in done],
                "identical": all(r["tokens"] == plain[0]["tokens"] for r in done + plain)
                if args.temperature == 0 else None}
        rows.append(row)
    return {"settings": vars(args), "one_shot": rows}, one_shot_table(args, rows)


def one_shot_table(args, rows):
    names = list(rows[0]["configs"])
    search = f", beam search of width {args.beams}" if args.beams else ""
    lines = [f"target `{args.target}`, draft `{args.draft}`{search}, {args.max_new_tokens} new tokens, each request "
             f"in a fresh process, {args.repeats} rounds: seconds of the request (median; for auto, the first "
             "run and the median of the later ones) and x plain", "",
             "| prompt | load s | plain s | " + " | ".join(f"γ = {name}" for name in names) + " | same output |",
             "|" + "---|" * (4 + len(names))]
    for row in rows:
        cells = []
        for name in names:
            config, plain = row["configs"][name], row["plain_seconds"]
            if name == "auto" and config["later_seconds"] is not None:
                cells.append(f"first {config['first_seconds']:.2f} ({plain / config['first_seconds']:.2f}x), "
                             f"later {config['later_seconds']:.2f} ({plain / config['later_seconds']:.2f}x)")
            else:
                cells.append(f"{config['seconds']:.2f} ({plain / config['seconds']:.2f}x)")
        same = yes_no(None if args.temperature else all(c["identical"] for c in row["configs"].values()))
        lines.append(f"| {row['prompt']} | {row['load_seconds']:.2f} | {row['plain_seconds']:.2f} | "
                     + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(json.dumps(run_request(json.loads(sys.argv[1]))))
