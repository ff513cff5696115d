"""generate() and stream(): check the settings and prompts (`Request`), claim the models, size their caches,
and hand the requests to the engine (minispec.decoding.engine), or to beam search."""

import ctypes
import functools
import inspect
import secrets
import threading
import time
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass, fields, replace

import torch

from .decoding import engine
from .decoding.engine import Generation, Segment, Update, final_text
from .decoding.drafters import make_drafter
from .decoding.policy import BEAM_GAMMA_MAX, make_policy
from .decoding.sampling import Sampling
from .decoding.stopping import Stop
from .decoding.tree import TREE_AUTO
from .loading.checkpoint import load_model
from .models.checks import Check, SettingError, integer, is_integer, is_text
from .loading.tokenizer import IncrementalDecoder
from .loading.weights import DTYPES
from .models.llama import Llama
from .settings import GAMMA_MAX, Settings


# load_model (its help() too), whose dtype may also be a name ("float32"), as the reference implementation takes it
@functools.wraps(load_model)
def load(name_or_path, device="cpu", dtype=None, **options):
    if isinstance(dtype, str):
        dtype = DTYPES[Check(lambda name: name in DTYPES, f"must be a torch.dtype or one of {', '.join(DTYPES)}")(
            "dtype", dtype)]
    model = load_model(name_or_path, device=device, dtype=dtype, **options)
    release_openmp_workers()  # the model may well be used on another thread
    return model


