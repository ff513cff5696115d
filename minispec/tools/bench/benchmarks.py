"""Decoders side by side against the paper's Theorem 3.8 (benchmark), requests decoded together
(batch_benchmark), beam search (beam_benchmark), each feature's price (features_benchmark), and what
the bench's benchmarks share."""

import statistics
import time

import torch

from minispec import Sampling, chat_prompt, generate
from minispec.loaders import load_models

from . import llamacpp
from .memory import bandwidth, memory_growth
from .prompts import prompt_ids_of, read_prompts
from .reference import reference_runners
from .report import dtype_name, md_table, title
from .timing import row_invariance_price, step_times, time_generation

TIMED = ("tokens_per_second", "tokens_per_second_repeats", "decode_tokens_per_second", "request_seconds",
         "request_seconds_fastest", "warmup_seconds", "outputs")  # what the JSON keeps of a decoder's timing
REPORTED = ("target", "draft", "gamma", "tree", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "seeds",
            "ignore_eos", "repeats", "chat", "compile", "quantize", "draft_quantize", "group_size")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}
# --features: feature -> the settings it adds to the request; a grammar ends at EOS (it refuses ignore_eos)
FEATURES = {
    "none": {},
    "logprobs=5": {"logprobs": 5},
    "penalties, min_p": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_p": 0.05},
    "JSON schema": {"grammar": {"json_schema": SCHEMA}, "ignore_eos": False},
    "n=2": {"n": 2},
    "sampled, gumbel": {"temperature": 0.8, "coupling": "gumbel"},
    "sampled, rejection": {"temperature": 0.8, "coupling": "rejection"},
}


def predicted_speedup(alpha, gamma, c):
    """Theorem 3.8: expected walltime improvement (1 - α^(γ+1)) / ((1 - α)(γc + 1)); at α = 1 its limit."""
    tokens_per_call = gamma + 1 if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens_per_call / (gamma * c + 1)


def ratio_factors(alpha, gamma, c, verify_cost, tokens_per_call, decode_speedup):
    """Measured ÷ predicted as three factors, to tell where a shortfall comes from: tokens per target call
    against the i.i.d. expectation (1 - α^(γ+1)) / (1 - α); the theorem's cost of a call, 1 + γc, against
    the measured verify cost + γc; and what neither models (the loop's own work, host syncs)."""
    modelled = tokens_per_call / (verify_cost + gamma * c)
    return {"tokens_per_call": tokens_per_call / predicted_speedup(alpha, gamma, 0.0),
            "verify_cost": (1 + gamma * c) / (verify_cost + gamma * c), "loop": decode_speedup / modelled}


def best_gamma(alpha, c, max_gamma=16):
    """Section 3.5: the integer γ in 1..max_gamma maximizing Theorem 3.8; returns (γ, its speedup).
    A speedup below 1 means no γ helps (Corollary 3.9: speculation wins iff α > c)."""
    return max(((g, predicted_speedup(alpha, g, c)) for g in range(1, max_gamma + 1)), key=lambda gs: gs[1])


def reported(args, target, prompts):
    return {**{key: getattr(args, key) for key in REPORTED}, "gammas": args.gamma, "device": str(target.device),
            "dtype": dtype_name(target), "prompts": len(prompts)}


def decoding_settings(args):
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, ignore_eos=args.ignore_eos)


def summed(stats, key):  # a list-valued stat, position by position over the requests
    return [sum(column) for column in zip(*(s[key] for s in stats))]


def speculative_summary(stats):
    """Per-request stats pooled: α weighted by verified positions; tokens per target call overall and in
    the decode phase (the calls after the prompt's forward)."""
    verified = sum(s["verified"] for s in stats)
    tokens, calls = sum(s["new_tokens"] for s in stats), sum(s["target_calls"] for s in stats)
    decode_calls, decode_tokens = calls - len(stats), tokens - sum(s["first_call_tokens"] for s in stats)
    return {"alpha": sum(s["alpha"] * s["verified"] for s in stats) / verified if verified else 0.0,
            "acceptance_rate": sum(s["accepted"] for s in stats) / verified if verified else 0.0,
            "tokens_per_target_call": tokens / calls,
            "decode_tokens_per_target_call": decode_tokens / decode_calls if decode_calls else tokens / calls}


def policy_summary(stats):
    """gamma="auto" over all requests, and the last request's cost model (it carries over between them)."""
    histogram = summed(stats, "guesses_histogram")
    steps = sum(histogram)
    return {"guesses_histogram": histogram, "mean_guesses": sum(k * n for k, n in enumerate(histogram)) / steps,
            "expected_tokens_per_call": sum(s["expected_tokens_per_call"] * s["target_calls"] for s in stats) / steps,
            **{key: stats[-1][key] for key in ("cost_model", "alpha_estimate", "acceptance_by_confidence")}}


