"""Benchmark: autoregressive vs speculative decoding side by side, against the paper's Theorem 3.8.

    python -m minispec.bench --target gpt2-large --draft gpt2 --gamma 2 4 8
    python -m minispec.bench --target ./ckpt --draft lookup --prompt-ids 1,2,3,1,2 --compare-reference

For each γ it measures tokens/s of both decoders (median of --repeats timed passes over all prompts,
after one warm-up pass), end to end and for the decode phase after the prompt's forward; the measured
α, acceptance rate and tokens per target call; the cost ratio c = draft step / target step and the
verify cost of a (γ+1)-token target forward. It puts the decode-phase speedup next to Theorem 3.8's
prediction (1 - α^(γ+1)) / ((1 - α)(γc + 1)), splits their ratio into the factors that make it up,
and gives the γ that section 3.5 would pick. On CUDA it adds the target decode step's memory bandwidth
against the GPU's peak; with --memory-tokens, the peak memory of a short and a long generation.
Prints a markdown table and writes everything to a JSON file.

--compare-reference runs the reference implementation (transformers, imported only then) on the same
checkpoints and prompts: its greedy/sampled `generate` and its assisted generation, timed the same way.
"""

import argparse
import json
import re
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from functools import partial

import torch
from torch import nn

from .chat import chat_prompt
from .checkpoint import resolve_checkpoint
from .cli import gamma_setting, load_target_and_draft, token_ids
from .drafters import SELF_DRAFT_MODES, make_drafter
from .api import generate, prompt_tensor
from .models import base, quant
from .models.base import CachedLM
from .models.quant import Int8Embedding
from .sampling import Sampling
from .weights import DTYPES

CODE = '''def moving_average(values, window):
    result = []
    for i in range(len(values) - window + 1):
        total = 0
        for j in range(i, i + window):
            total += values[j]
        result.append(total / window)
    return result'''

# Two open-ended prompts and one that asks to rewrite code: the output then repeats much of the
# prompt, which is where the model-free `lookup` drafter shines. `--prompts code` or `--prompts open`
# picks one kind.
OPEN_PROMPTS = [
    "The history of the printing press begins in",
    "Question: Why is the sky blue? Explain it to a ten-year-old.\nAnswer:",
]
CODE_PROMPTS = [
    f"Rewrite this Python function with type hints and a docstring, keeping its logic:\n\n{CODE}\n\nRewritten:\n",
]
DEFAULT_PROMPTS = OPEN_PROMPTS + CODE_PROMPTS
BUILTIN_PROMPTS = {"open": OPEN_PROMPTS, "code": CODE_PROMPTS}

# Peak DRAM bandwidth in bytes/s from vendor datasheets, matched against torch.cuda.get_device_name();
# the first pattern that matches wins (so the specific variants come first).
PEAK_BANDWIDTH = [
    (r"\bh200\b", 4.8e12),
    (r"\bh100\b.*pcie", 2.0e12),
    (r"\bh100\b.*nvl", 3.9e12),
    (r"\bh100\b", 3.35e12),  # SXM, HBM3
    (r"\ba100\b.*80gb.*pcie", 1.935e12),
    (r"\ba100\b.*80gb", 2.039e12),
    (r"\ba100\b", 1.555e12),  # 40GB
    (r"\bl40s\b", 0.864e12),
    (r"\bl4\b", 0.3e12),
    (r"\ba10g?\b", 0.6e12),
    (r"\brtx 4090\b", 1.008e12),
    (r"\bv100\b", 0.9e12),
]

STEP_SAMPLES = 25  # forwards timed per step-time median


# --- the paper's model ------------------------------------------------------------------------------
def predicted_speedup(alpha, gamma, c):
    """Theorem 3.8: expected walltime improvement (1 - α^(γ+1)) / ((1 - α)(γc + 1))."""
    if alpha >= 1:  # the limit: every guess accepted, γ + 1 tokens per target call
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def ratio_factors(alpha, gamma, c, verify_cost, tokens_per_call, decode_speedup):
    """Measured ÷ predicted as a product of three factors, to tell where a shortfall comes from:
    the drafter's tokens per target call against the theorem's i.i.d. expectation
    (1 - α^(γ+1)) / (1 - α); the theorem's cost of a call, 1 + γc target steps, against the measured
    verify cost + γc; and the measured speedup against the one those tokens and costs imply, which
    leaves what neither models: the loop's own work and host syncs."""
    modelled = tokens_per_call / (verify_cost + gamma * c)
    return {"tokens_per_call": tokens_per_call / predicted_speedup(alpha, gamma, 0.0),
            "verify_cost": (1 + gamma * c) / (verify_cost + gamma * c), "loop": decode_speedup / modelled}


def best_gamma(alpha, c, max_gamma=16):
    """Section 3.5: the integer γ in 1..max_gamma maximizing Theorem 3.8; returns (γ, its speedup).
    A speedup below 1 means no γ helps (Corollary 3.9: speculation wins iff α > c)."""
    return max(((g, predicted_speedup(alpha, g, c)) for g in range(1, max_gamma + 1)), key=lambda gs: gs[1])