def release_openmp_workers():
    """End this thread's idle OpenMP workers (libgomp's; the next region makes them again): with two threads' pools
    libgomp cuts its spin-waits short, and each parallel region then waits for sleeping workers."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(maxsplit=5)[-1].strip() for line in maps if "libgomp" in line}
    except OSError:
        return
    for path in sorted(paths):
        with suppress(OSError):  # no library there now (replaced since it was loaded: "... (deleted)")
            pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)  # libgomp of GCC 9 and later
            if pause is not None:
                pause(2)  # omp_pause_hard: the calling thread's idle workers end


def prompt_tensor(model, prompt):
    """A prompt's text, ids or 1-D tensor of them -> LongTensor [1, n] on the model's device."""
    with named("prompt"):
        if isinstance(prompt, str):
            if model.tokenizer is None:
                raise ValueError(f"{model.name} has no tokenizer files; pass the prompt as token ids")
            if not is_text(prompt):
                raise ValueError("the prompt is not text: it holds a lone surrogate (undecodable bytes)")
            prompt = model.tokenizer.encode(prompt)
        elif isinstance(prompt, torch.Tensor):
            dtype = prompt.dtype
            if prompt.dim() != 1 or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
                raise ValueError(f"a prompt tensor must be 1-D token ids of an integer dtype, got shape "
                                 f"{tuple(prompt.shape)} and {prompt.dtype} (a batch is a list of prompts)")
        elif isinstance(prompt, (list, tuple)):
            wrong = next((token for token in prompt if not is_integer(token)), None)
            if wrong is not None:
                raise ValueError(f"prompt token ids must be integers, got {wrong!r}")
        else:
            raise ValueError("a prompt is a text, a list of token ids or a 1-D tensor of them, got "
                             f"{type(prompt).__name__}")
        ids = torch.as_tensor(prompt, dtype=torch.long, device=model.device).reshape(1, -1)
        if ids.numel() == 0:
            raise ValueError("the prompt is empty")
        if ids.min() < 0 or ids.max() >= model.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {model.vocab_size}) for {model.name}")
        return ids


# A model's KV cache holds its requests' rows, so a model runs one call at a time: HOLDERS names the thread
# of each model's call under way; the lock makes checking and marking atomic.
_claiming = threading.Lock()
HOLDERS = weakref.WeakKeyDictionary()


@contextmanager
def exclusive(*models):
    """Claim the models before a call touches their caches, or fail at once if another call has one; a stream
    releases them when it ends, is closed, or is garbage collected."""
    with _claiming:
        for model in models:
            if HOLDERS.get(model) == threading.get_ident():
                raise RuntimeError(f"{model.name} is still held by an unfinished call in this thread (a stream not "
                                   "read to its end: finish it or call its close(); or an on_tokens callback): a "
                                   "model runs one request at a time")
            if model in HOLDERS:
                raise RuntimeError(f"{model.name} is already generating in another call: a model runs one request "
                                   "at a time (its KV cache holds that request); load one copy of the model per thread")
        for model in models:
            HOLDERS[model] = threading.get_ident()
    try:
        yield
    finally:
        for model in models:
            HOLDERS.pop(model, None)


@dataclass
class Request:
    """One prompt's request: its settings and what they were made into; other settings read through (.n)."""
    target: object
    prompt_ids: torch.Tensor
    settings: Settings
    drafter: object
    policy: object
    sampling: Sampling
    stop: Stop
    seed: int
    draft_beams: int
    state_layers: tuple | None = None
    grammar: object = None  # a decoding/grammar.py Matcher

    def __getattr__(self, name):  # only for names that are not fields
        if name.startswith("__"):  # copy and pickle look for their hooks before `settings` exists
            raise AttributeError(name)
        return getattr(self.settings, name)

    @property
    def reads_states(self):
        """What the target's forwards return beside logits: a draft head's states, or on_states'; False: none."""
        if self.drafter is not None and self.drafter.reads_states:
            return self.drafter.reads_states
        return (self.state_layers or True) if self.on_states is not None else False

    @classmethod
    def from_settings(cls, target, prompt, settings):
        drafter = policy = None
        sampling = Sampling(**{spec.name: getattr(settings, spec.name) for spec in fields(Sampling)})
        if settings.drafting:
            policy = make_policy(settings.gamma, BEAM_GAMMA_MAX if settings.searching else GAMMA_MAX)
            with named("draft"):
                drafter = make_drafter(settings.draft, target)
        draft_beams = settings.draft_beams
        if settings.searching:
            from .decoding import beam  # read only by a call that asks for beams
            with named("beams" if settings.beams != 1 else "draft_beams"):
                draft_beams = beam.check_settings(settings.beams, draft_beams, drafter, sampling, settings.lenience)
        texts = [settings.stop] if isinstance(settings.stop, str) else settings.stop or ()
        token = Check(integer(0, target.vocab_size - 1), f"must be token ids in [0, {target.vocab_size})")
        ids = [] if settings.ignore_eos else list(target.eos_token_ids)
        with named("stop"):
            stop = Stop(ids + [token("stop_token_ids", t) for t in settings.stop_token_ids or ()], texts,
                        target.tokenizer)
        seed = secrets.randbits(63) if settings.seed is None else settings.seed
        if settings.seed is None and target.tp is not None:  # ranks draw alike only from one seed: rank 0's
            seed = target.tp.from_first(seed)[0]
        if settings.on_states is not None and drafter is not None and drafter.reads_states:
            raise SettingError("on_states", "on_states cannot be given with a draft head (the target's forwards "
                                            "return the head's states)")
        grammar = None
        if settings.grammar is not None:
            from .decoding.grammar import compile_grammar  # the optional grammar engine: read only when asked for
            grammar = compile_grammar(settings.grammar, target)
        return cls(target, prompt_tensor(target, prompt), settings, drafter, policy, sampling, stop, seed, draft_beams,
                   state_layers_of(target, settings.state_layers), grammar)

    def decoder_length(self, model):
        """Tokens the model's decoder starts from: the prompt, or T5's one start token."""
        return 1 if model.is_encoder_decoder else self.prompt_ids.shape[1]