def minispec_runner(target, draft, gamma, args, tree=None):
    """run_one for time_generation: its prefill ends when the first step's tokens reach on_tokens."""
    settings = dict(decoding_settings(args), tree=tree if draft else None)

    def run_one(request):
        prompt, seed = request
        start, steps = time.perf_counter(), []
        out = generate(target, prompt, draft=draft, gamma=gamma, seed=seed,
                       on_tokens=lambda i, tokens: steps or steps.append(time.perf_counter()), **settings)
        return out.tokens, dict(out.stats, prefill_seconds=steps[0] - start)

    return run_one


def models_and_prompts(args):
    target, draft = load_models(args)
    return target, draft, [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]


def benchmark(args):
    """The main table: plain decoding, each --gamma and the peers asked for, in the same rounds."""
    target, draft, prompts = models_and_prompts(args)
    runners = {("minispec", None): minispec_runner(target, None, 1, args),
               **{("minispec", g): minispec_runner(target, draft, g, args, args.tree) for g in args.gamma}}
    if args.compare_reference:
        runners.update(reference_runners(args, target.device, target.dtype))
    if args.llama_cpp is not None:  # in the same rounds as minispec's runners: a machine's drift hits both alike
        runners.update({("llama.cpp", mode): run_one for mode, run_one in peer_runners(args, target, prompts).items()})
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, target.device)
    ar = timed["minispec", None]
    first, generated = torch.tensor([prompts[0]], device=target.device), ar["outputs"][0]
    fixed = sorted({g for g in args.gamma if g != "auto"} | {1})  # "auto" rows use γ = 1's draft step
    steps = step_times(target, draft, first, generated[:len(generated) // 2], fixed,
                       Sampling(args.temperature, args.top_k, args.top_p))
    position = steps["position"]
    result = {
        "settings": reported(args, target, prompts), "autoregressive": {key: ar[key] for key in TIMED},
        "prefill_s": statistics.mean(s["prefill_seconds"] for s in ar["stats"]),
        "target_step_s": steps["target_step_s"], "step_position": position,
        "memory_bandwidth": bandwidth(target, position, steps["target_step_s"]),
        "draft_memory_bandwidth": steps["draft_bandwidth"],
        # A forward over n tokens reads what a 1-token step reads: n rows per weight read is the point.
        "forward_bandwidth": {n: bandwidth(target, position, s) for n, s in steps["forward_s"].items()},
        "memory": memory_growth(target, draft, args.gamma[0], prompts[0], args.memory_tokens) if args.memory_tokens
        else None,
        "row_invariance_price": row_invariance_price(target, target.encode(first)) if args.row_invariance_price
        else None,
        "rows": [gamma_row(gamma, timed["minispec", gamma], ar, steps, args) for gamma in args.gamma]}
    if args.llama_cpp is not None:
        result["llama_cpp"] = peer(timed, result)
    if args.compare_reference:
        ref = timed["reference", None]
        result["reference"] = {
            "autoregressive": {"tokens_per_second": ref["tokens_per_second"], "identical": same(ref, ar, args)},
            "assisted": [{"gamma": g, "tokens_per_second": t["tokens_per_second"], "identical": same(t, ar, args),
                          "speedup": t["tokens_per_second"] / ref["tokens_per_second"]}
                         for g in args.gamma if (t := timed.get(("reference", g)))]}
    return result


def same(timed, plain, args):
    """Whether a greedy decoder gave plain greedy decoding's tokens (None when sampled: not comparable)."""
    return timed["outputs"] == plain["outputs"] if args.temperature == 0 else None


def gamma_row(gamma, spec, ar, steps, args):
    measured = speculative_summary(spec["stats"])
    c = steps["draft_step_s"][1 if gamma == "auto" else gamma] / steps["target_step_s"]
    decode_speedup = spec["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
    best, best_speedup = best_gamma(measured["alpha"], c)
    row = {"gamma": gamma, **{key: spec[key] for key in TIMED}, **measured, "c": c,
           "speedup": spec["tokens_per_second"] / ar["tokens_per_second"], "decode_speedup": decode_speedup,
           "best_gamma": best, "best_gamma_predicted_speedup": best_speedup,
           "identical_to_autoregressive": same(spec, ar, args),
           # other work on a shared machine only ever slows a run down: the fastest rounds are steadier
           **{f"per_prompt_speedup{fastest}": [a / s for a, s in zip(ar[f"request_seconds{fastest}"],
                                                                     spec[f"request_seconds{fastest}"])]
              for fastest in ("", "_fastest")}}
    if gamma == "auto":  # no single γ to predict for: section 3.5's best fixed γ is the one to beat
        return {**row, **policy_summary(spec["stats"]), "predicted_speedup": best_speedup,
                "measured_over_predicted": decode_speedup / best_speedup}
    predicted = predicted_speedup(measured["alpha"], gamma, c)
    verify_cost = steps["verify_step_s"][gamma] / steps["target_step_s"]
    return {**row, "draft_step_s": steps["draft_step_s"][gamma], "verify_step_s": steps["verify_step_s"][gamma],
            "verify_cost_ratio": verify_cost, "predicted_speedup": predicted,
            "measured_over_predicted": decode_speedup / predicted,
            "measured_over_predicted_factors": ratio_factors(measured["alpha"], gamma, c, verify_cost,
                                                             measured["decode_tokens_per_target_call"], decode_speedup)}


def peer_runners(args, target, prompts):
    """llama.cpp's modes on the same GGUF files and prompts, as time_generation runners; a chat turn as
    text, its markers spelled out (llama.cpp reads them as the special tokens they are)."""
    texts = {tuple(ids): target.tokenizer.decode(chat_prompt(target.tokenizer, p)) if args.chat else p
             for ids, p in zip(prompts, read_prompts(args))}
    return llamacpp.peer_runners(args.llama_cpp, args.target, args.draft, texts, args.max_new_tokens,
                                 torch.get_num_threads(), args.seed, args.ignore_eos)


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


def plain_and_speculative(args, target, draft, variants):
    """Rows {"name", "plain", "speculative" (tokens/s), "identical"} for variants {name: (prompts or batches of
    them, generate's extra settings)}, each timed plain and with --draft, in turns."""
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
    return [{"name": name, "plain": timed[name, "plain"]["tokens_per_second"],
             "speculative": timed[name, "speculative"]["tokens_per_second"],
             "identical": timed[name, "plain"]["stats"] == timed[name, "speculative"]["stats"]} for name in variants]


def flat(outs):  # generate's answers as one list: a batch's and n answers each included
    return [o for out in outs for o in (flat(out) if isinstance(out, list) else [out])]


def batch_benchmark(args):
    """Tokens/s of B requests decoded together, plain and speculative, per B."""
    target, draft, prompts = models_and_prompts(args)
    rows = plain_and_speculative(args, target, draft, {
        b: ([[prompts[i % len(prompts)] for i in range(b)]], {"batch_size": b}) for b in args.batch_sizes})
    rows = [{"batch": r["name"], "plain_tokens_per_second": r["plain"], "speculative_tokens_per_second":
             r["speculative"], "identical": r["identical"] if args.temperature == 0 else None} for r in rows]
    first, base = min((r["batch"], r["plain_tokens_per_second"]) for r in rows)
    table = md_table([("batch", "{batch}"), ("plain tok/s", "{plain_tokens_per_second:.1f}"),
                      (f"x batch {first}", lambda r: f"{r['plain_tokens_per_second'] / base:.2f}x"),
                      ("speculative tok/s", "{speculative_tokens_per_second:.1f}"), ("x plain", lambda r:
                       f"{r['speculative_tokens_per_second'] / r['plain_tokens_per_second']:.2f}x"),
                      ("same outputs", "{identical}")], rows)
    head = title(args, target, f"gamma {args.gamma[0]}", f"median of {args.repeats}")
    return {"settings": vars(args), "batches": rows}, "\n".join([head, "", *table])


def features_benchmark(args):
    """Each feature (logprobs, penalties, a JSON schema, n, the couplings) plain and with --draft, against the
    same request without it."""
    target, draft, prompts = models_and_prompts(args)
    rows = plain_and_speculative(args, target, draft, {name: (prompts, extra) for name, extra in FEATURES.items()})
    rows = [{"feature": r["name"], "plain": r["plain"], "speculative": r["speculative"],  # rows[0]: "none"
             "plain_cost": r["plain"] / rows[0]["plain"], "speculative_cost": r["speculative"] / rows[0]["speculative"],
             "identical": None if "temperature" in FEATURES[r["name"]] else r["identical"]} for r in rows]
    table = md_table([("feature", "{feature}"), ("plain tok/s", "{plain:.1f}"), ("x without it", "{plain_cost:.2f}x"),
                      ("speculative tok/s", "{speculative:.1f}"), ("x without it", "{speculative_cost:.2f}x"),
                      ("x plain", lambda r: f"{r['speculative'] / r['plain']:.2f}x"), ("same output", "{identical}")],
                     rows)
    head = title(args, target, f"gamma {args.gamma[0]}", f"median of {args.repeats}")
    return {"settings": vars(args), "features": rows}, "\n".join([head, "", *table])


def beam_benchmark(args):
    """Beam search of width W, plain against speculative (each --gamma) per prompt: the median and the
    fastest request."""
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
    lines = [title(args, target, f"beam search of width {args.beams} (draft beams {args.draft_beams or args.beams})",
                   f"{args.repeats} rounds"), ""]
    lines += md_table([("prompt", "{prompt}"), ("γ", "{gamma}"), ("plain s", "{plain_seconds:.2f}"),
                       ("speculative s", "{seconds:.2f}"), ("x plain (median)", "{speedup_median:.2f}x"),
                       ("x plain (fastest)", "{speedup_fastest:.2f}x"),
                       ("target calls (plain)", "{target_calls} ({plain_target_calls})"),
                       ("guesses per step", "{guesses_histogram}"), ("same result", "{identical}")], rows)
    return {"settings": vars(args), "beams": rows}, "\n".join(lines)