# --- timing -----------------------------------------------------------------------------------------
def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_times(fns, device, samples=STEP_SAMPLES, warmup=3):
    """{name: median seconds of fn()} over `samples` rounds in which every fn runs once in turn, so
    a slow phase of the machine hits all alike; `warmup` untimed rounds first (compilation, caches)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(samples):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


class PrefillClock:
    """Stands in for a model's decode_rows and notes when a request's prefill (a forward from position
    0) returns, its device work done. A generation's time after that is its decode time, and the tokens
    after the prefill's are its decode tokens: the part Theorem 3.8 is about. The prompt's forward (and
    a T5 encoder's, which runs before it) costs about the same with or without speculation (which
    verifies its first guesses in it)."""

    def __init__(self, model):
        self.model, self.decode_rows, self.finished_at = model, model.decode_rows, None

    def __call__(self, tokens, lengths, *args, **kwargs):
        logits = self.decode_rows(tokens, lengths, *args, **kwargs)
        if not any(lengths):
            synchronize(self.model.device)
            self.finished_at = time.perf_counter()
        return logits


def time_generation(runners, requests, repeats, device):
    """Time several decoders side by side: one warm-up pass over the requests each, then `repeats`
    rounds in which every runner makes one timed pass in turn, so machine drift hits all alike.

    runners: {name: run_one}, run_one(request) -> (generated ids, stats dict); stats may hold
    "prefill_seconds" and "first_call_tokens" (the tokens out of the prefill). Returns {name: median
    tokens/s over the rounds (and, where prefill times are known, median tokens/s of the decode
    phase), each round's, and the outputs and stats of the last}."""
    for run_one in runners.values():
        for request in requests:
            run_one(request)
    rates = {name: [] for name in runners}
    decode_rates = {name: [] for name in runners}
    request_seconds = {name: [[] for _ in requests] for name in runners}
    for _ in range(repeats):
        last = {}
        for name, run_one in runners.items():
            results, seconds = [], 0.0
            for i, request in enumerate(requests):
                synchronize(device)
                start = time.perf_counter()
                results.append(run_one(request))
                synchronize(device)
                request_seconds[name][i].append(time.perf_counter() - start)
                seconds += request_seconds[name][i][-1]
            tokens = sum(len(tokens) for tokens, _ in results)
            rates[name].append(tokens / seconds)
            if all("prefill_seconds" in stats for _, stats in results):  # the decode phase: after the prefill
                decode_tokens = tokens - sum(stats["first_call_tokens"] for _, stats in results)
                decode_seconds = seconds - sum(stats["prefill_seconds"] for _, stats in results)
                decode_rates[name].append(decode_tokens / decode_seconds)
            last[name] = results
    return {name: {"tokens_per_second": statistics.median(rates[name]), "tokens_per_second_repeats": rates[name],
                   "decode_tokens_per_second": statistics.median(decode_rates[name]) if decode_rates[name] else None,
                   "request_seconds": [statistics.median(t) for t in request_seconds[name]],
                   "request_seconds_fastest": [min(t) for t in request_seconds[name]],
                   "outputs": [tokens for tokens, _ in last[name]], "stats": [stats for _, stats in last[name]]}
            for name in runners}


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
    """Median seconds of the forwards Theorem 3.8 is about, with prompt + `generated` in the caches:
    a 1-token target decode (one autoregressive step), a (γ+1)-token one (one verification) and one
    draft step. A model drafter's step is a 1-token decode; a model-free drafter's is its time to
    propose γ guesses, divided by γ. Returns {"position", "target_step_s", "verify_step_s": {γ: s},
    "draft_step_s": {γ: s}, "draft_bandwidth": a draft model's bytes per step and bytes/s, or None}."""
    if draft in SELF_DRAFT_MODES:  # the target's quantized copy: a model drafter
        draft = make_drafter(draft, target).model
    device = target.device
    start = target.encode(prompt_ids)
    if target.context_length is not None:  # keep the (γ+1)-token forward inside the context
        generated = generated[:max(target.context_length - start.shape[1] - max(gammas) - 1, 0)]
    generated = torch.tensor([generated], dtype=torch.long, device=device).view(1, -1)
    prefix = torch.cat([start, generated], dim=1)
    steps = decode_steps(target, prefix, [1] + [g + 1 for g in gammas])
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
            "verify_step_s": {g: times["target", g + 1] for g in gammas}, "draft_step_s": draft_step,
            "draft_bandwidth": bandwidth(draft, prefix.shape[1], times["draft", 1])
            if isinstance(draft, CachedLM) else None}


@contextmanager
def without_row_invariance(model):
    """The model computing as it did before row invariance (models/base.py): BLAS linears and attention
    rows unpadded. Only to measure what row invariance costs."""
    packed = [module for module in model.modules() if getattr(module, "packed", False)]
    block = base.ATTENTION_ROW_BLOCK
    for module in packed:
        module.packed = False
    base.ATTENTION_ROW_BLOCK = 1
    try:
        yield
    finally:
        for module in packed:
            module.packed = True
        base.ATTENTION_ROW_BLOCK = block


@torch.inference_mode()
def row_invariance_price(target, prefix, widths=(1, 4, 9), rounds=3):
    """Median seconds of target forwards over 1, 4 and 9 tokens with row invariance and without, in
    interleaved rounds (the fastest round of each kept): {"with": {n: s}, "without": {n: s}}."""
    steps = decode_steps(target, prefix, list(widths))
    times = {"with": {}, "without": {}}
    for _ in range(rounds):
        for name in times:
            with nullcontext() if name == "with" else without_row_invariance(target):
                for n, seconds in median_times(steps, target.device).items():
                    times[name][n] = min(times[name].get(n, float("inf")), seconds)
    return times


