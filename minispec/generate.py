"""The public entry points: `generate(target, prompt, draft=...)` and `stream(...)`, the same a step
at a time; and the autoregressive baseline that speculative decoding must equal (token for token when
greedy, in distribution when sampling).
"""

import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from . import beam
from .batch import decode_batch, kv_cache_bytes_per_row
from .drafters import make_drafter
from .policy import BEAM_GAMMA_MAX, GAMMA_MAX, make_policy
from .sampling import Sampling, adjust, sample
from .speculative import speculative
from .stopping import Stop
from .tokenizer import IncrementalDecoder


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


def check_fits(model, prefix_length, max_new_tokens, batch_size=1, role="target", allocate=True):
    """Clear errors for lengths before any work: the prompt alone, then prompt + new tokens; then the
    caches are made to fit (unless allocate=False)."""
    context = model.context_length
    if context is not None and prefix_length > context:
        raise ValueError(f"the prompt has {prefix_length} tokens, longer than the {role} {model.name}'s "
                         f"context of {context}")
    if context is not None and prefix_length + max_new_tokens > context:
        raise ValueError(
            f"prompt ({prefix_length} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {role} "
            f"{model.name}'s context of {context} tokens; lower max_new_tokens to at most {context - prefix_length}"
        )
    if allocate:
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
def autoregressive(model, prefix, max_new_tokens, sampling, stop, generator, stats):
    """Plain decoding: one target forward per token. Yields each step's ([token], segments)."""
    logits = model.prefill(prefix, logits_for=1)[:, -1]
    stats.update(target_calls=1, first_call_tokens=1)
    for produced in range(1, max_new_tokens + 1):
        # Greedy: the argmax, the only draw from adjust's one-hot distribution, without building it.
        token = logits.argmax(-1) if sampling.greedy else sample(adjust(logits, sampling), generator)
        tokens, stopped = stop.cut([int(token)])
        yield tokens, [(tokens, "target")]
        if stopped or produced == max_new_tokens:
            return
        logits = model.decode(token.view(1, 1))[:, -1]
        stats["target_calls"] += 1


@dataclass
class Request:
    """A generate() or stream() call's settings, checked before any work."""
    target: object
    prompt_ids: torch.Tensor
    drafter: object
    policy: object
    sampling: Sampling
    stop: Stop
    max_new_tokens: int
    seed: int
    lenience: float
    beams: int
    draft_beams: int

    @classmethod
    def check(cls, target, prompt, draft, gamma, max_new_tokens, temperature, top_k, top_p, seed, lenience,
              ignore_eos, beams, draft_beams, stop, stop_token_ids):
        sampling = Sampling(temperature, top_k, top_p)
        if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens}")
        searching = beams != 1 or draft_beams is not None
        drafter = policy = None
        if draft is not None and draft != "none":
            policy = make_policy(gamma, BEAM_GAMMA_MAX if searching else GAMMA_MAX)
            if not 0 < lenience <= 1:
                raise ValueError(f"lenience must be in (0, 1], got {lenience}")
            drafter = make_drafter(draft, target)
        if searching:
            draft_beams = beam.check_settings(beams, draft_beams, target, drafter, sampling, lenience)
            if stop:
                raise ValueError("beam search cannot stop at stop strings (its hypotheses end in stop tokens); "
                                 "use stop_token_ids")
        stop = Stop(stop_ids(target, ignore_eos, stop_token_ids), [stop] if isinstance(stop, str) else stop or (),
                    target.tokenizer)
        seed = secrets.randbits(63) if seed is None else seed
        return cls(target, prompt_tensor(target, prompt), drafter, policy, sampling, stop, max_new_tokens, seed,
                   lenience, beams, draft_beams)

    @property
    def searching(self):
        return self.beams != 1 or bool(self.draft_beams)


def stop_ids(target, ignore_eos, extra):
    ids = [] if ignore_eos else list(target.eos_token_ids)
    for token in extra or ():
        if not (isinstance(token, int) and 0 <= token < target.vocab_size):
            raise ValueError(f"stop_token_ids must be token ids in [0, {target.vocab_size}), got {token!r}")
        ids.append(token)
    return ids


