"""Decoders side by side against Theorem 3.8 (benchmark), requests decoded together (batch_benchmark),
beam search (beam_benchmark), and what the bench's benchmarks share."""

import statistics
import time

import torch

from minispec import Sampling, chat_prompt, generate
from minispec.loaders import load_models

from . import llamacpp
from .memory import bandwidth, memory_growth
from .prompts import prompt_ids_of, read_prompts
from .reference import reference_runners
from .report import dtype_name, md_table, yes_no
from .theory import best_gamma, predicted_speedup, ratio_factors
from .timing import row_invariance_price, step_times, time_generation


TIMED = ("tokens_per_second", "tokens_per_second_repeats", "decode_tokens_per_second", "request_seconds",
         "request_seconds_fastest", "warmup_seconds", "outputs")  # what the JSON keeps of a decoder's timing
REPORTED = ("target", "draft", "gamma", "tree", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "seeds",
            "ignore_eos", "repeats", "chat", "compile", "quantize", "draft_quantize", "group_size")


def sampling_of(args):
    return Sampling(args.temperature, args.top_k, args.top_p)


def reported(args, target, prompts):
    """The settings a benchmark's JSON and table report."""
    return {**{key: getattr(args, key) for key in REPORTED}, "gammas": args.gamma, "device": str(target.device),
            "dtype": dtype_name(target), "prompts": len(prompts)}


def decoding_settings(args):
    """The flags' settings that every decoder of a benchmark shares."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, ignore_eos=args.ignore_eos)


def policy_summary(stats):
    """gamma="auto" over all requests, and the last request's cost model (it carries over between them)."""
    histogram = summed(stats, "guesses_histogram")
    steps = sum(histogram)
    return {"guesses_histogram": histogram, "mean_guesses": sum(k * n for k, n in enumerate(histogram)) / steps,
            "expected_tokens_per_call": sum(s["expected_tokens_per_call"] * s["target_calls"] for s in stats) / steps,
            **{key: stats[-1][key] for key in ("cost_model", "alpha_estimate", "acceptance_by_confidence")}}


def summed(stats, key):
    """A list-valued stat summed position by position over the requests."""
    return [sum(column) for column in zip(*(s[key] for s in stats))]


def speculative_summary(stats):
    """Per-request stats pooled: α weighted by verified positions; tokens per target call overall and in
    the decode phase (the calls after the prompt's forward)."""
    verified = sum(s["verified"] for s in stats)
    tokens, calls = sum(s["new_tokens"] for s in stats), sum(s["target_calls"] for s in stats)
    decode_calls = calls - len(stats)
    decode_tokens = tokens - sum(s["first_call_tokens"] for s in stats)
    return {"alpha": sum(s["alpha"] * s["verified"] for s in stats) / verified if verified else 0.0,
            "acceptance_rate": sum(s["accepted"] for s in stats) / verified if verified else 0.0,
            "tokens_per_target_call": tokens / calls,
            "decode_tokens_per_target_call": decode_tokens / decode_calls if decode_calls else tokens / calls}


def minispec_runner(target, draft, gamma, args, tree=None):
    """run_one for time_generation: one (prompt ids, seed) request through generate; its prefill ends
    when the first step's tokens reach on_tokens, and the decode phase Theorem 3.8 is about follows."""
    settings = dict(decoding_settings(args), tree=tree if draft else None)

    def run_one(request):
        prompt, seed = request
        start, steps = time.perf_counter(), []
        out = generate(target, prompt, draft=draft, gamma=gamma, seed=seed,
                       on_tokens=lambda i, tokens: steps or steps.append(time.perf_counter()), **settings)
        return out.tokens, dict(out.stats, prefill_seconds=steps[0] - start)

    return run_one