def policy_summary(stats):
    """gamma="auto" over all requests: steps per number of guesses, the mean, expected vs measured tokens
    per target call, and the last request's cost model (its timings carry over between requests)."""
    histogram = [sum(column) for column in zip(*(s["guesses_histogram"] for s in stats))]
    steps = sum(histogram)
    return {
        "guesses_histogram": histogram,
        "mean_guesses": sum(k * n for k, n in enumerate(histogram)) / steps,
        "expected_tokens_per_call": sum(s["expected_tokens_per_call"] * s["target_calls"] for s in stats) / steps,
        "cost_model": stats[-1]["cost_model"],
        "alpha_estimate": stats[-1]["alpha_estimate"],
        "acceptance_by_confidence": stats[-1]["acceptance_by_confidence"],
    }


def speculative_summary(stats):
    """Pool per-prompt speculative stats: α weighted by verified positions, as in speculative.py; tokens
    per target call overall and in the decode phase (the calls after the prompt's forward)."""
    verified = sum(s["verified"] for s in stats)
    tokens, calls = sum(s["new_tokens"] for s in stats), sum(s["target_calls"] for s in stats)
    decode_calls = calls - len(stats)
    decode_tokens = tokens - sum(s["first_call_tokens"] for s in stats)
    return {
        "alpha": sum(s["alpha"] * s["verified"] for s in stats) / verified if verified else 0.0,
        "acceptance_rate": sum(s["accepted"] for s in stats) / verified if verified else 0.0,
        "tokens_per_target_call": tokens / calls,
        "decode_tokens_per_target_call": decode_tokens / decode_calls if decode_calls else tokens / calls,
    }


# --- memory bandwidth -------------------------------------------------------------------------------
def decode_bytes(model, length):
    """Bytes one decode step must read: every decoder weight once, as stored (a quantized layer's int8
    or packed int4 weight and its scales; an encoder-decoder's encoder runs once per request, not per
    token), but of an embedding table only the looked-up row, unless the table is also the output head
    (tied); plus the self-attention keys and values of `length` positions (of the one cache row a
    request decodes in, however many rows the caches hold)."""
    weights = 0
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():  # parameters and persistent buffers: the weights
        owner = modules[name.rpartition(".")[0]]
        if model.is_encoder_decoder and name.startswith("encoder"):
            continue
        looked_up = isinstance(owner, (nn.Embedding, Int8Embedding)) and owner is not model.head
        numel = tensor.numel() // owner.num_embeddings if looked_up else tensor.numel()  # a row's share
        weights += numel * tensor.element_size()
    return weights + model.kv_bytes_per_position() * length  # one request: one cache row


def peak_bandwidth(device_name):
    """Datasheet peak bytes/s for a known GPU name, else None."""
    name = device_name.lower()
    return next((peak for pattern, peak in PEAK_BANDWIDTH if re.search(pattern, name)), None)


def bandwidth(target, position, step_seconds):
    """The bytes the target's decode step reads, its achieved bandwidth and, on a GPU with a known
    datasheet, the fraction of the peak that is."""
    cuda = target.device.type == "cuda"
    device_name = torch.cuda.get_device_name(target.device) if cuda else str(target.device)
    size = decode_bytes(target, position)
    achieved = size / step_seconds
    peak = peak_bandwidth(device_name) if cuda else None
    return {"device_name": device_name, "bytes_per_step": size, "achieved_bytes_per_s": achieved,
            "peak_bytes_per_s": peak, "fraction_of_peak": achieved / peak if peak else None}


# --- peak memory ------------------------------------------------------------------------------------
def tensor_memory(device, fn):
    """(peak, kept): bytes of the tensors fn() allocates on `device`, the most alive at once while it
    runs and those still alive when it returns, both counted from what was alive when it began (so a
    tensor from before that it frees counts as minus its size). CUDA: the caching allocator's counters.
    CPU: every allocation and free, from torch.profiler's memory events in time order; the process's
    resident set would hide a decoding loop that keeps a few kilobytes per step under the weights, the
    allocator's slack and Python's own memory."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # The raw events, as torch's own parser reads them: the FunctionEvents it builds fold each
    # allocation into the operator that made it, which loses the order within an operator.
    events = [event for event in prof.profiler.kineto_results.events()
              if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        live += event.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak, live


def memory_growth(target, draft, gamma, prompt, long_tokens, short_tokens=16):
    """Tensor memory of a short and a long generation on the same preallocated caches: a lean decoding
    loop allocates nothing that grows with the number of steps, so the two peaks are equal, and after
    either it keeps nothing but what the next request replaces."""
    def run(n):
        return lambda: generate(target, prompt, draft=draft, gamma=gamma, max_new_tokens=n, ignore_eos=True)

    run(long_tokens)()  # allocates the caches (and compiles) once, for both measurements
    (peak_short, kept_short), (peak_long, kept_long) = (tensor_memory(target.device, run(n))
                                                        for n in (short_tokens, long_tokens))
    return {"short_tokens": short_tokens, "long_tokens": long_tokens, "peak_short_bytes": peak_short,
            "peak_long_bytes": peak_long, "kept_short_bytes": kept_short, "kept_long_bytes": kept_long,
            "growth": peak_long / peak_short - 1 if peak_short else None}


# --- the reference implementation -------------------------------------------------------------------
def load_reference(name_or_path, device, dtype):
    """The same checkpoint directory in transformers (imported only here: it is a test-only dependency)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--compare-reference needs the reference implementation: pip install transformers") from None
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    directory = resolve_checkpoint(name_or_path)
    config = transformers.AutoConfig.from_pretrained(directory)
    auto = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    # .to(dtype) too: versions before `dtype=` was accepted ignore it and load float32.
    return auto.from_pretrained(directory, dtype=dtype).to(device=device, dtype=dtype).eval()


