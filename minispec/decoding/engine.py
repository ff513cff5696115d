"""The decoding engine: requests decoded together, each in a row of the static KV caches with its own
length (a lone request is a batch of one). Every kind of decoding runs through this one loop:

    every step:  waiting requests take the free cache rows (continuous batching)
                 speculative.step: each row guesses, one target forward over all rows, each verifies
                 rows that end (EOS, stop, max tokens) leave; the last rows move into the gaps

Forwards are row-invariant and each row draws from its own generator, so a request's output is what it
gives alone, token for token for a seed ("auto" in a batch may choose other γ: the same distribution).
"""

import time
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..models.kernels import to_device
from .drafters import Ask
from .sampling import Counts
from .speculative import Outcome, step


class Segment(NamedTuple):
    """A run of a trace: token ids of one kind, "target", "accepted", "rejected" (alternatives, not a
    sequence: a tree's every child rejected where its walk stopped) or "corrected"."""
    ids: list
    kind: str


@dataclass
class Generation:
    tokens: list  # generated token ids, prompt excluded
    text: str | None  # decoded tokens (None when the model has no tokenizer)
    stats: dict
    trace: list = field(default_factory=list)  # Segments in generation order
    sequences: list = field(default_factory=list)  # beam search's w final hypotheses, best first
    scores: list = field(default_factory=list)  # and their scores (sum of log-probs / length)
    logprobs: list | None = None  # with logprobs=k: a speculative.TokenLogprob for each token


class Update(NamedTuple):
    """A step's news of one request; generation: its Generation at its last step (None before)."""
    index: int
    tokens: list
    logprobs: list | None
    segments: list
    generation: Generation | None


