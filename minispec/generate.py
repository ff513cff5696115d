"""The public entry point: `generate(target, prompt, draft=...)`, and the autoregressive baseline
that speculative decoding must equal (token for token when greedy, in distribution when sampling).
"""

import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import beam
from .drafters import make_drafter
from .policy import BEAM_GAMMA_MAX, GAMMA_MAX, make_policy
from .sampling import Sampling, adjust, sample
from .speculative import speculative


@dataclass
class Generation:
    tokens: list  # generated token ids, prompt excluded
    text: str | None  # decoded tokens (None when the model has no tokenizer)
    stats: dict
    # (token ids, kind) in generation order, kind one of "target" (sampled by the target),
    # "accepted" / "rejected" (draft tokens) or "corrected" (the target's replacement of a rejection).
    trace: list = field(default_factory=list)
    # Beam search only: the w final hypotheses, best first, and their scores (sum of log-probs / length).
    sequences: list = field(default_factory=list)
    scores: list = field(default_factory=list)


def prompt_tensor(model, prompt):
    """A prompt given as text, a list of ids or a tensor -> LongTensor [1, n] on the model's device."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError(f"{model.name} has no tokenizer files; pass the prompt as token ids")
        prompt = model.tokenizer.encode(prompt)
    ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device).reshape(1, -1)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty")
    if ids.min() < 0 or ids.max() >= model.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {model.vocab_size}) for {model.name}")
    return ids


def check_fits(model, prefix_length, max_new_tokens, batch_size=1, role="target"):
    """Clear errors for lengths before any work: the prompt alone, then prompt + new tokens."""
    context = model.context_length
    if context is not None and prefix_length > context:
        raise ValueError(f"the prompt has {prefix_length} tokens, longer than the {role} {model.name}'s "
                         f"context of {context}")
    if context is not None and prefix_length + max_new_tokens > context:
        raise ValueError(
            f"prompt ({prefix_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {role} "
            f"{model.name}'s context of {context} tokens; lower max_new_tokens to at most {context - prefix_length}"
        )
    model.ensure_caches(batch_size, prefix_length + max_new_tokens)


# A model's KV cache holds one request at a time, so a model runs one generate() call at a time;
# `busy` marks the models of the calls under way, and this lock makes checking and marking atomic.
_claiming = threading.Lock()


@contextmanager
def exclusive(*models):
    """Claim the models for one request, or fail at once if another call (another thread) has one."""
    with _claiming:
        for model in models:
            if model.busy:
                raise RuntimeError(
                    f"{model.name} is already generating in another call: a model runs one request at a time "
                    "(its KV cache holds that request); load one copy of the model per thread"
                )
        for model in models:
            model.busy = True
    try:
        yield
    finally:
        for model in models:
            model.busy = False


@torch.inference_mode()
def autoregressive(model, prefix, max_new_tokens, sampling, stop_ids, generator):
    """Plain decoding: one target forward per token. Returns (tokens, stats)."""
    logits = model.prefill(prefix, logits_for=1)[:, -1]
    tokens = []
    calls = 1
    while True:
        # Greedy: the argmax, the only draw from adjust's one-hot distribution, without building it.
        token = logits.argmax(-1) if sampling.greedy else sample(adjust(logits, sampling), generator)
        tokens.append(int(token))
        if len(tokens) == max_new_tokens or tokens[-1] in stop_ids:
            break
        logits = model.decode(token.view(1, 1))[:, -1]
        calls += 1
    return tokens, {"target_calls": calls, "first_call_tokens": 1}


@torch.inference_mode()
def generate(target, prompt, draft=None, gamma="auto", max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
             seed=None, lenience=1.0, ignore_eos=False, beams=1, draft_beams=None):
    """Generate from `target`, speculatively when `draft` is given (a model, "ngram" or "lookup").

    Greedy (temperature 0) output is token-identical to target-only greedy decoding; sampled output
    has exactly the target's distribution (lenience < 1 trades that exactness for speed, paper A.5).
    beams > 1 (or draft_beams) runs beam search of width `beams`, speculatively with a draft model whose
    own beam search has width `draft_beams` (default: beams; paper A.4); the result is the target's.
    seed=None draws fresh randomness; stats["seed"] is the seed used, which reproduces the call.
    """
    sampling = Sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    searching = beams != 1 or draft_beams is not None
    drafter = policy = None
    if draft is not None and draft != "none":
        policy = make_policy(gamma, BEAM_GAMMA_MAX if searching else GAMMA_MAX)
        if not 0 < lenience <= 1:
            raise ValueError(f"lenience must be in (0, 1], got {lenience}")
        drafter = make_drafter(draft, target)
    if searching:
        draft_beams = beam.check_settings(beams, draft_beams, target, drafter, sampling, lenience)
    stop_ids = set() if ignore_eos else set(target.eos_token_ids)
    seed = secrets.randbits(63) if seed is None else seed
    generator = torch.Generator(device=target.device).manual_seed(seed)
    draft_model = drafter.model if drafter else None
    with exclusive(target, *[draft_model] if draft_model else []):
        start = time.perf_counter()
        encodes_before = target.encoder_calls, drafter.encoder_calls if drafter else 0
        prompt_ids = prompt_tensor(target, prompt)
        if draft_model and not draft_model.is_encoder_decoder:  # the draft's prefix is the prompt itself
            check_fits(draft_model, prompt_ids.shape[1], max_new_tokens, role="draft")
        prefix = target.encode(prompt_ids)
        # Beam search scores up to w + u·γ hypotheses in one forward (u = 0 without a draft), each in a cache row.
        rows = beams + draft_beams * policy.k_max if searching and drafter else beams
        check_fits(target, prefix.shape[1], max_new_tokens, rows)
        sequences, scores = [], []
        if searching:
            sequences, scores, stats = beam.search(target, prefix, drafter, prompt_ids, beams, draft_beams, policy,
                                                   max_new_tokens, stop_ids)
            tokens, trace = sequences[0], [(sequences[0], "target")]
        elif drafter is None:
            tokens, stats = autoregressive(target, prefix, max_new_tokens, sampling, stop_ids, generator)
            trace = [(tokens, "target")]
        else:
            tokens, stats, trace = speculative(target, drafter, prompt_ids, prefix, max_new_tokens, sampling,
                                               stop_ids, generator, policy, lenience)
        seconds = time.perf_counter() - start

    stats.update(
        seed=seed,
        new_tokens=len(tokens),
        encoder_calls=target.encoder_calls - encodes_before[0],
        draft_encoder_calls=(drafter.encoder_calls if drafter else 0) - encodes_before[1],
        seconds=seconds,
        tokens_per_second=len(tokens) / seconds if seconds > 0 else float("inf"),
    )
    text = target.tokenizer.decode(tokens, skip_special_tokens=True) if target.tokenizer else None
    return Generation(tokens, text, stats, trace, sequences, scores)