def reference_runner(model, args, gamma=None, draft=None):
    """run_one for time_generation: the reference's generate with the same length and sampling settings.
    gamma None: autoregressive; else assisted generation with `draft` (a reference model) or, without
    one, prompt lookup (our `lookup` drafter's counterpart), γ guesses per step."""
    settings = dict(max_new_tokens=args.max_new_tokens, do_sample=args.temperature > 0)
    if args.ignore_eos:
        # Generate through EOS like minispec does; min_new_tokens would forbid EOS, changing the tokens.
        settings.update(eos_token_id=None, pad_token_id=0)
    if args.temperature > 0:
        settings.update(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    if gamma is not None and draft is None:  # LookupDrafter's max_ngram; for "auto", the reference's usual 10
        settings.update(prompt_lookup_num_tokens=10 if gamma == "auto" else gamma, max_matching_ngram_size=3)

    @torch.inference_mode()
    def run_one(request):
        prompt, seed = request
        assist = {}
        if draft is not None:
            # Exactly γ guesses per step like Algorithm 1; for "auto", its adaptive defaults (the
            # heuristic schedule and a confidence threshold). The assistant's own generation_config
            # holds these, so set them on every call.
            config = draft.generation_config
            if gamma == "auto":
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = 20, "heuristic"
                config.assistant_confidence_threshold = 0.4
            else:
                config.num_assistant_tokens, config.num_assistant_tokens_schedule = gamma, "constant"
                config.assistant_confidence_threshold = 0.0
            assist["assistant_model"] = draft
        ids = torch.tensor([prompt], device=model.device)
        torch.manual_seed(seed)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **settings, **assist)[0].tolist()
        # Decoder-only outputs repeat the prompt; encoder-decoder ones start with the decoder start token.
        return out[1 if model.config.is_encoder_decoder else len(prompt):], {}

    return run_one


def reference_runners(args, device, dtype):
    """{("reference", γ or None): run_one}: the reference's autoregressive and assisted generation
    (none for `ngram`, which it lacks)."""
    model = load_reference(args.target, device, dtype)
    runners = {("reference", None): reference_runner(model, args)}
    if args.draft == "ngram":
        return runners
    draft = None if args.draft == "lookup" else load_reference(args.draft, device, dtype)
    runners.update({("reference", g): reference_runner(model, args, g, draft) for g in args.gamma})
    return runners


# --- the command line -------------------------------------------------------------------------------
def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m minispec.bench",
                                     description="Autoregressive vs speculative decoding, against Theorem 3.8.")
    parser.add_argument("--target", required=True, help="checkpoint directory or Hugging Face hub id")
    parser.add_argument("--draft", required=True,
                        help="checkpoint directory or hub id, 'ngram', 'lookup', or 'int8' / 'int4' (the target "
                             "quantized)")
    parser.add_argument("--quantize", choices=quant.MODES, help="weight-only quantization of the target (run.py's)")
    parser.add_argument("--draft-quantize", choices=quant.MODES, help="the same for a draft model")
    parser.add_argument("--group-size", type=int, choices=quant.GROUP_SIZES, default=quant.DEFAULT_GROUP_SIZE,
                        help="columns per int4 scale")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", metavar="FILE",
                         help="a JSON list of prompts (strings or lists of token ids), one text prompt per line, "
                              "or a built-in set: 'open' or 'code' (default: both)")
    prompts.add_argument("--prompt-ids", type=token_ids, action="append",
                         help="a prompt as comma-separated token ids; repeat the flag for several prompts")
    parser.add_argument("--gamma", type=gamma_setting, nargs="+", default=["auto"],
                        help="one table row per value: a number of guesses per step, or 'auto' (chosen per step)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the most likely tokens of this mass")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="generate each prompt with seeds --seed .. --seed+N-1: sampled runs then average "
                             "over N samples per prompt instead of timing one sample again and again")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="always generate --max-new-tokens tokens (default on: equal-length runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (minispec.load(compile=True))")
    parser.add_argument("--compare-reference", action="store_true",
                        help="also time the reference implementation (transformers) and compare its outputs")
    parser.add_argument("--chat", action="store_true",
                        help="wrap text prompts in the checkpoint's chat template (instruct models)")
    parser.add_argument("--memory-tokens", type=int, default=0, metavar="N",
                        help="also compare peak memory of a 16-token and an N-token speculative generation "
                             "(the first γ, the first prompt): it must not grow with the number of steps")
    parser.add_argument("--row-invariance-price", action="store_true",
                        help="also time 1-, 4- and 9-token target forwards without row invariance (BLAS "
                             "linears, unpadded attention rows) beside the usual ones")
    parser.add_argument("--batch-sizes", type=int, nargs="+", metavar="B",
                        help="instead of the table above: total new tokens/s of B requests decoded together "
                             "(the prompts repeated to B), plain and speculative (the first --gamma), per B")
    parser.add_argument("--beams", type=int, metavar="W",
                        help="instead of the table above: beam search of width W, plain against speculative "
                             "(each --gamma) per prompt, wall clock")
    parser.add_argument("--draft-beams", type=int, metavar="U", help="the draft's beam width (default: W)")
    parser.add_argument("--json-out", default="bench.json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.memory_tokens and args.memory_tokens <= 16:
        raise ValueError(f"--memory-tokens must be more than 16, got {args.memory_tokens}")
    if any(g != "auto" and g < 1 for g in args.gamma):
        raise ValueError(f"--gamma values must be >= 1 or 'auto', got {args.gamma}")
    if args.beams is not None and args.beams < 1:
        raise ValueError(f"--beams must be >= 1, got {args.beams}")
    if args.batch_sizes and args.beams:
        raise ValueError("--batch-sizes and --beams are separate benchmarks: give one")
    if args.batch_sizes and min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.seeds < 1:
        raise ValueError("--repeats, --max-new-tokens and --seeds must be >= 1")
    sampling_of(args)  # bad sampling settings fail before loading weights
    return args


def sampling_of(args):
    return Sampling(args.temperature, args.top_k, args.top_p)


def read_prompts(args):
    """Prompts as given (text or id lists): --prompt-ids, --prompts FILE, or the built-in ones."""
    if args.prompt_ids:
        return args.prompt_ids
    if args.prompts is None:
        return DEFAULT_PROMPTS
    if args.prompts in BUILTIN_PROMPTS:
        return BUILTIN_PROMPTS[args.prompts]
    try:
        with open(args.prompts) as f:
            text = f.read()
    except OSError as error:
        raise ValueError(f"--prompts {args.prompts}: {error.strerror}") from None
    try:
        prompts = json.loads(text)
    except json.JSONDecodeError:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not isinstance(prompts, list) or not prompts or not all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts):
        raise ValueError(f"--prompts {args.prompts}: expected a non-empty JSON list of strings or token-id lists, "
                         "or one prompt per line")
    return prompts