def state_layers_of(target, layers):
    if layers is None:
        return None
    if not isinstance(target, Llama):
        raise SettingError("state_layers", f"state_layers reads states inside a Llama-family target; {target.name} "
                                           "is not one")
    count = len(target.layers)
    Check(lambda v: isinstance(v, (list, tuple)) and bool(v) and all(integer(0, count)(i) for i in v),
          f"must be a list of layer indices in [0, {count}]")("state_layers", layers)
    return tuple(layers)


@contextmanager
def named(name):
    """A ValueError raised inside is about the setting `name`: it becomes a SettingError naming it."""
    try:
        yield
    except SettingError:
        raise
    except ValueError as error:
        raise SettingError(name, str(error)) from None


def check_memory(model, rows, max_seq_len, requests=1, working=0, remedy=None, tp=None, setting="max_new_tokens"):
    """An error naming `setting` (or the server's `remedy`), before allocating, when `rows` cache rows of
    `max_seq_len` positions and `working` bytes do not fit; with `tp` the least free on any rank decides."""
    fits = rows <= model.cache_batch_size and model.cache_length_for(max_seq_len) <= model.cache_max_seq_len
    per_position = model.kv_bytes_per_position()
    per_row = 0 if fits else per_position * model.cache_length_for(max_seq_len)
    held = 0 if fits else per_position * model.cache_batch_size * model.cache_max_seq_len  # freed on reallocating
    total = rows * per_row + working
    free = available_memory(model.device) if total else None
    if tp is not None and total:
        free = tp.smallest(-1 if free is None else free)
        free = None if free < 0 else free
    if free is None or total <= free + held:
        return
    need = (f"{total / 2**30:.1f} GiB of KV cache and working memory ({per_row / 2**20:.0f} MiB of cache per row "
            f"of {max_seq_len} positions), more than the {free / 2**30:.1f} GiB free")
    if remedy is not None:
        raise ValueError(f"{model.name}: {rows} cache rows need {need}; at most {free // per_row} fit: {remedy}")
    if requests > 1:
        raise SettingError("batch_size", f"a batch of {rows} requests needs {need}; at most {free // per_row} fit: "
                                         "pass batch_size=")
    raise SettingError(setting, f"{model.name}: {rows} cache row(s) need {need}; ask for fewer new tokens or beams")


def available_memory(device):
    """Free bytes on the device (None where unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with suppress(OSError, KeyError, ValueError):
        with open("/proc/meminfo") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    return None


def models_of(request):
    return [model for model in (request.target, request.drafter and request.drafter.model) if model is not None]


def check_lengths(requests):
    """Each request's prompt, then with its new tokens, against the target's and a draft model's context."""
    for i, request in enumerate(requests):
        with naming_prompt(i if len(requests) > 1 else None):
            for model, role in zip(models_of(request), ("target", "draft")):
                start, new, context = request.decoder_length(model), request.max_new_tokens, model.context_length
                if context is not None and start > context:
                    raise SettingError("prompt", f"the prompt has {start} tokens, longer than the {role} "
                                                 f"{model.name}'s context of {context}")
                if context is not None and start + new > context:
                    raise SettingError("max_new_tokens", f"prompt ({start} tokens) + max_new_tokens ({new}) exceeds "
                                                         f"the {role} {model.name}'s context of {context} tokens; "
                                                         f"lower max_new_tokens to at most {context - start}")


def size_caches(requests, rows):
    for model in models_of(requests[0]):
        # a token tree's nodes take cache slots past the accepted tokens: room for a whole tree, within
        # the context (near its end the engine offers smaller trees)
        longest = max(request.decoder_length(model) + request.max_new_tokens
                      + (TREE_AUTO if request.trees == "auto" else request.trees or 0) for request in requests)
        longest = min(longest, model.context_length or longest)
        check_memory(model, rows, longest, len(requests), tp=requests[0].target.tp)
        model.ensure_caches(rows, longest)
        model.prepare_batch(rows, max(request.prompt_ids.shape[1] for request in requests))