@torch.inference_mode()
def steps(request):
    """Run a checked request: yields each step's (new tokens, segments), segments being the step's part
    of Generation.trace; returns the Generation."""
    target, drafter, stop = request.target, request.drafter, request.stop
    generator = torch.Generator(device=target.device).manual_seed(request.seed)
    draft_model = drafter.model if drafter else None
    tokens, trace, stats, sequences, scores = [], [], {}, [], []
    with exclusive(target, *[draft_model] if draft_model else []):
        start = time.perf_counter()
        encodes_before = target.encoder_calls, drafter.encoder_calls if drafter else 0
        max_new_tokens = request.max_new_tokens
        if draft_model and not draft_model.is_encoder_decoder:  # the draft's prefix is the prompt itself
            check_fits(draft_model, request.prompt_ids.shape[1], max_new_tokens, role="draft")
        prefix = target.encode(request.prompt_ids)
        # Beam search scores up to w + u·γ hypotheses in one forward (u = 0 without a draft), each in a cache row.
        rows = request.beams + request.draft_beams * request.policy.k_max if request.searching and drafter \
            else request.beams
        check_fits(target, prefix.shape[1], max_new_tokens, rows)
        if request.searching:  # the result is known only at the end
            sequences, scores, search_stats = beam.search(target, prefix, drafter, request.prompt_ids, request.beams,
                                                          request.draft_beams, request.policy, max_new_tokens,
                                                          stop.token_ids)
            stats.update(search_stats)
            loop = iter([(sequences[0], [(sequences[0], "target")])])
        elif drafter is None:
            loop = autoregressive(target, prefix, max_new_tokens, request.sampling, stop, generator, stats)
        else:
            loop = speculative(target, drafter, request.prompt_ids, prefix, max_new_tokens, request.sampling,
                               stop, generator, request.policy, request.lenience, stats)
        for new_tokens, segments in loop:
            tokens += new_tokens
            add_segments(trace, segments)
            yield new_tokens, segments
        seconds = time.perf_counter() - start

    stats.update(
        seed=request.seed,
        new_tokens=len(tokens),
        encoder_calls=target.encoder_calls - encodes_before[0],
        draft_encoder_calls=(drafter.encoder_calls if drafter else 0) - encodes_before[1],
        seconds=seconds,
        tokens_per_second=len(tokens) / seconds if seconds > 0 else float("inf"),
    )
    return Generation(tokens, final_text(target, stop, tokens), stats, trace, sequences, scores)


def final_text(target, stop, tokens):
    text = target.tokenizer.decode(tokens, skip_special_tokens=True) if target.tokenizer else None
    if text is not None and stop.text_end is not None:  # a stop string ended it: the text ends before it
        text = stop.text.text[:stop.text_end]
    return text


def add_segments(trace, segments):
    """Append a step's (ids, kind) segments to a trace, one entry per run of the same kind."""
    for ids, kind in segments:
        if not ids:
            continue
        if trace and trace[-1][1] == kind:
            trace[-1][0].extend(ids)
        else:
            trace.append((list(ids), kind))


def generate(target, prompt, draft=None, gamma="auto", max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
             seed=None, lenience=1.0, ignore_eos=False, beams=1, draft_beams=None, stop=None, stop_token_ids=None,
             batch_size=None, on_tokens=None):
    """Generate from `target`, speculatively when `draft` is given (a model, "ngram", "lookup", or
    "int8"/"int4": the target itself, quantized).

    Greedy (temperature 0) output is token-identical to target-only greedy decoding; sampled output
    has exactly the target's distribution (lenience < 1 trades that exactness for speed, paper A.5).
    gamma: guesses per step, or "auto": chosen before each step (minispec.policy).
    beams > 1 (or draft_beams) runs beam search of width `beams`, speculatively with a draft model whose
    own beam search has width `draft_beams` (default: beams; paper A.4); the result is the target's.
    seed=None draws fresh randomness; stats["seed"] is the seed used, which reproduces the call.
    stop: a string or strings that end the output (which ends just before the first one);
    stop_token_ids: tokens that end it as EOS does (kept as its last token).
    A list of prompts (texts, or lists of ids) returns a list of Generations, each what its prompt gives
    alone. They are decoded together (minispec.batch), plainly or speculatively, `batch_size` (default:
    all) at a time, a finished request's place going to the next; beam search runs them one after
    another. on_tokens(i, tokens) is called with each step's new tokens of prompt i.
    """
    settings = (draft, gamma, max_new_tokens, temperature, top_k, top_p, seed, lenience, ignore_eos, beams,
                draft_beams, stop, stop_token_ids)
    if is_batch(prompt):
        return generate_batch(target, prompt, settings, batch_size, on_tokens)
    request = Request.check(target, prompt, draft, gamma, max_new_tokens, temperature, top_k, top_p, seed,
                            lenience, ignore_eos, beams, draft_beams, stop, stop_token_ids)
    return run_to_end(steps(request), lambda tokens, segments: on_tokens and on_tokens(0, tokens))


def run_to_end(run, on_step):
    """Drive a generator to its end, handing each item it yields to on_step; returns its value."""
    while True:
        try:
            on_step(*next(run))
        except StopIteration as end:
            return end.value


@contextmanager
def naming_prompt(i):
    """A batch's bad input says which prompt it is about."""
    try:
        yield
    except ValueError as error:
        raise ValueError(f"prompt {i}: {error}") from None