def prompt_ids_of(target, prompt, chat=False):
    """Token ids of a prompt; text prompts become the user's turn of a chat when `chat` is set."""
    if isinstance(prompt, str) and target.tokenizer is None:
        raise ValueError(f"{target.name} has no tokenizer files: give prompts as token ids "
                         "(--prompt-ids, or a --prompts JSON file of id lists)")
    if isinstance(prompt, str) and chat:
        prompt = chat_prompt(target.tokenizer, prompt)
    return prompt_tensor(target, prompt)[0].tolist()


def minispec_runner(target, draft, gamma, args, prefill_clock):
    """run_one for time_generation: one (prompt ids, seed) request through minispec.generate."""
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, ignore_eos=args.ignore_eos)

    def run_one(request):
        prompt, seed = request
        start = time.perf_counter()
        out = generate(target, prompt, draft=draft, gamma=gamma, seed=seed, **settings)
        return out.tokens, dict(out.stats, prefill_seconds=prefill_clock.finished_at - start)

    return run_one


def benchmark(args):
    target, draft = load_target_and_draft(args.target, args.draft, args.device, DTYPES.get(args.dtype),
                                          args.compile, args.quantize, args.draft_quantize, args.group_size)
    device = target.device
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    target.decode_rows = prefill_clock = PrefillClock(target)
    runners = {("minispec", None): minispec_runner(target, None, 1, args, prefill_clock)}
    runners.update({("minispec", g): minispec_runner(target, draft, g, args, prefill_clock) for g in args.gamma})
    if args.compare_reference:
        runners.update(reference_runners(args, device, target.dtype))
    requests = [(prompt, args.seed + i) for prompt in prompts for i in range(args.seeds)]
    timed = time_generation(runners, requests, args.repeats, device)

    ar = timed["minispec", None]
    first = ar["outputs"][0]
    fixed = sorted({g for g in args.gamma if g != "auto"} | {1})  # "auto" rows use γ = 1's draft step
    steps = step_times(target, draft, torch.tensor([prompts[0]], device=device), first[:len(first) // 2],
                       fixed, sampling_of(args))
    greedy = args.temperature == 0
    result = {
        "settings": {"target": args.target, "draft": args.draft, "gammas": args.gamma,
                     "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                     "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
                     "ignore_eos": args.ignore_eos, "repeats": args.repeats, "device": str(device),
                     "dtype": str(target.dtype).removeprefix("torch."), "compile": args.compile,
                     "quantize": args.quantize, "draft_quantize": args.draft_quantize, "group_size": args.group_size,
                     "prompts": len(prompts), "seeds": args.seeds},
        "autoregressive": {k: ar[k] for k in ("tokens_per_second", "tokens_per_second_repeats",
                                              "decode_tokens_per_second", "request_seconds",
                                              "request_seconds_fastest", "outputs")},
        "prefill_s": statistics.mean(s["prefill_seconds"] for s in ar["stats"]),
        "target_step_s": steps["target_step_s"],
        "step_position": steps["position"],
        "memory_bandwidth": bandwidth(target, steps["position"], steps["target_step_s"]),
        "draft_memory_bandwidth": steps["draft_bandwidth"],
        "memory": memory_growth(target, draft, args.gamma[0], prompts[0], args.memory_tokens)
        if args.memory_tokens else None,
        "row_invariance_price": row_invariance_price(target, target.encode(torch.tensor([prompts[0]], device=device)))
        if args.row_invariance_price else None,
        "rows": [],
    }
    for gamma in args.gamma:
        spec = timed["minispec", gamma]
        measured = speculative_summary(spec["stats"])
        c = steps["draft_step_s"][1 if gamma == "auto" else gamma] / steps["target_step_s"]
        speedup = spec["tokens_per_second"] / ar["tokens_per_second"]
        decode_speedup = spec["decode_tokens_per_second"] / ar["decode_tokens_per_second"]
        best, best_speedup = best_gamma(measured["alpha"], c)
        row = {
            "gamma": gamma, "tokens_per_second": spec["tokens_per_second"],
            "tokens_per_second_repeats": spec["tokens_per_second_repeats"], "speedup": speedup,
            "decode_tokens_per_second": spec["decode_tokens_per_second"], "decode_speedup": decode_speedup,
            **measured, "c": c, "best_gamma": best, "best_gamma_predicted_speedup": best_speedup,
            # Greedy speculative decoding must reproduce greedy autoregressive decoding exactly.
            "identical_to_autoregressive": spec["outputs"] == ar["outputs"] if greedy else None,
            "per_prompt_speedup": [a / s for a, s in zip(ar["request_seconds"], spec["request_seconds"])],
            # Other work on a shared machine only ever slows a run down: the fastest rounds are steadier.
            "per_prompt_speedup_fastest": [a / s for a, s in zip(ar["request_seconds_fastest"],
                                                                 spec["request_seconds_fastest"])],
            "outputs": spec["outputs"],
        }
        if gamma == "auto":
            # No single γ to predict for: section 3.5's best fixed γ is the prediction to beat.
            row.update(policy_summary(spec["stats"]), predicted_speedup=best_speedup,
                       measured_over_predicted=decode_speedup / best_speedup)
        else:
            predicted = predicted_speedup(measured["alpha"], gamma, c)
            verify_cost = steps["verify_step_s"][gamma] / steps["target_step_s"]
            row.update(
                draft_step_s=steps["draft_step_s"][gamma], verify_step_s=steps["verify_step_s"][gamma],
                verify_cost_ratio=verify_cost,
                # Theorem 3.8 models the decode phase; the prompt's forward is the same in both decoders.
                predicted_speedup=predicted, measured_over_predicted=decode_speedup / predicted,
                measured_over_predicted_factors=ratio_factors(measured["alpha"], gamma, c, verify_cost,
                                                              measured["decode_tokens_per_target_call"],
                                                              decode_speedup))
        result["rows"].append(row)
    if args.compare_reference:
        ref = timed["reference", None]
        result["reference"] = {
            "autoregressive": {"tokens_per_second": ref["tokens_per_second"],
                               "identical": ref["outputs"] == ar["outputs"] if greedy else None},
            "assisted": [{"gamma": g, "tokens_per_second": timed["reference", g]["tokens_per_second"],
                          "speedup": timed["reference", g]["tokens_per_second"] / ref["tokens_per_second"],
                          "identical": timed["reference", g]["outputs"] == ar["outputs"] if greedy else None}
                         for g in args.gamma if ("reference", g) in timed],
        }
    return result


def batch_benchmark(args):
    """Total new tokens per second of B requests at once, plain and speculative, for each B: the median
    of --repeats runs, taken in turn (B, plain / speculative) so that drift hits all alike."""
    target, draft = load_target_and_draft(args.target, args.draft, args.device, DTYPES.get(args.dtype),
                                          args.compile, args.quantize, args.draft_quantize, args.group_size)
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    settings = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p, ignore_eos=args.ignore_eos, seed=args.seed)
    runs = {(b, name): [] for b in args.batch_sizes for name in ("plain", "speculative")}
    outputs = {}
    for repeat in range(args.repeats + 1):  # the first pass warms up (allocation, calibration)
        for b in args.batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            for name, extra in (("plain", {}), ("speculative", {"draft": draft, "gamma": args.gamma[0]})):
                start = time.perf_counter()
                outs = generate(target, batch, batch_size=b, **settings, **extra)
                seconds = time.perf_counter() - start
                outputs[b, name] = [out.tokens for out in outs]
                if repeat:
                    runs[b, name].append(sum(len(t) for t in outputs[b, name]) / seconds)
    base = statistics.median(runs[min(args.batch_sizes), "plain"])
    rows = [{"batch": b, "plain_tokens_per_second": statistics.median(runs[b, "plain"]),
             "speculative_tokens_per_second": statistics.median(runs[b, "speculative"]),
             "identical": outputs[b, "plain"] == outputs[b, "speculative"] if args.temperature == 0 else None}
            for b in args.batch_sizes]
    lines = [f"target `{args.target}`, draft `{args.draft}` (gamma {args.gamma[0]}) on {target.device} "
             f"({str(target.dtype).removeprefix('torch.')}), {args.max_new_tokens} new tokens a request, "
             f"median of {args.repeats}", "",
             "| batch | plain tok/s | x batch " + str(min(args.batch_sizes)) + " | speculative tok/s | "
             "x plain | same outputs |", "|---|---|---|---|---|---|"]
    for row in rows:
        plain, spec = row["plain_tokens_per_second"], row["speculative_tokens_per_second"]
        lines.append(f"| {row['batch']} | {plain:.1f} | {plain / base:.2f}x | {spec:.1f} | {spec / plain:.2f}x | "
                     f"{yes_no(row['identical'])} |")
    return {"settings": vars(args), "batches": rows}, "\n".join(lines)