@torch.inference_mode()
def run(requests, rows, prefix_cache=None):
    """Each step's engine.Update of checked requests decoded `rows` at a time."""
    with exclusive(*models_of(requests[0])):
        try:
            if requests[0].searching:  # beam search: its beams are its batch; the requests run one by one
                for i, request in enumerate(requests):
                    generation = search(request)
                    yield Update(i, generation.tokens, None, generation.trace, generation)
                return
            size_caches(requests, rows)
            yield from engine.decode(requests[0].target, requests, rows, prefixes=prefix_cache)
        finally:
            release_openmp_workers()  # the next call may come from another thread


def search(request):
    """A request of (speculative) beam search, known only at the end."""
    from .decoding import beam  # read only by a call that asks for beams
    target, drafter = request.target, request.drafter
    start = time.perf_counter()
    draft = drafter.model if drafter else None
    encodes_before = target.encoder_calls, draft.encoder_calls if draft else 0
    prefix = target.encode(request.prompt_ids)
    # Scores up to w + u·γ hypotheses in one forward (u = 0 without a draft), each in a cache row.
    rows = request.beams + request.draft_beams * request.policy.k_max if drafter else request.beams
    longest = prefix.shape[1] + request.max_new_tokens
    check_memory(target, rows, longest, working=beam.working_bytes(rows, longest, target.vocab_size), tp=target.tp,
                 setting="beams")
    if drafter:
        check_memory(drafter.model, request.draft_beams, request.decoder_length(drafter.model) + request.max_new_tokens,
                     tp=target.tp, setting="draft_beams")
    sequences, scores, stats = beam.search(target, prefix, drafter, request.prompt_ids, request.beams,
                                           request.draft_beams, request.policy, request.max_new_tokens,
                                           request.stop.token_ids)
    seconds = time.perf_counter() - start
    stats.update(seed=request.seed, new_tokens=len(sequences[0]), seconds=seconds,
                 encoder_calls=target.encoder_calls - encodes_before[0],
                 draft_encoder_calls=(draft.encoder_calls if draft else 0) - encodes_before[1],
                 tokens_per_second=len(sequences[0]) / seconds if seconds > 0 else float("inf"))
    return Generation(sequences[0], final_text(target, request.stop, sequences[0]), stats,
                      [Segment(list(sequences[0]), "target")] if sequences[0] else [], sequences, scores)


def with_settings(function):
    """`function(..., **settings)` shown by help() with Settings' fields as its keywords."""
    signature = inspect.signature(function)
    keywords = [inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=spec.default)
                for spec in fields(Settings)]
    given = [parameter for parameter in signature.parameters.values() if parameter.kind != parameter.VAR_KEYWORD]
    function.__signature__ = signature.replace(parameters=given + keywords)
    return function