def benchmark(args):
    target, draft, prompts = models_and_prompts(args)
    device = target.device
    runners = {("minispec", None): minispec_runner(target, None, 1, args),
               **{("minispec", g): minispec_runner(target, draft, g, args, args.tree) for g in args.gamma}}
    if args.compare_reference:
        runners.update(reference_runners(args, device, target.dtype))
    if args.llama_cpp:  # in the same rounds as minispec's runners: a machine's drift hits both alike
        runners.update({("llama.cpp", mode): run_one for mode, run_one in peer_runners(args, target, prompts).items()})
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, device)

    ar = timed["minispec", None]
    first, generated = torch.tensor([prompts[0]], device=device), ar["outputs"][0]
    fixed = sorted({g for g in args.gamma if g != "auto"} | {1})  # "auto" rows use γ = 1's draft step
    steps = step_times(target, draft, first, generated[:len(generated) // 2], fixed, sampling_of(args))

    def same(outputs):  # greedy decoders must all give plain greedy decoding's tokens
        return outputs == ar["outputs"] if args.temperature == 0 else None

    result = {
        "settings": reported(args, target, prompts),
        "autoregressive": {key: ar[key] for key in TIMED},
        "prefill_s": statistics.mean(s["prefill_seconds"] for s in ar["stats"]),
        "target_step_s": steps["target_step_s"], "step_position": steps["position"],
        "memory_bandwidth": bandwidth(target, steps["position"], steps["target_step_s"]),
        "draft_memory_bandwidth": steps["draft_bandwidth"],
        # A forward over n tokens reads what a 1-token step reads: n rows per weight read is the point.
        "forward_bandwidth": {n: bandwidth(target, steps["position"], s) for n, s in steps["forward_s"].items()},
        "memory": memory_growth(target, draft, args.gamma[0], prompts[0], args.memory_tokens)
        if args.memory_tokens else None,
        "row_invariance_price": row_invariance_price(target, target.encode(first)) if args.row_invariance_price
        else None,
        "rows": [],
    }
    for gamma in args.gamma:
        spec = timed["minispec", gamma]
        measured = speculative_summary(spec["stats"])
        c = steps["draft_step_s"][1 if gamma == "auto" else gamma] / steps["target_step_s"]
        decode_speedup = spec["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
        best, best_speedup = best_gamma(measured["alpha"], c)
        row = {"gamma": gamma, **{key: spec[key] for key in TIMED}, **measured, "c": c,
               "speedup": spec["tokens_per_second"] / ar["tokens_per_second"], "decode_speedup": decode_speedup,
               "best_gamma": best, "best_gamma_predicted_speedup": best_speedup,
               "identical_to_autoregressive": same(spec["outputs"]),
               # other work on a shared machine only ever slows a run down: the fastest rounds are steadier
               **{f"per_prompt_speedup{fastest}": [a / s for a, s in zip(ar[f"request_seconds{fastest}"],
                                                                         spec[f"request_seconds{fastest}"])]
                  for fastest in ("", "_fastest")}}
        if gamma == "auto":  # no single γ to predict for: section 3.5's best fixed γ is the one to beat
            row.update(policy_summary(spec["stats"]), predicted_speedup=best_speedup,
                       measured_over_predicted=decode_speedup / best_speedup)
        else:
            predicted = predicted_speedup(measured["alpha"], gamma, c)
            verify_cost = steps["verify_step_s"][gamma] / steps["target_step_s"]
            factors = ratio_factors(measured["alpha"], gamma, c, verify_cost,
                                    measured["decode_tokens_per_target_call"], decode_speedup)
            row.update(draft_step_s=steps["draft_step_s"][gamma], verify_step_s=steps["verify_step_s"][gamma],
                       verify_cost_ratio=verify_cost, predicted_speedup=predicted,
                       measured_over_predicted=decode_speedup / predicted, measured_over_predicted_factors=factors)
        result["rows"].append(row)
    if args.llama_cpp:
        result["llama_cpp"] = peer(timed, result)
    if args.compare_reference:
        ref = timed["reference", None]
        result["reference"] = {
            "autoregressive": {"tokens_per_second": ref["tokens_per_second"], "identical": same(ref["outputs"])},
            "assisted": [{"gamma": g, "tokens_per_second": t["tokens_per_second"], "identical": same(t["outputs"]),
                          "speedup": t["tokens_per_second"] / ref["tokens_per_second"]}
                         for g in args.gamma if (t := timed.get(("reference", g)))]}
    return result


def peer_runners(args, target, prompts):
    """llama.cpp's modes on the same GGUF files and prompts, as time_generation runners; a chat turn as
    text, its markers spelled out (llama.cpp reads them as the special tokens they are)."""
    texts = {tuple(ids): target.tokenizer.decode(chat_prompt(target.tokenizer, p)) if args.chat else p
             for ids, p in zip(prompts, read_prompts(args))}
    return llamacpp.peer_runners(args.llama_cpp, args.target, args.draft, texts, args.max_new_tokens,
                                 torch.get_num_threads(), args.seed)


def peer(timed, result):
    """minispec's decode phase against llama.cpp's: plain against plain, best mode against best."""
    modes = {mode: {"tokens_per_second": t["decode_tokens_per_second"],
                    "tokens_per_second_repeats": t["decode_tokens_per_second_repeats"]}
             for (kind, mode), t in timed.items() if kind == "llama.cpp"}
    plain = result["autoregressive"]["decode_tokens_per_second"]
    best = max([plain] + [row["decode_tokens_per_second"] for row in result["rows"]])
    best_peer = max(mode["tokens_per_second"] for mode in modes.values())
    return {"modes": modes, "threads": torch.get_num_threads(),
            "plain_vs_plain": plain / modes["plain"]["tokens_per_second"], "best_vs_best": best / best_peer}


def models_and_prompts(args):
    target, draft = load_models(args)
    return target, draft, [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]


def plain_and_speculative(args, target, draft, variants):
    """{(variant, "plain" or "speculative"): tokens/s} and {variant: whether both gave the same outputs},
    for variants {name: (prompts or batches of them, generate's extra settings)}, timed in turns."""
    def runner(batches, extra):
        def run_one(_):
            outs = flat([generate(target, batch, seed=args.seed, **{**decoding_settings(args), **extra})
                         for batch in batches])
            return [t for out in outs for t in out.tokens], {"outputs": [out.tokens for out in outs]}
        return run_one

    speculative = {"draft": draft, "gamma": args.gamma[0]}
    runs = {(name, mode): runner(batches, {**extra, **(speculative if mode == "speculative" else {})})
            for name, (batches, extra) in variants.items() for mode in ("plain", "speculative")}
    timed = time_generation(runs, [None], args.repeats, target.device)
    same = {name: timed[name, "plain"]["stats"] == timed[name, "speculative"]["stats"] for name in variants}
    return {key: t["tokens_per_second"] for key, t in timed.items()}, same


def flat(outs):
    """generate's answers as one list: a batch's and n answers each included."""
    return [o for out in outs for o in (flat(out) if isinstance(out, list) else [out])]


def title(args, target):
    return (f"target `{args.target}`, draft `{args.draft}` (gamma {args.gamma[0]}) on {target.device} "
            f"({dtype_name(target)}), {args.max_new_tokens} new tokens a request, median of {args.repeats}")


def batch_benchmark(args):
    """Total new tokens per second of B requests at once, plain and speculative, for each B."""
    target, draft, prompts = models_and_prompts(args)
    rate, same = plain_and_speculative(args, target, draft, {
        b: ([[prompts[i % len(prompts)] for i in range(b)]], {"batch_size": b}) for b in args.batch_sizes})
    rows = [{"batch": b, "plain_tokens_per_second": rate[b, "plain"], "speculative_tokens_per_second":
             rate[b, "speculative"], "identical": same[b] if args.temperature == 0 else None} for b in args.batch_sizes]
    base = rate[min(args.batch_sizes), "plain"]
    lines = [title(args, target), ""] + md_table(
        ["batch", "plain tok/s", f"x batch {min(args.batch_sizes)}", "speculative tok/s", "x plain", "same outputs"],
        ([r["batch"], f"{r['plain_tokens_per_second']:.1f}", f"{r['plain_tokens_per_second'] / base:.2f}x",
          f"{r['speculative_tokens_per_second']:.1f}",
          f"{r['speculative_tokens_per_second'] / r['plain_tokens_per_second']:.2f}x", yes_no(r["identical"])]
         for r in rows))
    return {"settings": vars(args), "batches": rows}, "\n".join(lines)


def beam_benchmark(args):
    """Beam search, plain against speculative at each --gamma, per prompt: seconds per request, the
    median and the fastest of --repeats rounds (other work on a shared machine only ever slows a run)."""
    target, draft, prompts = models_and_prompts(args)

    def runner(**extra):
        def run_one(prompt):
            out = generate(target, prompt, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos,
                           beams=args.beams, **extra)
            return out.tokens, out.stats
        return run_one

    runs = {"plain": runner(), **{g: runner(draft=draft, draft_beams=args.draft_beams, gamma=g) for g in args.gamma}}
    timed = time_generation(runs, prompts, args.repeats, target.device)
    plain = timed.pop("plain")
    rows = [{"prompt": i + 1, "gamma": gamma, "plain_seconds": plain["request_seconds"][i],
             "seconds": spec["request_seconds"][i],
             "speedup_median": plain["request_seconds"][i] / spec["request_seconds"][i],
             "speedup_fastest": plain["request_seconds_fastest"][i] / spec["request_seconds_fastest"][i],
             "target_calls": spec["stats"][i]["target_calls"], "plain_target_calls": plain["stats"][i]["target_calls"],
             "guesses_histogram": spec["stats"][i].get("guesses_histogram"),
             "identical": spec["outputs"][i] == plain["outputs"][i]}
            for i in range(len(prompts)) for gamma, spec in timed.items()]
    lines = [f"target `{args.target}`, draft `{args.draft}` (draft beams {args.draft_beams or args.beams}) on "
             f"{target.device} ({dtype_name(target)}), beam search of width {args.beams}, "
             f"{args.max_new_tokens} new tokens, {args.repeats} rounds", ""]
    lines += md_table(["prompt", "γ", "plain s", "speculative s", "x plain (median)", "x plain (fastest)",
                       "target calls (plain)", "guesses per step", "same result"],
                      ([r["prompt"], r["gamma"], f"{r['plain_seconds']:.2f}", f"{r['seconds']:.2f}",
                        f"{r['speedup_median']:.2f}x", f"{r['speedup_fastest']:.2f}x",
                        f"{r['target_calls']} ({r['plain_target_calls']})", r["guesses_histogram"] or "-",
                        yes_no(r["identical"])] for r in rows))
    return {"settings": vars(args), "beams": rows}, "\n".join(lines)
