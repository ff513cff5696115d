"""--features: what each of generate()'s features costs, plain and speculative, against the same request
without it (issue: nothing given up under speculation), side by side in turns as time_generation runs them."""

from minispec import generate
from minispec.loaders import load_models

from .benchmarks import decoding_settings
from .prompts import prompt_ids_of, read_prompts
from .report import dtype_name, md_table, yes_no
from .timing import time_generation

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}
# feature -> the settings it adds to the request; a grammar ends at EOS (it refuses ignore_eos)
FEATURES = {
    "none": {},
    "logprobs=5": {"logprobs": 5},
    "penalties, min_p": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1, "min_p": 0.05},
    "JSON schema": {"grammar": {"json_schema": SCHEMA}, "ignore_eos": False},
    "n=2": {"n": 2},
    "sampled, gumbel": {"temperature": 0.8, "coupling": "gumbel"},
    "sampled, rejection": {"temperature": 0.8, "coupling": "rejection"},
}


def runner(target, prompts, args, extra, draft=None):
    def run_one(_):
        outs = [generate(target, prompt, draft=draft, gamma=args.gamma[0], seed=args.seed,
                         **{**decoding_settings(args), **extra}) for prompt in prompts]
        outs = [o for out in outs for o in (out if isinstance(out, list) else [out])]  # n answers
        return [t for out in outs for t in out.tokens], {"outputs": [out.tokens for out in outs]}
    return run_one


def features_benchmark(args):
    """Tokens/s of each FEATURES row plain and with --draft, the median of --repeats rounds."""
    target, draft = load_models(args)
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    runs = {(name, mode): runner(target, prompts, args, extra, draft if mode == "speculative" else None)
            for name, extra in FEATURES.items() for mode in ("plain", "speculative")}
    timed = time_generation(runs, [None], args.repeats, target.device)
    rate = {key: value["tokens_per_second"] for key, value in timed.items()}
    rows = [{"feature": name, "plain": rate[name, "plain"], "speculative": rate[name, "speculative"],
             "plain_cost": rate[name, "plain"] / rate["none", "plain"],
             "speculative_cost": rate[name, "speculative"] / rate["none", "speculative"],
             "identical": timed[name, "plain"]["stats"] == timed[name, "speculative"]["stats"]
             if "temperature" not in FEATURES[name] else None} for name in FEATURES]
    lines = [f"target `{args.target}`, draft `{args.draft}` (gamma {args.gamma[0]}) on {target.device} "
             f"({dtype_name(target)}), {args.max_new_tokens} new tokens a request, median of {args.repeats}", ""]
    lines += md_table(["feature", "plain tok/s", "x without it", "speculative tok/s", "x without it", "x plain",
                       "same output"],
                      ([r["feature"], f"{r['plain']:.1f}", f"{r['plain_cost']:.2f}x", f"{r['speculative']:.1f}",
                        f"{r['speculative_cost']:.2f}x", f"{r['speculative'] / r['plain']:.2f}x",
                        yes_no(r["identical"])] for r in rows))
    return {"settings": vars(args), "features": rows}, "\n".join(lines)
