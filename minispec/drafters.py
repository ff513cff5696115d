"""Drafters: whatever proposes the γ guesses of Algorithm 1. All share one small interface:

    drafter.start(prompt_ids, max_new_tokens, sampling)    a new request
    drafts, q = drafter.propose(k, sampling, rng, keep_guessing)
                                                           <= k guesses [k'] and their q [k', vocab],
                                                           or None for deterministic guesses (q one-hot);
                                                           keep_guessing(i, confidence), when given, is
                                                           asked after each guess whether to go on
    drafter.accept(tokens, tokens_on_device)               the target kept these tokens (accepted guesses
                                                           and its own next token); roll back the rest
    drafter.calls, drafter.encoder_calls                   for statistics
    drafter.name, drafter.model                            what drafts: "model" and the model, or the
                                                           model-free drafter's name and None
    drafter.preview                                        None, or preview(k): the next k guesses as
                                                           propose would make them, without making them,
                                                           and how sure the drafter is of each (0..1)
                                                           (for deterministic guesses that cost nothing;
                                                           set by start)

Any q is fine for exactness: Algorithm 1 corrects whatever the drafter proposes, as long as each
guess is really drawn from the q it reports. Deterministic guesses (lookup, greedy drafting) report
q = None rather than building a one-hot [k, vocab] tensor each step: greedy verification never reads
it, and the sampled path builds it only when it needs it.
"""

import sys
import weakref
from collections import Counter, defaultdict
from functools import partial

import torch

from .models.base import CachedLM
from .models.quant import MODES as SELF_DRAFT_MODES
from .models.quant import quantized_copy
from .sampling import Sampling, adjust, sample

# draft="int8"/"int4": the target's own quantized copy, made on first use and kept while the target lives.
SELF_DRAFTS = weakref.WeakKeyDictionary()  # target -> {mode: copy}


def make_drafter(draft, target):
    """A drafter for `draft`: a loaded model (minispec.load), "ngram", "lookup", or "int8" / "int4" (the
    target itself, quantized: its own quantized weights and KV cache, built once per target)."""
    if isinstance(draft, str) and draft in MODEL_FREE:
        return MODEL_FREE[draft](target.vocab_size, target.device)
    if isinstance(draft, str) and draft in SELF_DRAFT_MODES:
        copies = SELF_DRAFTS.setdefault(target, {})
        if draft not in copies:
            copies[draft] = quantized_copy(target, draft)
            for note in copies[draft].quantization["notes"]:  # layers the int4 kernel cannot take
                print(f"minispec: draft {copies[draft].name}: {note}", file=sys.stderr)
        return ModelDrafter(copies[draft])
    if isinstance(draft, str):
        raise ValueError(f"draft={draft!r}: load a draft model once with minispec.load({draft!r}) and pass the "
                         "model (a path here would reload its weights on every call); or use 'ngram', 'lookup', "
                         "'int8' or 'int4'")
    if not isinstance(draft, CachedLM):
        raise ValueError(f"draft must be a minispec model (minispec.load), 'ngram', 'lookup', 'int8' or 'int4'; "
                         f"got {draft!r}")
    if draft is target:
        raise ValueError("the draft must be a separate model object (each needs its own KV cache); "
                         "load the checkpoint twice to draft with the target's weights")
    if draft.device != target.device:
        raise ValueError(f"the draft {draft.name} is on {draft.device} but the target {target.name} is on "
                         f"{target.device}; load both on the same device")
    check_same_vocabulary(target, draft)
    return ModelDrafter(draft)


def check_same_vocabulary(target, draft):
    if target.vocab_size != draft.vocab_size:
        raise ValueError(
            f"target {target.name} and draft {draft.name} have different vocabularies "
            f"({target.vocab_size} vs {draft.vocab_size} tokens); speculative decoding needs the same one"
        )
    if target.tokenizer and draft.tokenizer and target.tokenizer.fingerprint != draft.tokenizer.fingerprint:
        raise ValueError(f"target {target.name} and draft {draft.name} use different tokenizers")