class Row:
    """A request in the batch: its settings, random stream, output, statistics and target cache row length."""

    def __init__(self, index, request, slot, target, alone, prefixes=None):
        self.index, self.request, self.slot = index, request, slot
        self.sampling, self.lenience = request.sampling, request.lenience
        self.drafter, self.policy = request.drafter, request.policy
        self.generator = torch.Generator(device=target.device).manual_seed(request.seed)
        self.noise = None  # coupling "gumbel": each position's draws from the seed and the position alone
        if request.coupling == "gumbel" and not self.sampling.greedy and self.lenience == 1:
            from .noise import Noise  # read by sampled requests only: greedy ones draw nothing
            self.noise = Noise(request.seed, target.vocab_size, target.device)
        self.started = time.perf_counter()
        self.tokens, self.trace = [], []
        self.new_tokens, self.segments = [], []  # the last step's, for the caller
        # speculative.TokenLogprob of each output token when the request asks (logprobs), else None
        self.logprobs = self.new_logprobs = None if request.logprobs is None else []
        self.stats = {"seed": request.seed, "target_calls": 0}
        before = target.encoder_calls
        self.unseen = target.encode_row(slot, request.prompt_ids).view(-1)  # tokens its cache row has not seen
        self.stats["encoder_calls"] = target.encoder_calls - before
        self.length = 0  # positions its target cache row holds
        self.states = None  # the target's states at its tokens, when the prefix cache stores them for a draft head
        self.counts = counts(target, request) if self.sampling.penalized else None
        self.grammar = None if request.grammar is None else request.grammar.copy()  # decoding/grammar.py
        self.forcing = []  # this step's guesses forced by the grammar
        if self.drafter:
            self.drafter.start(request.prompt_ids, self.sampling, slot)
            self.policy.start(target, self.drafter, request.prompt_ids, timed=alone, tree=request.trees == "auto")
            self.stats.update(proposed=0, accepted=0, verified=0, accepted_lengths=[0] * (self.policy.k_max + 1),
                              verified_at=[0] * self.policy.k_max, accepted_at=[0] * self.policy.k_max)
            self.overlap = torch.zeros((), device=target.device)  # Σ_x min(p, q) over verified positions
        if prefixes is not None:  # the prompt's stored prefix copied into its cache rows (decoding/prefix.py)
            prefixes.admit(self)

    def ask(self):
        """This step's Ask: γ as the policy chooses, never past max_new_tokens (none when the grammar forces)."""
        most = 0 if self.forcing else min(self.policy.k_max, self.request.max_new_tokens - len(self.tokens) - 1)
        return Ask(self.drafter, 0 if self.forcing else min(self.policy.guesses(), most), self.sampling, self.generator,
                   self.policy.keep_guessing, self.tree_budget(), self.counts, self.noise, self.grammar, most)

    def forced(self):
        """The tokens the grammar forces next, this step's guesses (host ids; none without a grammar)."""
        most = self.request.max_new_tokens - len(self.tokens) - 1
        self.forcing = [] if self.grammar is None else self.grammar.forced(most)
        return self.forcing

    def advance(self, step):
        """Take a verified step (an Outcome), cut at a stop. Returns whether the request has ended."""
        n, guesses, k = step.n, step.guesses, len(step.guesses)
        new_tokens, stopped = self.request.stop.cut(guesses[:n] + [step.t])
        if self.drafter and not self.forcing:  # forced guesses are no drafter's
            draft_seconds, step_seconds = step.timing or (None, None)
            fresh = not self.stats["target_calls"]  # the prompt's forward also verified the first guesses
            self.policy.observe(k, n, new_tokens, draft_seconds, None if fresh else step_seconds, step.nodes)
            if step.overlap is not None:  # only the positions up to a stop count
                self.overlap += step.overlap[:len(new_tokens)].sum()
        self.count(guesses, n, new_tokens, guesses[n:n + 1] if step.rejected is None else step.rejected)
        if self.noise is not None:
            self.noise.begin(len(self.tokens))
        if step.logprobs is not None:
            self.new_logprobs = step.logprobs[:len(new_tokens)]
            self.logprobs += self.new_logprobs
        fed = len(self.unseen) + len(new_tokens) - 1  # the tokens of the output fed so far: not those after a stop
        if self.request.on_states is not None:
            self.request.on_states(self.index, step.seen.tokens[:fed], step.seen.states[:fed])
        if self.states is not None:
            self.states.append(step.seen.states[:fed])
        if stopped:
            return True
        if self.grammar is not None:
            self.grammar.advance(new_tokens)
        self.length -= k - n  # the rejected guesses leave the cache row; t is fed next
        self.unseen = step.accepted[-1:]
        if self.counts is not None:
            generated = self.counts.generated
            generated.index_put_((step.accepted,), generated.new_ones(()), accumulate=True)
        if self.drafter:
            self.drafter.accept(new_tokens, step.accepted, step.seen)
        return len(self.tokens) >= self.request.max_new_tokens

    def tree_budget(self):
        """The most nodes this step's tree may have, within the row's room (None: a chain)."""
        tree = self.policy.tree_nodes if self.request.trees == "auto" else self.request.trees
        return min(tree, self.request.target.cache_max_seq_len - self.length - len(self.unseen)) if tree else None

    def advance_tree(self, nodes, verdict, timing, seen=None, logprobs=None):
        """Take a verified tree step (a TreeVerdict): the path's keys and values become a chain after the root,
        and then it is the step of a chain of the path and its first rejected child."""
        path, t, rejected = verdict
        root = self.length - len(nodes) - 1  # the root's slot: the last token fed before the nodes
        self.request.target.keep(self.slot, [root + 1 + j for j in path], root + 1)
        guesses = [nodes[j] for j in path] + rejected[:1]
        self.length = root + 1 + len(guesses)  # as if the chain of `guesses` had been verified
        self.stats["tree_nodes"] = self.stats.get("tree_nodes", 0) + len(nodes)
        accepted = to_device(guesses[:len(path)] + [t], self.unseen.device)
        return self.advance(Outcome(len(path), guesses, t, accepted, None, timing, seen, rejected, len(nodes),
                                    logprobs))

    def count(self, guesses, n, new_tokens, rejected):
        """Count a step into the statistics and its Segments into the trace, coloured like the paper's Figure 1."""
        k, stats = len(guesses), self.stats
        if not stats["target_calls"]:
            stats["first_call_tokens"] = len(new_tokens)  # out of the prompt's forward
        stats["target_calls"] += 1
        if self.drafter and not self.forcing:  # the drafter's: forced guesses are the grammar's
            # Only what was emitted counts: a stop among the accepted guesses cuts off those after it.
            emitted = min(n, len(new_tokens))
            stats["proposed"] += k
            stats["accepted"] += emitted
            verified = min(n + 1, k, len(new_tokens))
            stats["verified"] += verified
            stats["accepted_lengths"][emitted] += 1
            for i in range(verified):  # the guess at each position: how far into a step guesses survive
                stats["verified_at"][i] += 1
                stats["accepted_at"][i] += i < emitted
        segments = [Segment(new_tokens[:n], "accepted")]
        if len(new_tokens) > n:  # the target's token was not cut off by a stop among the guesses
            segments += [Segment(rejected, "rejected")] if n < k else []
            segments += [Segment([new_tokens[n]], "corrected" if n < k else "target")]
        self.new_tokens, self.segments = new_tokens, [segment for segment in segments if segment.ids]
        self.tokens += new_tokens
        for ids, kind in self.segments:  # one Segment per run of the same kind
            if self.trace and self.trace[-1].kind == kind:
                self.trace[-1].ids.extend(ids)
            else:
                self.trace.append(Segment(list(ids), kind))

    def finish(self):
        """The ended request's Generation, its statistics complete (design.md, "What stats holds")."""
        stats, seconds = self.stats, time.perf_counter() - self.started
        stats.update(new_tokens=len(self.tokens), seconds=seconds,
                     tokens_per_second=len(self.tokens) / seconds if seconds > 0 else float("inf"),
                     draft_encoder_calls=self.drafter.encoder_calls if self.drafter else 0)
        if self.drafter:
            verified = stats["verified"]
            stats["draft_calls"] = self.drafter.calls
            stats["acceptance_rate"] = stats["accepted"] / verified if verified else 0.0
            # With one-hot p and q, Σ min(p, q) is 1 at an accepted guess and 0 at a rejected one.
            overlap = stats["accepted"] if self.sampling.greedy and self.lenience == 1 else self.overlap.item()
            stats["alpha"] = overlap / verified if verified else 0.0
            stats["tokens_per_target_call"] = len(self.tokens) / max(stats["target_calls"], 1)
            stats.update(self.policy.finish())
            if hasattr(self.drafter, "finish"):  # a drafter that learns from whole requests (decoding/suffix.py)
                self.drafter.finish(self.tokens)
        text = final_text(self.request.target, self.request.stop, self.tokens)
        return Generation(self.tokens, text, stats, self.trace, logprobs=self.logprobs)


