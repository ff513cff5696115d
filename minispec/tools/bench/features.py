"""--features: what each of generate()'s features costs, plain and speculative, against the same request
without it (nothing is given up under speculation)."""

from .benchmarks import models_and_prompts, plain_and_speculative, title
from .report import md_table, yes_no

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


def features_benchmark(args):
    """Tokens/s of each FEATURES row plain and with --draft, the median of --repeats rounds."""
    target, draft, prompts = models_and_prompts(args)
    variants = {name: (prompts, extra) for name, extra in FEATURES.items()}
    rate, same = plain_and_speculative(args, target, draft, variants)
    rows = [{"feature": name, "plain": rate[name, "plain"], "speculative": rate[name, "speculative"],
             "plain_cost": rate[name, "plain"] / rate["none", "plain"],
             "speculative_cost": rate[name, "speculative"] / rate["none", "speculative"],
             "identical": None if "temperature" in FEATURES[name] else same[name]} for name in FEATURES]
    lines = [title(args, target), ""] + md_table(
        ["feature", "plain tok/s", "x without it", "speculative tok/s", "x without it", "x plain", "same output"],
        ([r["feature"], f"{r['plain']:.1f}", f"{r['plain_cost']:.2f}x", f"{r['speculative']:.1f}",
          f"{r['speculative_cost']:.2f}x", f"{r['speculative'] / r['plain']:.2f}x", yes_no(r["identical"])]
         for r in rows))
    return {"settings": vars(args), "features": rows}, "\n".join(lines)