def is_batch(prompt):
    """A list of texts or of token lists is a batch; a list of ints is one prompt."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and not isinstance(prompt[0], int)


def generate_batch(target, prompts, settings, batch_size, on_tokens):
    requests = []
    for i, prompt in enumerate(prompts):
        with naming_prompt(i):
            requests.append(Request.check(target, prompt, *settings))
    on_tokens = on_tokens or (lambda i, tokens: None)
    drafter = requests[0].drafter
    draft_model = drafter.model if drafter else None
    if requests[0].searching:  # beam search: its beams are its batch; the requests run one by one
        return [run_to_end(steps(request), lambda tokens, segments, i=i: on_tokens(i, tokens))
                for i, request in enumerate(requests)]
    if batch_size is not None and not (isinstance(batch_size, int) and batch_size >= 1):
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    rows = min(batch_size or len(requests), len(requests))
    models = [target] if draft_model is None else [target, draft_model]
    for i, request in enumerate(requests):
        with naming_prompt(i):
            for model, role in zip(models, ("target", "draft")):
                check_fits(model, request.prompt_ids.shape[1], request.max_new_tokens, role=role, allocate=False)
    longest = max(request.prompt_ids.shape[1] + request.max_new_tokens for request in requests)
    for model in models:
        check_memory(model, rows, longest)
    target.ensure_caches(rows, longest)
    if draft_model is not None:  # guesses, and placeholders for rows not guessing, run past a row's length
        draft_model.ensure_caches(rows, min(longest + 2 * (GAMMA_MAX + 1), draft_model.context_length or 1 << 62))
    longest_prompt = max(request.prompt_ids.shape[1] for request in requests)
    for model in models:
        model.prepare_batch(rows, longest_prompt)
    with exclusive(*models):
        results = run_to_end(decode_batch(target, requests, rows), on_tokens)
    generations = []
    for request, (tokens, stats) in zip(requests, results):
        stats.update(new_tokens=len(tokens), batch_size=rows,
                     tokens_per_second=len(tokens) / stats["seconds"] if stats["seconds"] > 0 else float("inf"))
        generations.append(Generation(tokens, final_text(target, request.stop, tokens), stats,
                                      [(list(tokens), "target")] if tokens else []))
    return generations


def check_memory(model, rows, max_seq_len):
    """A clear error, before any work, when `rows` cache rows of `max_seq_len` positions do not fit."""
    per_row = kv_cache_bytes_per_row(model, max_seq_len)
    free = available_memory(model.device)
    if free is not None and rows * per_row > free:
        raise ValueError(f"a batch of {rows} requests needs {rows * per_row / 2**30:.1f} GiB of KV cache "
                         f"({per_row / 2**20:.0f} MiB each at {max_seq_len} positions), more than the "
                         f"{free / 2**30:.1f} GiB free; at most {free // per_row} fit: pass batch_size=")


def available_memory(device):
    """Free bytes for new tensors on the device (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


@dataclass
class Chunk:
    """One step of a stream: the tokens it added, the text they added, and the step's segments as in
    Generation.trace (its rejected guess included, for colouring). The last chunk also carries the
    whole Generation, stats included."""
    tokens: list
    text: str
    segments: list
    generation: Generation | None = None


def stream(target, prompt, draft=None, gamma="auto", max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0,
           seed=None, lenience=1.0, ignore_eos=False, beams=1, draft_beams=None, stop=None, stop_token_ids=None):
    """generate(), a step at a time: `for chunk in stream(...)` gets each step's Chunk as soon as the
    step is verified. Chunks' texts join to the Generation's text, never a broken character, and
    never text past a stop string (text that may begin one is held back until the next step tells).
    Settings are checked here, before the first chunk is asked for."""
    request = Request.check(target, prompt, draft, gamma, max_new_tokens, temperature, top_k, top_p, seed,
                            lenience, ignore_eos, beams, draft_beams, stop, stop_token_ids)
    return chunks(request)


def chunks(request):
    tokenizer = request.target.tokenizer
    text = IncrementalDecoder(tokenizer) if tokenizer else None
    sent = 0  # characters of text already sent
    run = steps(request)
    while True:
        try:
            tokens, segments = next(run)
        except StopIteration as end:
            generation = end.value
            final = generation.text or ""
            yield Chunk([], final[sent:], [], generation)
            return
        if text is None:
            yield Chunk(tokens, "", segments)
            continue
        text.push(tokens)
        ready = len(text.text) - request.stop.held_back(text.text)
        if request.stop.text_end is not None:
            ready = min(ready, request.stop.text_end)
        yield Chunk(tokens, text.text[sent:ready], segments)
        sent = max(sent, ready)
