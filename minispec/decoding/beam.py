"""Beam search as transformers' (length_penalty=1.0, early_stopping=True), beams in the KV cache's batch
dimension, and speculative beam search (Leviathan et al. 2023, Appendix A.4), one target forward:

    H_1..H_k = draft beam search of width u >= w for k <= γ steps, from the target's beams B_0
    target logits at every node of the trie B_0 ∪ H_1 ∪ ... ∪ H_k, in ONE batched forward
    for j = 1, 2, ...:  B_j = the target's beam step from its logits at B_{j-1}
                        continue while B_j ⊆ H_j  (top_w(M_p) ⊆ top_u(M_q): B_j's logits are known)

Every step is `beam_step` on the target's own logits, so the result is target-only beam search.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .costs import graphs_met, reads_on_host
from .drafters import ModelDrafter
from .sampling import Sampling


def check_settings(w, u, drafter, sampling, lenience):
    """Clear errors for what beam search cannot do. The draft's width u (0: none)."""
    if sampling != Sampling() or lenience != 1:
        raise ValueError("beam search is deterministic: it cannot be combined with sampling "
                         "(temperature, top_k, top_p) or lenience")
    if drafter is None:
        if u is not None:
            raise ValueError("draft_beams (the draft's beam width) needs a draft model")
        return 0
    if not isinstance(drafter, ModelDrafter) or drafter.reads_states:
        raise ValueError("speculative beam search needs a draft model: 'ngram', 'lookup', 'suffix' and draft "
                         "heads guess one sequence, not a beam of them")
    u = w if u is None else u
    if u < w:
        raise ValueError(f"draft_beams (the draft's beam width u) must be an integer >= beams ({w}), got {u!r}")
    return u


def working_bytes(rows, length, vocab):
    """Beam search's largest temporaries: PrefixCache.logits' row comparisons and a step's float32 sums."""
    return rows * rows * length * 9 + rows * vocab * 12


@dataclass
class Beams:
    tokens: torch.Tensor  # [w, n] the running hypotheses' generated ids
    scores: torch.Tensor  # [w] float32 sums of log-probabilities
    finished: list = field(default_factory=list)  # (sum / length, ids), best first, at most w

    @classmethod
    def start(cls, w, device):
        # w copies of the empty hypothesis, all but one impossible: step 1 must not pick a token w times.
        scores = torch.full((w,), float("-inf"), device=device)
        scores[0] = 0.0
        return cls(torch.zeros(w, 0, dtype=torch.long, device=device), scores)