class ModelDrafter:
    """A smaller language model M_q with its own static KV cache (any family, same vocabulary)."""

    name, preview = "model", None

    def __init__(self, model):
        self.model = model
        self.calls = 0

    @property
    def encoder_calls(self):
        return self.model.encoder_calls

    def start(self, prompt_ids, max_new_tokens, sampling=Sampling()):
        model = self.model
        prefix = model.encode(prompt_ids.to(model.device))
        model.ensure_caches(1, prefix.shape[1] + max_new_tokens)
        model.prefill(prefix[:, :0])
        # The prompt waits like any unseen tokens: its forward, which also gives q for the first guess,
        # runs at the first proposal, and never when the policy guesses nothing all along.
        self.next_logits = None
        self.calls = 0
        self.unseen = prefix  # accepted tokens the cache has not seen yet, [1, m] on the device
        self.fed_guesses = 0  # guesses of the last proposal that went through the model

    def propose(self, k, sampling, generator, keep_guessing=None):
        model = self.model
        self.fed_guesses = 0
        if k == 0:  # no draft work: the tokens accepted meanwhile wait in `unseen` until guessing resumes
            return torch.zeros(0, dtype=torch.long, device=model.device), None
        if self.unseen is not None:  # catch up on the tokens accepted since the last proposal
            # 1 or 2 of them after a step with guesses; more after steps without (or the prompt), a width
            # that a compiled draft would compile a graph for each time: those go through the eager forward.
            forward = partial(model.forward, logits_for=1) if self.unseen.shape[1] > 2 else None
            self.next_logits = model.decode(self.unseen, forward)[0, -1]
            self.unseen = None
            self.calls += 1
        logits, drafts, qs = self.next_logits, [], []
        while len(drafts) < k:
            if sampling.greedy:  # q is one-hot at the argmax, and so is every sample from it
                drafts.append(logits.argmax(-1))
            else:
                qs.append(adjust(logits, sampling))
                drafts.append(sample(qs[-1], generator))
            # How sure the draft is of its guess: q(x), or the probability of its argmax when greedy.
            if keep_guessing and not keep_guessing(len(drafts), confidence(logits, qs, drafts[-1], sampling)):
                break
            if len(drafts) < k:  # the last guess is never fed: the target decides what follows it
                logits = model.decode(drafts[-1].view(1, 1))[0, -1]
        self.calls += len(drafts) - 1
        self.fed_guesses = len(drafts) - 1
        return torch.stack(drafts), torch.stack(qs) if qs else None

    def accept(self, tokens, tokens_on_device):
        # tokens = the n accepted guesses + the target's token. The cache keeps the guesses it has
        # seen that were accepted; the rest of `tokens` is fed at the next proposal, after any tokens
        # still waiting from steps that proposed nothing.
        keep = min(len(tokens) - 1, self.fed_guesses)
        self.model.rollback(self.model.length - (self.fed_guesses - keep))
        new = tokens_on_device[keep:].view(1, -1)
        self.unseen = new if self.unseen is None else torch.cat([self.unseen, new], dim=1)
        self.next_logits = None  # known only after the unseen tokens go through the model


def confidence(logits, qs, guess, sampling):
    """The draft's probability of its own guess (a host read: for CPUs, where it costs nothing)."""
    if sampling.greedy:
        return float(logits.float().softmax(-1).max())
    return float(qs[-1][guess])


