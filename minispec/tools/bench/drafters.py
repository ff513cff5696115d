"""Drafters side by side (`--draft D1 D2 ...`): the same prompts decoded plainly and with each drafter (the
first --gamma; with --tree N also with trees), in interleaved rounds: speedups, acceptance by guess position
(what a draft head is judged by) and a guess's cost against a target step."""

from argparse import Namespace

import torch

from minispec.decoding.drafters import MODEL_FREE_NAMES, SELF_DRAFT_MODES
from minispec.loaders import load_draft, load_models

from .benchmarks import minispec_runner, reported, sampling_of, summed
from .prompts import prompt_ids_of, read_prompts
from .report import md_table
from .timing import decode_steps, median_times, step_times, time_generation

POSITIONS = 4  # acceptance is shown for the first guess positions


def drafters_benchmark(args):
    target, _ = load_models(Namespace(**{**vars(args), "draft": "none", "draft_quantize": None}))
    # --draft-quantize is the draft models': not refused for a model-free name listed beside them
    drafts = {name: load_draft(name, target, args.compile, None if name in MODEL_FREE_NAMES + SELF_DRAFT_MODES
                               else args.draft_quantize, args.group_size) for name in args.draft}
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
        cost = guess_cost(target, draft, prefix, generated, args)
        rows.append(drafter_row(name, timed[name], plain, cost, args))
        if (name, "tree") in timed:
            rows.append(drafter_row(name, timed[name, "tree"], plain, cost, args, chain=rows[-1]))
    result = {"settings": reported(args, target, prompts), "plain_tokens_per_second": plain["tokens_per_second"],
              "rows": rows}
    return result, drafters_table(result)


def drafter_row(name, spec, plain, cost, args, chain=None):
    """One drafter's row: `spec` and `plain` are time_generation's; with its `chain` row, the row of its trees."""
    stats, tree = spec["stats"], args.tree if chain else None
    verified_at, accepted_at = summed(stats, "verified_at"), summed(stats, "accepted_at")
    calls = sum(s["target_calls"] for s in stats)
    row = {"draft": name, "tree": tree, "tokens_per_second": spec["tokens_per_second"],
           "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
           "identical_to_plain": spec["outputs"] == plain["outputs"] if args.temperature == 0 else None,
           "tokens_per_target_call": sum(s["new_tokens"] for s in stats) / calls,
           "mean_guesses": sum(s["proposed"] for s in stats) / calls,
           # a step whose tree came out a chain is verified as one, and counts no nodes
           "tree_nodes_per_call": sum(s.get("tree_nodes", 0) for s in stats) / calls if tree else None,
           "acceptance_rate": sum(accepted_at) / max(sum(verified_at), 1),
           "acceptance_by_position": [a / v if v else None for a, v in zip(accepted_at, verified_at)],
           "guess_cost": cost, "outputs": spec["outputs"]}
    if chain is None:
        return row
    return {**row, "tokens_per_target_call_vs_chain": row["tokens_per_target_call"] / chain["tokens_per_target_call"],
            "speed_vs_chain": row["tokens_per_second"] / chain["tokens_per_second"]}


def guess_cost(target, draft, prefix, generated, args):
    """One guess's seconds over a 1-token target step's (a Medusa head's: its guess on a state)."""
    if getattr(draft, "kind", None) == "medusa":  # no cache: one head on one state
        state = torch.randn(target.hidden_size, dtype=target.dtype, device=target.device)
        steps = decode_steps(target, target.encode(prefix), [1])
        times = median_times({"target": steps[1], "guess": lambda: draft(state, 1)}, target.device)
        return times["guess"] / times["target"]
    times = step_times(target, draft, prefix, generated, [1], sampling_of(args))
    return times["draft_step_s"][1] / times["target_step_s"]


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
    return "\n".join(lines)


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