def counts(target, request):
    """A penalized request's Counts: nothing generated yet, and its prompt's tokens (an encoder's: none)."""
    prompt = torch.zeros(target.vocab_size, dtype=torch.bool, device=target.device)
    if not target.is_encoder_decoder:
        prompt[request.prompt_ids.view(-1).to(target.device)] = True
    return Counts(torch.zeros(target.vocab_size, device=target.device), prompt)


def final_text(target, stop, tokens):
    """The tokens decoded, ending before the stop string that ended them (None without a tokenizer)."""
    text = target.tokenizer.decode(tokens, skip_special_tokens=True) if target.tokenizer else None
    if text is not None and stop.text_end is not None:  # a stop string ended it: the text ends before it
        text = stop.text.text[:stop.text_end]
    return text


@torch.inference_mode()
def decode(target, requests, rows, cancelled=None, prefixes=None):
    """Decode checked requests (api.Request, one kind of drafter) at most `rows` at a time, yielding each
    row's Update every step. `requests`: a list, or a source whose take(free, wait) returns up to `free`
    (index, request) pairs, blocking if `wait` and returning none then only when no more will come.
    Rows whose cancelled(index) is true leave without news; `prefixes`: a prefix.PrefixCache."""
    source = requests if hasattr(requests, "take") else Waiting(requests)
    batch = []  # batch[i] lives in cache row i, of the target and of a draft model
    while True:
        if cancelled is not None:
            leave(batch, [row for row in batch if cancelled(row.index)], cache_models(target, batch))
        for index, request in source.take(rows - len(batch), wait=not batch):
            batch.append(Row(index, request, len(batch), target, alone=rows == 1, prefixes=prefixes))
            if len(batch) > 1:
                from .prefix import share_prompt  # rows that may share a prompt's forward: read only then
                share_prompt(target, batch)
        if not batch:
            return
        plan = None
        if len(batch) > 1 and hasattr(batch[0].policy, "chosen"):
            from .batched import choose  # gamma="auto" in a batch: read only then
            plan, started = choose(batch), time.perf_counter()
        ended = step(target, batch)
        if plan is not None:
            plan.load.timed(plan, time.perf_counter() - started)
        for row in batch:
            generation = None
            if row in ended:
                row.stats["batch_size"] = rows
                generation = row.finish()
                if prefixes is not None:
                    prefixes.finish(row)
            yield Update(row.index, row.new_tokens, row.new_logprobs, row.segments, generation)
        leave(batch, ended, cache_models(target, batch))


class Waiting:
    """A list of requests as decode's source: all of them waiting from the start."""

    def __init__(self, requests):
        self.queue = deque(enumerate(requests))

    def take(self, free, wait):  # nothing to wait for: what is not here now never comes
        return [self.queue.popleft() for _ in range(min(free, len(self.queue)))]


def cache_models(target, batch):
    """The models whose caches hold the batch's rows: the target, and a draft model if the rows have one."""
    draft = batch[0].drafter.model if batch and batch[0].drafter else None
    return [target] + ([draft] if draft is not None else [])


def leave(batch, ended, models):
    """Ended rows leave; rows past the new end move into the gaps, so rows stay 0..len-1."""
    kept = len(batch) - len(ended)
    holes = [row.slot for row in ended if row.slot < kept]
    for hole, row in zip(holes, [row for row in batch[kept:] if row not in ended]):
        for model in models:  # the target's cache row, then a draft model's
            model.move_row(row.slot, hole, row.length if model is models[0] else row.drafter.length)
        batch[hole], row.slot = row, hole
        if row.drafter is not None and row.drafter.model is not None:
            row.drafter.row = hole
    del batch[kept:]
