"""Drafters side by side (`--draft D1 D2 ...`): the same prompts decoded plainly and with each drafter (the
first --gamma; with --tree N also with trees), in interleaved rounds: speedups, acceptance by guess position
(what a draft head is judged by), and what a target call costs: its draft forwards and its verification."""

import statistics
from argparse import Namespace

import numpy
import torch

from minispec import Sampling
from minispec.decoding.drafters import MODEL_FREE_NAMES
from minispec.loaders import load_draft, load_models, loads_model

from .benchmarks import minispec_runner, reported, same, summed
from .memory import decode_bytes
from .prompts import prompt_ids_of, read_prompts
from .report import cell, md_table
from .timing import decode_steps, median_times, step_times, time_generation

POSITIONS = 4  # acceptance is shown for the first guess positions


def drafters_benchmark(args):
    target, _ = load_models(Namespace(**{**vars(args), "draft": "none", "draft_quantize": None}))
    # --draft-quantize is the draft models', not refused for a model-free name listed beside them
    drafts = {name: load_draft(name, target, args.compile, args.draft_quantize if loads_model(name) else None,
                               args.group_size) for name in args.draft}
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    runners = {"plain": minispec_runner(target, None, 1, args)}
    for name, draft in drafts.items():
        runners[name] = minispec_runner(target, draft, args.gamma[0], args)
        if args.tree and draft is not None:  # "none" decodes plainly: it has no tree
            runners[name, "tree"] = minispec_runner(target, draft, args.gamma[0], args, args.tree)
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, target.device)
    plain, rows = timed["plain"], []
    prefix, generated = torch.tensor([prompts[0]], device=target.device), plain["outputs"][0]
    for name, draft in drafts.items():
        cost = call_costs(target, draft, prefix, generated[:len(generated) // 2], args)
        rows.append(drafter_row(name, timed[name], plain, cost, args))
        if (name, "tree") in timed:
            rows.append(drafter_row(name, timed[name, "tree"], plain, cost, args, chain=rows[-1]))
    s, tree = reported(args, target, prompts), f", tree {args.tree}" if args.tree else ""
    lines = [f"target `{s['target']}` on {s['device']} ({s['dtype']}): {s['prompts']} prompts x {s['max_new_tokens']} "
             f"new tokens, temperature {s['temperature']}, gamma {s['gamma'][0]}{tree}, median of {s['repeats']}; "
             f"plain decoding {plain['tokens_per_second']:.1f} tokens/s", ""]
    lines += md_table(DRAFTER_COLUMNS + (TREE_COLUMNS if args.tree else []), rows)
    lines += ["", "guess cost: one guess's seconds over a 1-token target step's (a draft model's or head's "
              "forward; lookup's and ngram's proposal)"]
    if args.tree:
        lines += ["", "a tree row: its steps' guesses/call and acceptance count the accepted path and the first "
                  "rejected child; vs chain: over the chain row above it, same drafter and gamma"]
    lines += ["", *md_table([(header, lambda cells, i=i: cells[i]) for i, header in enumerate(COST_HEADER)],
                            map(cost_cells, rows))]
    lines += ["", "x: over a plain step's ms (a 1-token target forward); verify: a target forward as wide as the "
              "call's guesses (a tree's nodes) and one; measured: the decode's ms per target call; predicted "
              "speedup: tok/call x plain step / (draft + verify)"]
    return {"settings": s, "plain_tokens_per_second": plain["tokens_per_second"], "rows": rows}, "\n".join(lines)


def drafter_row(name, spec, plain, cost, args, chain=None):
    """One drafter's row: `spec` and `plain` are time_generation's; with its `chain` row, the row of its trees."""
    stats, tree = spec["stats"], args.tree if chain else None
    verified_at, accepted_at = summed(stats, "verified_at"), summed(stats, "accepted_at")
    calls = sum(s["target_calls"] for s in stats)
    guesses = sum(s["proposed"] for s in stats) / calls
    nodes = sum(s.get("tree_nodes", 0) for s in stats) / calls if tree else None
    # per call: the draft's forwards (a model-free drafter's: its guesses) and the verification of
    # what it proposed (a tree's nodes, or a chain's guesses, and the target's own token), interpolated
    # between the target forward's widths timed
    forwards = sum(s.get("draft_calls", 0) for s in stats) / calls if cost["per_forward"] else guesses
    widths = sorted(cost["forward_ms"])
    verify_ms = float(numpy.interp(1 + (nodes or guesses), widths, [cost["forward_ms"][n] for n in widths]))
    tokens_per_call = sum(s["new_tokens"] for s in stats) / calls
    row = {"draft": name, "tree": tree, "tokens_per_second": spec["tokens_per_second"],
           "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
           "speedup_by_request": [p / s for p, s in zip(plain["request_seconds"], spec["request_seconds"])],
           "identical_to_plain": same(spec, plain, args),
           "tokens_per_target_call": tokens_per_call, "mean_guesses": guesses,
           "tree_nodes_per_call": nodes,  # a step whose tree came out a chain is verified as one: no nodes
           "acceptance_rate": sum(accepted_at) / max(sum(verified_at), 1),
           "acceptance_by_position": [a / v if v else None for a, v in zip(accepted_at, verified_at)],
           "guess_cost": cost["guess_cost"], "target_step_ms": cost["target_step_ms"],
           "draft_forward_ms": cost["draft_ms"], "draft_forwards_per_call": forwards,
           "draft_ms_per_call": None if cost["draft_ms"] is None else forwards * cost["draft_ms"],
           "verify_ms_per_call": verify_ms, "target_bytes": cost.get("target_bytes"),
           "draft_bytes": cost.get("draft_bytes"),
           # what a call costs in the decode, measured: its tokens at the measured rate
           "ms_per_call": tokens_per_call / spec["decode_tokens_per_second"] * 1e3
           if spec["decode_tokens_per_second"] else None, "outputs": spec["outputs"]}
    if chain is None:
        return row
    return {**row, "tokens_per_target_call_vs_chain": row["tokens_per_target_call"] / chain["tokens_per_target_call"],
            "speed_vs_chain": row["tokens_per_second"] / chain["tokens_per_second"]}


def call_costs(target, draft, prefix, generated, args):
    """A target step's ms and its forwards' by width, a draft forward's ms (a model-free drafter's: a guess's,
    per_forward False), and a guess's cost over a target step's (a Medusa head's: its guess on a state)."""
    if getattr(draft, "kind", None) == "medusa":  # no cache: one head on one state
        state = torch.randn(target.hidden_size, dtype=target.dtype, device=target.device)
        step = decode_steps(target, target.encode(prefix), [1])[1]
        times = median_times({"target": step, "guess": lambda: draft(state, 1)}, target.device)
        return {"guess_cost": times["guess"] / times["target"], "target_step_ms": times["target"] * 1e3,
                "forward_ms": {1: times["target"] * 1e3}, "draft_ms": None, "per_forward": False}
    times = step_times(target, draft, prefix, generated, [1], Sampling(args.temperature, args.top_k, args.top_p))
    return {"guess_cost": times["draft_step_s"][1] / times["target_step_s"],
            "target_step_ms": times["target_step_s"] * 1e3, "draft_ms": times["draft_step_s"][1] * 1e3,
            "forward_ms": {n: s * 1e3 for n, s in times["forward_s"].items()},
            "per_forward": not isinstance(draft, str) or draft not in MODEL_FREE_NAMES,
            "target_bytes": decode_bytes(target, times["position"]),
            "draft_bytes": times["draft_bandwidth"] and times["draft_bandwidth"]["bytes_per_step"]}


def label(r):
    return f"`{r['draft']}`" + (" tree" if r["tree"] else "")


DRAFTER_COLUMNS = [
    ("draft", label), ("tok/s", "{tokens_per_second:.1f}"), ("speedup", "{speedup:.2f}x"),
    ("same as plain", "{identical_to_plain}"), ("tok/call", "{tokens_per_target_call:.2f}"),
    ("guesses/call", "{mean_guesses:.2f}"), ("accept", "{acceptance_rate:.2f}"),
    *((f"accept @{i + 1}", lambda r, i=i: cell("{rate:.2f}", {
        "rate": (r["acceptance_by_position"] + [None] * POSITIONS)[i]})) for i in range(POSITIONS)),
    ("guess cost", "{guess_cost:.3f}")]
TREE_COLUMNS = [("tree nodes/call", "{tree_nodes_per_call:.2f}"), ("tok/call vs chain",  # "-" on a chain's row
                 "{tokens_per_target_call_vs_chain:.2f}x"), ("speed vs chain", "{speed_vs_chain:.2f}x")]
COST_HEADER = ["draft", "tok/call", "draft forward ms", "forwards/call", "draft ms/call", "verify ms/call",
               "draft + verify ms", "measured ms/call", "predicted speedup", "speedup per request (geometric mean)"]


def cost_cells(r):
    """A drafter's row of the cost table: a call's draft forwards and verification, against a plain step."""
    step, draft, verify = r["target_step_ms"], r["draft_ms_per_call"], r["verify_ms_per_call"]
    total = verify + (draft or 0)

    def ms(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f} ({value / step:.2f}x)"
    return [label(r), f"{r['tokens_per_target_call']:.2f}",
            ms(r["draft_forward_ms"], 2), f"{r['draft_forwards_per_call']:.2f}", ms(draft), ms(verify), ms(total),
            ms(r["ms_per_call"]), f"{r['tokens_per_target_call'] * step / total:.2f}x",
            f"{statistics.geometric_mean(r['speedup_by_request']):.2f}x"]
