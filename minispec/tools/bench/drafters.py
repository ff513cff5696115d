"""Drafters side by side (`--draft D1 D2 ...`): the same prompts decoded plainly and with each drafter (the
first --gamma; with --tree N also with trees), in interleaved rounds: speedups, acceptance by guess position
(what a draft head is judged by), and what a target call costs: its draft forwards and its verification."""

import statistics
from argparse import Namespace

import numpy
import torch

from minispec.decoding.drafters import MODEL_FREE_NAMES
from minispec.loaders import load_draft, load_models, loads_model

from .benchmarks import minispec_runner, reported, sampling_of, summed
from .memory import decode_bytes
from .prompts import prompt_ids_of, read_prompts
from .report import md_table
from .timing import decode_steps, median_times, step_times, time_generation

POSITIONS = 4  # acceptance is shown for the first guess positions


def drafters_benchmark(args):
    target, _ = load_models(Namespace(**{**vars(args), "draft": "none", "draft_quantize": None}))
    drafts = load_drafts(args, target)
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    gamma = args.gamma[0]
    runners = {"plain": minispec_runner(target, None, 1, args)}
    for name, draft in drafts.items():
        runners[name] = minispec_runner(target, draft, gamma, args)
        if args.tree and draft is not None:  # "none" decodes plainly: it has no tree
            runners[name, "tree"] = minispec_runner(target, draft, gamma, args, args.tree)
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, target.device)
    plain = timed["plain"]
    prefix = torch.tensor([prompts[0]], device=target.device)
    generated = plain["outputs"][0][:len(plain["outputs"][0]) // 2]
    rows = []
    for name, draft in drafts.items():
        cost = call_costs(target, draft, prefix, generated, args)
        rows.append(drafter_row(name, timed[name], plain, cost, args))
        if (name, "tree") in timed:
            rows.append(drafter_row(name, timed[name, "tree"], plain, cost, args, chain=rows[-1]))
    result = {"settings": reported(args, target, prompts), "plain_tokens_per_second": plain["tokens_per_second"],
              "rows": rows}
    return result, drafters_table(result)


def load_drafts(args, target):
    """{name: draft as generate() takes it}; --draft-quantize is the draft models', not refused for a
    model-free name listed beside them."""
    return {name: load_draft(name, target, args.compile, args.draft_quantize if loads_model(name) else None,
                             args.group_size) for name in args.draft}


def drafter_row(name, spec, plain, cost, args, chain=None):
    """One drafter's row: `spec` and `plain` are time_generation's; with its `chain` row, the row of its trees."""
    stats, tree = spec["stats"], args.tree if chain else None
    verified_at, accepted_at = summed(stats, "verified_at"), summed(stats, "accepted_at")
    calls = sum(s["target_calls"] for s in stats)
    guesses = sum(s["proposed"] for s in stats) / calls
    nodes = sum(s.get("tree_nodes", 0) for s in stats) / calls if tree else None
    # per call: the draft's forwards (a model-free drafter's: its guesses) and the verification of
    # what it proposed (a tree's nodes, or a chain's guesses, and the target's own token)
    forwards = sum(s.get("draft_calls", 0) for s in stats) / calls if cost["per_forward"] else guesses
    draft_ms = forwards * cost["draft_ms"] if cost["draft_ms"] is not None else None
    verify_ms = width_ms(cost["forward_ms"], 1 + (nodes if tree and nodes else guesses))
    tokens_per_call = sum(s["new_tokens"] for s in stats) / calls
    row = {"draft": name, "tree": tree, "tokens_per_second": spec["tokens_per_second"],
           "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
           "speedup_by_request": [p / s for p, s in zip(plain["request_seconds"], spec["request_seconds"])],
           "identical_to_plain": spec["outputs"] == plain["outputs"] if args.temperature == 0 else None,
           "tokens_per_target_call": tokens_per_call, "mean_guesses": guesses,
           # a step whose tree came out a chain is verified as one, and counts no nodes
           "tree_nodes_per_call": nodes,
           "acceptance_rate": sum(accepted_at) / max(sum(verified_at), 1),
           "acceptance_by_position": [a / v if v else None for a, v in zip(accepted_at, verified_at)],
           "guess_cost": cost["guess_cost"], "target_step_ms": cost["target_step_ms"],
           "draft_forward_ms": cost["draft_ms"], "draft_forwards_per_call": forwards, "draft_ms_per_call": draft_ms,
           "verify_ms_per_call": verify_ms, "target_bytes": cost.get("target_bytes"),
           "draft_bytes": cost.get("draft_bytes"),
           # what a call costs in the decode, measured: its tokens at the measured rate
           "ms_per_call": tokens_per_call / spec["decode_tokens_per_second"] * 1e3
           if spec["decode_tokens_per_second"] else None, "outputs": spec["outputs"]}
    if chain is None:
        return row
    return {**row, "tokens_per_target_call_vs_chain": row["tokens_per_target_call"] / chain["tokens_per_target_call"],
            "speed_vs_chain": row["tokens_per_second"] / chain["tokens_per_second"]}


def width_ms(forward_ms, width):
    """A target forward's ms at `width` tokens, interpolated between the widths timed."""
    widths = sorted(forward_ms)
    return float(numpy.interp(width, widths, [forward_ms[n] for n in widths]))


def call_costs(target, draft, prefix, generated, args):
    """A target step's ms and its forwards' by width, a draft forward's ms (a model-free drafter's: a guess's,
    per_forward False), and a guess's cost over a target step's (a Medusa head's: its guess on a state)."""
    if getattr(draft, "kind", None) == "medusa":  # no cache: one head on one state
        state = torch.randn(target.hidden_size, dtype=target.dtype, device=target.device)
        steps = decode_steps(target, target.encode(prefix), [1])
        times = median_times({"target": steps[1], "guess": lambda: draft(state, 1)}, target.device)
        return {"guess_cost": times["guess"] / times["target"], "target_step_ms": times["target"] * 1e3,
                "forward_ms": {1: times["target"] * 1e3}, "draft_ms": None, "per_forward": False}
    times = step_times(target, draft, prefix, generated, [1], sampling_of(args))
    return {"guess_cost": times["draft_step_s"][1] / times["target_step_s"],
            "target_step_ms": times["target_step_s"] * 1e3,
            "forward_ms": {n: s * 1e3 for n, s in times["forward_s"].items()},
            "draft_ms": times["draft_step_s"][1] * 1e3,
            "per_forward": not isinstance(draft, str) or draft not in MODEL_FREE_NAMES,
            "target_bytes": decode_bytes(target, times["position"]),
            "draft_bytes": times["draft_bandwidth"] and times["draft_bandwidth"]["bytes_per_step"]}


def drafters_table(result):
    s = result["settings"]
    tree = f", tree {s['tree']}" if s["tree"] else ""
    lines = [f"target `{s['target']}` on {s['device']} ({s['dtype']}): {s['prompts']} prompts x {s['max_new_tokens']} "
             f"new tokens, temperature {s['temperature']}, gamma {s['gamma'][0]}{tree}, median of {s['repeats']}; "
             f"plain decoding {result['plain_tokens_per_second']:.1f} tokens/s", ""]
    header = ["draft", "tok/s", "speedup", "same as plain", "tok/call", "guesses/call", "accept",
              *(f"accept @{i + 1}" for i in range(POSITIONS)), "guess cost"]
    header += ["tree nodes/call", "tok/call vs chain", "speed vs chain"] if s["tree"] else []
    lines += md_table(header, (drafter_cells(r, s["tree"]) for r in result["rows"]))
    lines += ["", "guess cost: one guess's seconds over a 1-token target step's (a draft model's or head's "
              "forward; lookup's and ngram's proposal)"]
    if s["tree"]:
        lines += ["", "a tree row: its steps' guesses/call and acceptance count the accepted path and the first "
                  "rejected child; vs chain: over the chain row above it, same drafter and gamma"]
    header = ["draft", "tok/call", "draft forward ms", "forwards/call", "draft ms/call", "verify ms/call",
              "draft + verify ms", "measured ms/call", "predicted speedup", "speedup per request (geometric mean)"]
    lines += ["", *md_table(header, (cost_cells(r) for r in result["rows"]))]
    lines += ["", "x: over a plain step's ms (a 1-token target forward); verify: a target forward as wide as the "
              "call's guesses (a tree's nodes) and one; measured: the decode's ms per target call; predicted "
              "speedup: tok/call x plain step / (draft + verify)"]
    return "\n".join(lines)


def cost_cells(r):
    """A drafter's row of the cost table: a call's draft forwards and verification, against a plain step."""
    step, draft, verify = r["target_step_ms"], r["draft_ms_per_call"], r["verify_ms_per_call"]
    total = verify + (draft or 0)
    forward = r["draft_forward_ms"]
    forward = "-" if forward is None else f"{forward:.2f} ({forward / step:.2f}x)"
    return [f"`{r['draft']}`" + (" tree" if r["tree"] else ""), f"{r['tokens_per_target_call']:.2f}", forward,
            f"{r['draft_forwards_per_call']:.2f}", "-" if draft is None else f"{draft:.1f} ({draft / step:.2f}x)",
            f"{verify:.1f} ({verify / step:.2f}x)", f"{total:.1f} ({total / step:.2f}x)",
            "-" if r["ms_per_call"] is None else f"{r['ms_per_call']:.1f} ({r['ms_per_call'] / step:.2f}x)",
            f"{r['tokens_per_target_call'] * step / total:.2f}x",
            f"{statistics.geometric_mean(r['speedup_by_request']):.2f}x"]


def drafter_cells(r, tree):
    """A drafter's row of the table; with --tree, its tree columns ("-" on a chain's row)."""
    same = "-" if r["identical_to_plain"] is None else "yes" if r["identical_to_plain"] else "NO"
    by_position = (r["acceptance_by_position"] + [None] * POSITIONS)[:POSITIONS]
    cells = [f"`{r['draft']}`" + (" tree" if r["tree"] else ""), f"{r['tokens_per_second']:.1f}",
             f"{r['speedup']:.2f}x", same, f"{r['tokens_per_target_call']:.2f}", f"{r['mean_guesses']:.2f}",
             f"{r['acceptance_rate']:.2f}", *("-" if rate is None else f"{rate:.2f}" for rate in by_position),
             f"{r['guess_cost']:.3f}"]
    if not tree:
        return cells
    return cells + ([f"{r['tree_nodes_per_call']:.2f}", f"{r['tokens_per_target_call_vs_chain']:.2f}x",
                     f"{r['speed_vs_chain']:.2f}x"] if r["tree"] else ["-", "-", "-"])