class NgramDrafter:
    """Paper 3.6's simplest M_q: a bigram model counted from the prompt and everything generated so
    far, falling back to unigram counts for an unseen previous token. q = normalized counts. It lives
    on the host (each guess picks the next row of counts), so it samples there with a generator of its
    own, seeded once per request from the caller's, and hands the device its guesses in one copy."""

    name, model = "ngram", None
    encoder_calls = 0
    calls = 0

    def __init__(self, vocab_size, device):
        self.vocab_size, self.device = vocab_size, device

    def start(self, prompt_ids, max_new_tokens, sampling=Sampling()):
        self.context = prompt_ids.view(-1).tolist()
        self.unigrams, self.bigrams = Counter(), defaultdict(Counter)
        self.counted = 0  # context tokens already counted
        self.generator = None
        # Greedy guesses are a walk over the counts on the host, free to preview; sampled ones are
        # random, and how often a sample survives is not what its preview would show.
        self.preview = self.greedy_continuation if sampling.greedy else None

    def count(self, context):
        for i in range(self.counted, len(context)):
            self.unigrams[context[i]] += 1
            if i > 0:
                self.bigrams[context[i - 1]][context[i]] += 1
        self.counted = len(context)

    def counts_after(self, token):
        counts = self.bigrams.get(token) or self.unigrams
        row = torch.zeros(self.vocab_size)
        row[list(counts)] = torch.tensor(list(counts.values()), dtype=row.dtype)
        return row

    def greedy_continuation(self, k):
        """Greedy's k guesses: each the most counted successor of the one before, the smallest id among
        ties (as argmax over q's row would pick), and its share of the counts (how sure the drafter is).
        q is one-hot at each guess, so it is reported as None."""
        self.count(self.context)
        guesses, shares, previous = [], [], self.context[-1]
        for _ in range(k):
            counts = self.bigrams.get(previous) or self.unigrams
            previous = min(counts, key=lambda token: (-counts[token], token))
            guesses.append(previous)
            shares.append(counts[previous] / counts.total())
        return guesses, shares

    def propose(self, k, sampling, generator, keep_guessing=None):
        if sampling.greedy:
            return torch.tensor(self.greedy_continuation(k)[0], dtype=torch.long, device=self.device), None
        if self.generator is None:
            seed = torch.randint(2**62, (1,), generator=generator, device=generator.device)
            self.generator = torch.Generator().manual_seed(int(seed))
        self.count(self.context)
        drafts, qs, previous = [], [], self.context[-1]
        for _ in range(k):
            q = adjust(self.counts_after(previous).log(), sampling)  # same standardization as p
            previous = int(sample(q, self.generator))
            drafts.append(previous)
            qs.append(q)
        if not drafts:
            return torch.zeros(0, dtype=torch.long, device=self.device), None
        return torch.tensor(drafts, device=self.device), torch.stack(qs).to(self.device)

    def accept(self, tokens, tokens_on_device):
        self.context += tokens


class LookupDrafter:
    """Paper 3.6's copy heuristic (prompt lookup): find the most recent earlier occurrence of the
    longest suffix of the context (up to `max_ngram` tokens) and propose the tokens that followed it.
    A copy that runs into the end of the context goes on copying its own guesses, as an overlapping
    LZ77 copy does, so text that repeats with a period shorter than k still yields k guesses.
    The guesses are deterministic (q one-hot, reported as None); no match means no guesses this step.
    An index of every n-gram's last two end positions makes a proposal O(max_ngram), however long
    the context."""

    name, model = "lookup", None
    encoder_calls = 0
    calls = 0

    def __init__(self, vocab_size, device, max_ngram=3):  # NgramDrafter's signature; no q, so no vocab_size
        self.device, self.max_ngram = device, max_ngram

    def start(self, prompt_ids, max_new_tokens, sampling=Sampling()):
        self.context = []
        self.latest, self.earlier = {}, {}  # n-gram -> end position of its latest / previous occurrence
        self.extend(prompt_ids.view(-1).tolist())

    def extend(self, tokens):
        for token in tokens:
            self.context.append(token)
            end = len(self.context) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                gram = tuple(self.context[end + 1 - n:])
                if gram in self.latest:
                    self.earlier[gram] = self.latest[gram]
                self.latest[gram] = end

    def continuation(self, k):
        """The k guesses, and the length of the match they copy from (0: none, no guesses)."""
        # The suffix's latest occurrence is the suffix itself; copy what followed the one before it.
        for n in range(min(self.max_ngram, len(self.context) - 1), 0, -1):
            end = self.earlier.get(tuple(self.context[-n:]))
            if end is not None:
                period = len(self.context) - 1 - end  # the copy repeats what lies between match and suffix
                return [self.context[end + 1 + i % period] for i in range(k)], n
        return [], 0

    def preview(self, k):
        """The guesses; the longer the match they copy from, the surer (a 1-token match is often chance)."""
        guesses, matched = self.continuation(k)
        return guesses, [matched / self.max_ngram] * len(guesses)

    def propose(self, k, sampling, generator, keep_guessing=None):
        return torch.tensor(self.continuation(k)[0] if k else [], dtype=torch.long, device=self.device), None

    def accept(self, tokens, tokens_on_device):
        self.extend(tokens)


MODEL_FREE = {"ngram": NgramDrafter, "lookup": LookupDrafter}