def beam_benchmark(args):
    """Beam search, plain against speculative at each --gamma, per prompt: seconds per request, median
    and fastest of --repeats rounds taken in turn. On a shared machine other work only ever slows a run
    down, so the fastest is the better estimate of what each costs; the median shows the spread."""
    target, draft = load_target_and_draft(args.target, args.draft, args.device, DTYPES.get(args.dtype),
                                          args.compile, args.quantize, args.draft_quantize, args.group_size)
    prompts = [prompt_ids_of(target, p, args.chat) for p in read_prompts(args)]
    settings = dict(max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, beams=args.beams)
    runs = {"plain": {}, **{g: dict(draft=draft, draft_beams=args.draft_beams, gamma=g) for g in args.gamma}}
    seconds = {(name, i): [] for name in runs for i in range(len(prompts))}
    last = {}
    for repeat in range(args.repeats + 1):  # the first pass warms up (allocation, calibration)
        for i, prompt in enumerate(prompts):
            for name, extra in runs.items():
                synchronize(target.device)
                start = time.perf_counter()
                out = generate(target, prompt, **settings, **extra)
                synchronize(target.device)
                if repeat:
                    seconds[name, i].append(time.perf_counter() - start)
                last[name, i] = out
    rows = []
    for i in range(len(prompts)):
        plain = seconds["plain", i]
        for name in runs:
            if name == "plain":
                continue
            stats = last[name, i].stats
            rows.append({"prompt": i + 1, "gamma": name, "plain_seconds": statistics.median(plain),
                         "seconds": statistics.median(seconds[name, i]),
                         "speedup_median": statistics.median(plain) / statistics.median(seconds[name, i]),
                         "speedup_fastest": min(plain) / min(seconds[name, i]),
                         "target_calls": stats["target_calls"],
                         "plain_target_calls": last["plain", i].stats["target_calls"],
                         "guesses_histogram": stats.get("guesses_histogram"),
                         "identical": last[name, i].tokens == last["plain", i].tokens})
    lines = [f"target `{args.target}`, draft `{args.draft}` (draft beams {args.draft_beams or args.beams}) on "
             f"{target.device} ({str(target.dtype).removeprefix('torch.')}), beam search of width {args.beams}, "
             f"{args.max_new_tokens} new tokens, {args.repeats} rounds", "",
             "| prompt | γ | plain s | speculative s | x plain (median) | x plain (fastest) | target calls "
             "(plain) | guesses per step | same result |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['prompt']} | {r['gamma']} | {r['plain_seconds']:.2f} | {r['seconds']:.2f} | "
                     f"{r['speedup_median']:.2f}x | {r['speedup_fastest']:.2f}x | {r['target_calls']} "
                     f"({r['plain_target_calls']}) | {r['guesses_histogram'] or '-'} | {yes_no(r['identical'])} |")
    return {"settings": vars(args), "beams": rows}, "\n".join(lines)