@with_settings
def generate(target, prompt, *, batch_size=None, on_tokens=None, prefix_cache=None, **settings):
    """Generate from `target`, speculatively when `draft` is given (a model, "ngram", "lookup", "suffix", or
    "int8"/"int4": the target itself, quantized); the settings are minispec.Settings' fields (a bad one raises
    SettingError naming its `field`). Greedy output is target-only greedy decoding's, sampled
    output has the target's distribution (unless lenience < 1); stats["seed"] reproduces the call.

    A list of prompts returns a Generation each, decoded `batch_size` (default: all) at a time, seed then
    perhaps a list; n > 1: a list of n Generations. on_tokens(i, tokens) gets each step's new tokens of prompt
    (or answer) i; on_states(i, tokens, states) the target's hidden states; prefix_cache: a PrefixCache
    (minispec.decoding.prefix) whose earlier prompts' keys and values a prompt beginning alike reuses."""
    # a list of texts, token lists or tensors is a batch; any other list is one prompt's ids
    batched = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], (str, list, tuple,
                                                                                           torch.Tensor))
    seeds = settings.get("seed") if batched and isinstance(settings.get("seed"), (list, tuple)) else None
    if seeds is not None and len(seeds) != len(prompt):
        raise SettingError("seed", f"seed: a list of seeds needs one per prompt, got {len(seeds)} for {len(prompt)} "
                                   "prompts")
    settings = Settings.of("generate", {**settings, "seed": None} if seeds is not None else settings)
    requests, n = [], settings.n
    for i, one in enumerate(prompt if batched else [prompt]):
        with naming_prompt(i if batched else None):
            first = settings if seeds is None else replace(settings, seed=seeds[i])
            requests += [Request.from_settings(target, one, replace(first, seed=seed))
                         for seed in answers(first.seed, n)]
    Check(lambda v: v is None or integer(1)(v), "must be an integer >= 1")("batch_size", batch_size)
    Check(lambda v: v is None or hasattr(v, "admit"), "must be a PrefixCache or None")("prefix_cache", prefix_cache)
    check_lengths(requests)
    generations = [None] * len(requests)
    for update in run(requests, min(batch_size or len(requests), len(requests)), prefix_cache):
        if on_tokens:
            on_tokens(update.index, update.tokens)
        generations[update.index] = update.generation or generations[update.index]
    if n > 1:
        generations = [generations[i:i + n] for i in range(0, len(generations), n)]
    return generations if batched else generations[0]


def answers(seed, n):
    """The seeds of a prompt's n answers: the seed, then seeds mixed from it."""
    return [seed if j == 0 or seed is None else (seed * 0x9E3779B97F4A7C15 + j) % 2**63 for j in range(n)]


@contextmanager
def naming_prompt(i):
    """A batch's bad input names its prompt."""
    try:
        yield
    except SettingError as error:
        if i is None:
            raise
        raise SettingError(error.field, f"prompt {i}: {error}") from None


@dataclass
class Chunk:
    """One step of a stream: its tokens, their text, its segments as in Generation.trace (rejected guesses too)
    and with logprobs=k their TokenLogprobs; the last chunk also carries the whole Generation."""
    tokens: list
    text: str
    segments: list
    generation: Generation | None = None
    logprobs: list | None = None


@with_settings
def stream(target, prompt, **settings):
    """generate(), a Chunk per step as soon as it is verified; the settings are checked here, not at the first."""
    settings = Settings.of("stream", settings)
    if settings.n != 1:
        raise SettingError("n", "stream() streams one answer: n must be 1 (generate() returns n answers)")
    request = Request.from_settings(target, prompt, settings)
    check_lengths([request])
    return chunks(request)


def chunks(request):
    text = TextStream(request)
    steps = run([request], 1)
    for update in steps:
        yield Chunk(update.tokens, text.push(update.tokens), update.segments, logprobs=update.logprobs)
        if update.generation is not None:
            steps.close()  # the models are free again before the last chunk is handed out
            yield Chunk([], text.rest(update.generation.text), [], update.generation,
                        None if update.logprobs is None else [])


class TextStream:
    """A request's text a step at a time, never a broken character nor what may begin a stop string. Push each
    step's tokens before the engine's next step: the request's Stop has read exactly those then."""

    def __init__(self, request):
        tokenizer = request.target.tokenizer
        self.stop = request.stop
        self.text = IncrementalDecoder(tokenizer) if tokenizer else None
        self.sent = 0  # characters of text already handed out

    def push(self, tokens):
        """The text a step's tokens add that is safe to hand out ("" without a tokenizer)."""
        if self.text is None:
            return ""
        self.text.push(tokens)
        ready = len(self.text.text) - self.stop.held_back(self.text.text)
        if self.stop.text_end is not None:
            ready = min(ready, self.stop.text_end)
        piece = self.text.text[self.sent:ready]
        self.sent = max(self.sent, ready)
        return piece

    def rest(self, final_text):
        """At the end: what of the final text (Generation.text) was held back."""
        return (final_text or "")[self.sent:]
