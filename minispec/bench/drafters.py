"""Drafters side by side (`--draft D1 D2 ...`): the same prompts decoded plainly and with each drafter
(the first --gamma, --tree if given), in interleaved rounds, so that drift hits all alike. Per drafter:
the speedup over plain decoding, whether greedy output is plain's, tokens per target call, acceptance
by guess position (how far into a step guesses survive: what a draft head is judged by) and a guess's
cost as a fraction of a target step.

    python -m minispec.bench --target smollm2-135m-instruct --draft lookup ngram int8 ./head --chat
"""

import torch

from ..cli import load_draft, load_target_and_draft
from ..loading.weights import DTYPES
from .benchmarks import minispec_runner, sampling_of
from .prompts import prompt_ids_of, read_prompts
from .timing import PrefillClock, decode_steps, median_times, step_times, time_generation

POSITIONS = 4  # acceptance is shown for the first guess positions


def drafters_benchmark(args):
    target, _ = load_target_and_draft(args.target, "none", args.device, DTYPES.get(args.dtype), args.compile,
                                      args.quantize, None, args.group_size)
    drafts = {name: load_draft(name, target, args.compile, args.draft_quantize, args.group_size) for name in args.draft}
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    target.decode_rows = clock = PrefillClock(target)
    gamma = args.gamma[0]
    runners = {"plain": minispec_runner(target, None, 1, args, clock)}
    runners.update({name: minispec_runner(target, draft, gamma, args, clock) for name, draft in drafts.items()})
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, target.device)
    plain = timed["plain"]
    prefix = torch.tensor([prompts[0]], device=target.device)
    generated = plain["outputs"][0][:len(plain["outputs"][0]) // 2]
    rows = []
    for name, draft in drafts.items():
        spec, stats = timed[name], timed[name]["stats"]
        verified_at = [sum(column) for column in zip(*(s["verified_at"] for s in stats))]
        accepted_at = [sum(column) for column in zip(*(s["accepted_at"] for s in stats))]
        calls = sum(s["target_calls"] for s in stats)
        rows.append({
            "draft": name, "tokens_per_second": spec["tokens_per_second"],
            "speedup": spec["tokens_per_second"] / plain["tokens_per_second"],
            "identical_to_plain": spec["outputs"] == plain["outputs"] if args.temperature == 0 else None,
            "tokens_per_target_call": sum(s["new_tokens"] for s in stats) / calls,
            "mean_guesses": sum(s["proposed"] for s in stats) / calls,
            "acceptance_rate": sum(accepted_at) / max(sum(verified_at), 1),
            "acceptance_by_position": [a / v if v else None for a, v in zip(accepted_at, verified_at)],
            "guess_cost": guess_cost(target, draft, prefix, generated, args),
            "outputs": spec["outputs"],
        })
    settings = {key: getattr(args, key) for key in ("target", "draft", "gamma", "tree", "max_new_tokens", "temperature",
                                                    "top_k", "top_p", "repeats", "chat", "quantize")}
    result = {"settings": {**settings, "device": str(target.device), "dtype": str(target.dtype).removeprefix("torch."),
                           "prompts": len(prompts)},
              "plain_tokens_per_second": plain["tokens_per_second"], "rows": rows}
    return result, drafters_table(result)


def guess_cost(target, draft, prefix, generated, args):
    """One guess's seconds over a 1-token target step's, timed in turns: a draft model's or head's
    1-token forward, a Medusa head's guess on a state, a model-free drafter's proposal of one guess."""
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
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rows"]:
        by_position = r["acceptance_by_position"] + [None] * POSITIONS
        same = "-" if r["identical_to_plain"] is None else "yes" if r["identical_to_plain"] else "NO"
        cells = [f"`{r['draft']}`", f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.2f}x", same,
                 f"{r['tokens_per_target_call']:.2f}", f"{r['mean_guesses']:.2f}", f"{r['acceptance_rate']:.2f}",
                 *("-" if rate is None else f"{rate:.2f}" for rate in by_position[:POSITIONS]),
                 f"{r['guess_cost']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "guess cost: one guess's seconds over a 1-token target step's (a draft model's or head's "
              "forward; lookup's and ngram's proposal)"]
    return "\n".join(lines)

