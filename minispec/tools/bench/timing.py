"""Timing: decoders side by side in interleaved rounds, and the single forwards Theorem 3.8 is about."""

import statistics
from contextlib import nullcontext
from functools import partial

import torch

from minispec.decoding.suffix import STORES as SUFFIX_STORES
from minispec.decoding.drafters import SELF_DRAFT_MODES, make_drafter
from minispec.models.base import CachedLM
from minispec.models.kernels import without_row_invariance

from .memory import bandwidth, timed
from .report import progress

STEP_SAMPLES = 25  # forwards timed per step-time median
FORWARD_WIDTHS = (1, 2, 4, 8, 16)  # the target forwards timed besides the verifications: up to tree.TREE_AUTO + 1


def median_times(fns, device, samples=STEP_SAMPLES, warmup=3):
    """{name: median seconds of fn()} over `samples` rounds in which every fn runs once in turn, after
    `warmup` untimed rounds (compilation, caches)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = [{name: timed(fn, device)[1] for name, fn in fns.items()} for _ in range(samples)]
    return {name: statistics.median(t[name] for t in times) for name in fns}


def time_generation(runners, requests, repeats, device):
    """Decoders side by side: a warm-up pass over the requests each, then `repeats` rounds in which every
    runner makes one timed pass in turn, so that machine drift hits all alike. run_one(request) ->
    (generated ids, stats), whose "prefill_seconds" and "first_call_tokens" set the decode phase apart."""
    passes = {name: [] for name in runners}
    with progress(len(runners) * (repeats + 1), "passes") as bar:
        for _ in range(repeats + 1):
            for name, run_one in runners.items():
                SUFFIX_STORES.clear()  # the suffix drafter would guess what an earlier pass answered, whole
                passes[name].append([timed(partial(run_one, request), device) for request in requests])
                bar.update(1)
    return {name: pass_rates(passes[name]) for name in runners}


def pass_rates(passes):
    """time_generation's figures for one runner from its passes [[((ids, stats), seconds) per request]], the
    first of them the warm-up."""
    rates, decode_rates = [], []
    for done in passes[1:]:
        tokens, seconds = sum(len(ids) for (ids, _), _ in done), sum(s for _, s in done)
        rates.append(tokens / seconds)
        if all("prefill_seconds" in stats for (_, stats), _ in done):  # the decode phase: after the prefill
            decode_rates.append((tokens - sum(stats["first_call_tokens"] for (_, stats), _ in done))
                                / (seconds - sum(stats["prefill_seconds"] for (_, stats), _ in done)))
    request_seconds = list(zip(*([s for _, s in done] for done in passes[1:])))
    last = [result for result, _ in passes[-1]]
    return {"tokens_per_second": statistics.median(rates), "tokens_per_second_repeats": rates,
            "decode_tokens_per_second": statistics.median(decode_rates) if decode_rates else None,
            "decode_tokens_per_second_repeats": decode_rates,
            "request_seconds": [statistics.median(t) for t in request_seconds],
            "request_seconds_fastest": [min(t) for t in request_seconds],
            "warmup_seconds": sum(s for _, s in passes[0]),
            "outputs": [ids for ids, _ in last], "stats": [stats for _, stats in last]}


def decode_steps(model, prefix, widths):
    """{n: fn} for n in widths, where fn() decodes n tokens with `prefix` in the cache and rolls back,
    so that all of them can be timed in turns at the same cache position."""
    model.ensure_caches(1, prefix.shape[1] + max(widths))
    model.prefill(prefix, logits_for=0)
    position = model.length

    def step(tokens):
        model.decode(tokens)
        model.rollback(position)

    return {n: partial(step, prefix[:, -1:].repeat(1, n)) for n in widths}  # token values don't change the cost


@torch.inference_mode()
def step_times(target, draft, prompt_ids, generated, gammas, sampling):
    """Median seconds of the forwards Theorem 3.8 is about, with prompt + `generated` in the caches: a
    target step, a verification (and FORWARD_WIDTHS) and a draft step (a model-free drafter's guess)."""
    if draft in SELF_DRAFT_MODES:  # the target's quantized copy: a model drafter
        draft = make_drafter(draft, target).model
    device = target.device
    start = target.encode(prompt_ids)
    widths = sorted(set(FORWARD_WIDTHS) | {g + 1 for g in gammas})
    if target.context_length is not None:  # keep the widest forward inside the context
        generated = generated[:max(target.context_length - start.shape[1] - widths[-1], 0)]
    generated = torch.tensor([generated], dtype=torch.long, device=device).view(1, -1)
    prefix = torch.cat([start, generated], dim=1)
    steps = decode_steps(target, prefix, widths)
    fns = {("target", n): fn for n, fn in steps.items()}
    if isinstance(draft, CachedLM):
        fns["draft", 1] = decode_steps(draft, torch.cat([draft.encode(prompt_ids), generated], dim=1), [1])[1]
    else:
        drafter = make_drafter(draft, target)
        drafter.start(torch.cat([prompt_ids, generated], dim=1), sampling)
        generator = torch.Generator(device=device).manual_seed(0)
        fns.update({("draft", g): partial(drafter.propose, g, sampling, generator) for g in gammas})
    times = median_times(fns, device)
    draft_step = {g: times["draft", 1] if isinstance(draft, CachedLM) else times["draft", g] / g for g in gammas}
    return {"position": prefix.shape[1], "target_step_s": times["target", 1],
            "verify_step_s": {g: times["target", g + 1] for g in gammas},
            "forward_s": {n: times["target", n] for n in widths}, "draft_step_s": draft_step,
            "draft_bandwidth": bandwidth(draft, prefix.shape[1], times["draft", 1])
            if isinstance(draft, CachedLM) else None}


@torch.inference_mode()
def row_invariance_price(target, prefix, widths=(1, 4, 9), rounds=3):
    """{"with": {n: s}, "without": {n: s}}: target forwards' seconds with row invariance and without,
    the fastest of interleaved rounds."""
    steps = decode_steps(target, prefix, list(widths))
    times = {"with": {}, "without": {}}
    for _ in range(rounds):
        for name in times:
            with nullcontext() if name == "with" else without_row_invariance(target):
                for n, seconds in median_times(steps, target.device).items():
                    times[name][n] = min(times[name].get(n, float("inf")), seconds)
    return times