def markdown_table(result):
    s = result["settings"]
    seeds = f" x {s['seeds']} seeds" if s["seeds"] > 1 else ""
    weights = "".join(f", {role} {s[key]} weights"
                      for role, key in (("target", "quantize"), ("draft", "draft_quantize")) if s.get(key))
    lines = [f"target `{s['target']}`, draft `{s['draft']}` on {s['device']} ({s['dtype']}{weights}"
             f"{', compiled' if s['compile'] else ''}): {s['prompts']} prompts{seeds} x {s['max_new_tokens']} "
             "new tokens, "
             f"temperature {s['temperature']}{top_k_p(s)}, median of {s['repeats']}; "
             f"step times at position {result['step_position']}", "",
             f"prompt forward (prefill): {result['prefill_s'] * 1e3:.1f} ms per prompt; tok/s and speedup count it, "
             "decode speedup and Theorem 3.8 (predicted) leave it out", ""]
    bw = result["memory_bandwidth"]
    if bw:
        fraction = f" = {bw['fraction_of_peak']:.0%} of {bw['peak_bytes_per_s'] / 1e12:.2f} TB/s peak" \
            if bw["fraction_of_peak"] else ""
        lines += [f"target decode step: {result['target_step_s'] * 1e3:.2f} ms, "
                  f"{bw['bytes_per_step'] / 1e6:.3g} MB read, "
                  f"{bw['achieved_bytes_per_s'] / 1e9:.1f} GB/s{fraction} ({bw['device_name']})", ""]
    draft_bw = result["draft_memory_bandwidth"]
    if draft_bw:
        step_ms = draft_bw["bytes_per_step"] / draft_bw["achieved_bytes_per_s"] * 1e3
        lines += [f"draft decode step: {step_ms:.2f} ms, "
                  f"{draft_bw['bytes_per_step'] / 1e6:.3g} MB read, {draft_bw['achieved_bytes_per_s'] / 1e9:.1f} GB/s", ""]
    memory = result["memory"]
    if memory:
        growth = f" (growth {memory['growth']:+.2%})" if memory["growth"] is not None else ""
        lines += [f"peak memory: {memory['peak_short_bytes'] / 2**10:.1f} KiB of tensors alive at once while "
                  f"generating {memory['short_tokens']} tokens, {memory['peak_long_bytes'] / 2**10:.1f} KiB for "
                  f"{memory['long_tokens']}{growth}; kept after them: {memory['kept_short_bytes']} and "
                  f"{memory['kept_long_bytes']} bytes", ""]
    price = result.get("row_invariance_price")
    if price:
        lines += ["row invariance: target forward with / without (ms): " + ", ".join(
            f"{n} tokens {price['with'][n] * 1e3:.1f} / {price['without'][n] * 1e3:.1f} "
            f"({price['with'][n] / price['without'][n]:.2f}x)" for n in price["with"]), ""]
    reference = result.get("reference")
    assisted = {r["gamma"]: r for r in reference["assisted"]} if reference else {}
    if reference:
        ref_ar = reference["autoregressive"]
        lines += [f"reference autoregressive: {ref_ar['tokens_per_second']:.1f} tokens/s, "
                  f"identical to minispec: {yes_no(ref_ar['identical'])}", ""]
    header = ["γ", "AR tok/s", "spec tok/s", "speedup", "decode speedup", "α", "accept", "tok/call", "c",
              "verify cost", "predicted", "meas/pred", "best γ", "pred. at best γ"]
    if reference:
        header += ["ref assisted tok/s", "ref speedup", "ref identical"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rows"]:
        gamma = f"auto (mean {r['mean_guesses']:.1f})" if r["gamma"] == "auto" else r["gamma"]
        verify_cost = f"{r['verify_cost_ratio']:.2f}" if "verify_cost_ratio" in r else "-"
        cells = [gamma, f"{result['autoregressive']['tokens_per_second']:.1f}", f"{r['tokens_per_second']:.1f}",
                 f"{r['speedup']:.2f}x", f"{r['decode_speedup']:.2f}x", f"{r['alpha']:.2f}",
                 f"{r['acceptance_rate']:.2f}",
                 f"{r['tokens_per_target_call']:.2f}", f"{r['c']:.3f}", verify_cost,
                 f"{r['predicted_speedup']:.2f}x", f"{r['measured_over_predicted']:.2f}", r["best_gamma"],
                 f"{r['best_gamma_predicted_speedup']:.2f}x"]
        if reference:
            a = assisted.get(r["gamma"])
            cells += [f"{a['tokens_per_second']:.1f}", f"{a['speedup']:.2f}x", yes_no(a["identical"])] if a \
                else ["-", "-", "-"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    fixed = [r for r in result["rows"] if r["gamma"] != "auto"]
    if fixed:
        lines += ["", "meas/pred = (tok/call after the prompt's forward ÷ i.i.d. expectation) × ((1 + γc) ÷ "
                  "(verify cost + γc)) × the rest (loop, syncs):"]
    for r in fixed:
        f = r["measured_over_predicted_factors"]
        lines.append(f"- γ = {r['gamma']}: {f['tokens_per_call']:.2f} × {f['verify_cost']:.2f} × {f['loop']:.2f} "
                     f"= {r['measured_over_predicted']:.2f}")
    for r in result["rows"]:
        if r["gamma"] == "auto":
            lines += ["", f"auto: guesses per step {r['guesses_histogram']} (0, 1, ...), expected "
                      f"{r['expected_tokens_per_call']:.2f} tokens per call, measured {r['tokens_per_target_call']:.2f}; "
                      f"its prediction is section 3.5's best fixed γ; acceptance by the drafter's confidence "
                      f"(0-0.2, ..., 0.8-1): " + ", ".join("-" if rate is None else f"{rate:.2f}"
                                                           for rate in r["acceptance_by_confidence"])]
    lines += ["", "speedup per prompt (end to end; median of the repeats / fastest against fastest):", "",
              "| prompt | AR tok/s | " + " | ".join(f"γ = {r['gamma']}" for r in result["rows"]) + " |",
              "|" + "---|" * (2 + len(result["rows"]))]
    for i, tokens in enumerate(result["autoregressive"]["outputs"]):
        rate = len(tokens) / result["autoregressive"]["request_seconds"][i]
        cells = (f"{r['per_prompt_speedup'][i]:.2f}x / {r['per_prompt_speedup_fastest'][i]:.2f}x" for r in result["rows"])
        lines.append(f"| prompt {i + 1} | {rate:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def top_k_p(settings):
    """", top-k 50, top-p 0.9" for the settings in force (greedy ignores both)."""
    if not settings["temperature"]:
        return ""
    return (f", top-k {settings['top_k']}" if settings["top_k"] else "") + \
        (f", top-p {settings['top_p']}" if settings["top_p"] < 1 else "")


def yes_no(value):
    return "n/a" if value is None else ("yes" if value else "NO")


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.batch_sizes:
            result, table = batch_benchmark(args)
        elif args.beams:
            result, table = beam_benchmark(args)
        else:
            result = benchmark(args)
            table = markdown_table(result)
    except ValueError as error:  # includes CheckpointError: a problem with the input, not a bug
        print(f"error: {error}", file=sys.stderr)
        return 2
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(table)
    print(f"\nwrote {args.json_out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