def beam_step(beams, logits, stop_ids, max_new_tokens):
    """One step of beam search from float32 logits [w, vocab] at the running beams -> (beams, done)."""
    w, vocab = logits.shape
    total = (logits.float().log_softmax(-1) + beams.scores[:, None]).view(-1)
    # each beam has len(stop_ids) EOS extensions: the best (1 + len(stop_ids))·w hold w that run on
    top, index = total.topk((1 + len(stop_ids)) * w)
    tokens = torch.cat([beams.tokens[index // vocab], (index % vocab)[:, None]], 1)
    length = tokens.shape[1]
    ends = [t in stop_ids or length == max_new_tokens for t in tokens[:, -1].tolist()]
    finished = beams.finished
    if any(ends[:w]):  # only the best w extensions may finish
        new = zip((top[:w] / length).tolist(), tokens[:w].tolist(), ends)
        finished = sorted(finished + [(score, ids) for score, ids, end in new if end], key=lambda h: -h[0])[:w]
    running = [i for i, end in enumerate(ends) if not end][:w]
    done = len(finished) == w or length == max_new_tokens
    return Beams(tokens[running], top[running], finished), done


class PrefixCache:
    """A static KV cache whose rows hold known sequences: a new one reuses its longest cached prefix's row."""

    def __init__(self, model, prefix, batch_size, max_new_tokens):
        self.model, self.prefix = model, prefix  # prefix [1, p]: what the decoder starts from (model.encode)
        self.length = prefix.shape[1] + max_new_tokens
        model.ensure_caches(batch_size, self.length)
        model.rollback(0)
        self.cached_ids = prefix.new_zeros(batch_size, 0)  # the ids at each row's cached positions

    def grow(self, batch_size):
        """Room for `batch_size` rows; caches allocated anew start empty."""
        before = self.model.cache_batch_size, self.model.cache_max_seq_len
        self.model.ensure_caches(batch_size, self.length)
        if (self.model.cache_batch_size, self.model.cache_max_seq_len) != before:
            self.model.rollback(0)
            self.cached_ids = self.cached_ids[:, :0]

    def logits(self, tokens, first):
        """Generated ids [b, n] -> logits [b, n + 1 - first, vocab] after tokens[:, :i], i = first..n."""
        seqs = torch.cat([self.prefix.expand(len(tokens), -1), tokens], 1)
        start = self.prefix.shape[1] + first - 1  # the position whose logits predict generated token `first`
        m = min(self.cached_ids.shape[1], start)
        p = min(self.prefix.shape[1], m)  # every row starts with the prefix: compare only what follows
        common = p + (seqs[:, None, p:m] == self.cached_ids[None, :, p:m]).int().cumprod(-1).sum(-1)  # [new, cached]
        length, row = common.max(1)
        keep = int(length.min())
        self.cached_ids = seqs
        if keep == 0:
            return self.model.prefill(seqs, logits_for=seqs.shape[1] - start)
        self.model.reorder_cache(row)
        self.model.rollback(keep)
        return self.model.decode(seqs[:, keep:])[:, start - keep:]


@torch.inference_mode()
def beam_search(model, prefix, w, max_new_tokens, stop_ids):
    """Target-only beam search after `prefix` (model.encode's output). Returns (finished, stats)."""
    cache = PrefixCache(model, prefix, w, max_new_tokens)
    beams, done, steps = Beams.start(w, model.device), False, 0
    while not done:
        logits = cache.logits(beams.tokens, beams.tokens.shape[1])[:, 0]
        beams, done = beam_step(beams, logits, stop_ids, max_new_tokens)
        steps += 1
    return beams.finished, {"target_calls": steps, "beam_steps": steps}


def draft_beam_search(cache, beams, u, k, stop_ids):
    """The draft's beam search of width u for k steps from the target's beams: the hypotheses after each."""
    tokens, scores, kept = beams.tokens, beams.scores, []
    pad = torch.arange(u, device=tokens.device)
    for _ in range(k):
        logits = cache.logits(tokens[pad % len(tokens)], tokens.shape[1])[: len(tokens), 0]
        total = logits.float().log_softmax(-1) + scores[:, None]
        total[:, list(stop_ids)] = float("-inf")
        scores, index = total.view(-1).topk(u)
        tokens = torch.cat([tokens[index // total.shape[1]], (index % total.shape[1])[:, None]], 1)
        kept.append(tokens)
    return kept


def trie_rows(roots, kept, batch_size):
    """The trie of hypotheses as batch rows for one forward (a row per leaf), and each depth's node rows."""
    levels = [roots] + kept
    depth = len(kept)
    rows, where = [levels[-1]], [torch.arange(len(levels[-1]), device=roots.device)]
    for j in reversed(range(depth)):
        is_parent = (levels[j + 1][:, None, :-1] == levels[j][None]).all(-1)  # [children, nodes]
        row = where[0][is_parent.int().argmax(0)]  # a node lies on its first child's row
        leaves = ~is_parent.any(0)  # the draft dropped these: each needs a row of its own
        n_rows = sum(map(len, rows))
        row[leaves] = torch.arange(n_rows, n_rows + int(leaves.sum()), device=row.device)
        rows.append(F.pad(levels[j][leaves], (0, depth - j)))
        where.insert(0, row)
    rows = torch.cat(rows)
    return torch.cat([rows, rows[:1].expand(batch_size - len(rows), -1)]), where


@torch.inference_mode()
def speculative_beam_search(target, drafter, prefix, prompt_ids, w, u, policy, max_new_tokens, stop_ids):
    """Beam search of width w guessed by the draft with width u: (finished, stats), as beam_search's."""
    def draft_cache():
        return PrefixCache(drafter.model, drafter.model.encode(prompt_ids.to(drafter.model.device)), u, max_new_tokens)

    # the draft's cache and wide rows only once the policy guesses
    verify = PrefixCache(target, prefix, w, max_new_tokens)
    guess = None if reads_on_host(drafter) else draft_cache()  # on a GPU the policy times a draft step first
    policy.start(target, drafter, prompt_ids, beams=(w, u))
    beams, done = Beams.start(w, target.device), False
    stats = {"target_calls": 0, "draft_calls": 0, "beam_steps": 0, "proposed": 0, "verified": 0, "accepted": 0}
    while not done:
        started, graphs = time.perf_counter(), graphs_met()
        n = beams.tokens.shape[1]
        k = min(policy.guesses(), max_new_tokens - n - 1)  # the step that reaches max_new_tokens needs no guesses
        if k:
            verify.grow(w + u * policy.k_max)  # allocates once; then finds room
            guess = guess or draft_cache()
        kept = draft_beam_search(guess, beams, u, k, stop_ids)
        drafted = time.perf_counter()
        rows, where = trie_rows(beams.tokens, kept, w + u * k)  # only as many rows as this step needs
        logits = verify.logits(rows, n)  # [rows, k + 1, vocab]: at depths 0..k
        node = torch.arange(w, device=target.device)  # B_0's nodes at depth 0
        accepted = 0
        for j in range(k + 1):
            beams, done = beam_step(beams, logits[where[j][node], j], stop_ids, max_new_tokens)
            stats["beam_steps"] += 1
            if done or j == k:
                break
            stats["verified"] += 1
            same = (beams.tokens[:, None] == kept[j][None]).all(-1)  # [w, u]
            if not same.any(1).all():  # top_w(M_p) ⊄ top_u(M_q): the next step's logits are unknown
                break
            node = same.int().argmax(1)
            accepted += 1
        # untimed: the prompt's forward, and a step whose forwards compiled a graph first
        timed = n and graphs_met() == graphs
        policy.observe(k, accepted, [], drafted - started, time.perf_counter() - started if timed else None)
        stats["accepted"] += accepted
        stats["target_calls"] += 1
        stats["draft_calls"] += k
        stats["proposed"] += k
    stats["acceptance_rate"] = stats["accepted"] / stats["verified"] if stats["verified"] else 0.0
    stats["steps_per_target_call"] = stats["beam_steps"] / stats["target_calls"]
    stats.update(policy.finish())
    return beams.finished, stats


def search(target, prefix, drafter, prompt_ids, w, u, policy, max_new_tokens, stop_ids):
    """generate()'s beam search: (sequences, scores, stats), the w final hypotheses best first."""
    if drafter is None:
        finished, stats = beam_search(target, prefix, w, max_new_tokens, stop_ids)
    else:
        finished, stats = speculative_beam_search(target, drafter, prefix, prompt_ids, w, u, policy,
                                                  max_new_tokens, stop_ids)
    scores, sequences = zip(*finished)
    return list(sequences), list(scores), stats
