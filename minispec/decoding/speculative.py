"""Speculative decoding: Algorithm 1 of Leviathan, Kalman & Matias (ICML 2023), SpeculativeDecodingStep.

    Sample γ guesses x_1..x_γ from M_q autoregressively       propose_all (drafters.py) -> Proposal
        q_i(x) = M_q(prefix + [x_1..x_{i-1}]),  x_i ~ q_i(x)
    Run M_p in parallel                                       score: one target forward
        p_1(x)..p_{γ+1}(x) = M_p(prefix), .., M_p(prefix + [x_1..x_γ])
    Determine the number of accepted guesses n               verify -> ChainVerdict
        r_i ~ U(0, 1),  n = min({i - 1 | r_i > p_i(x_i) / q_i(x_i)} ∪ {γ})
    Adjust the distribution from M_p if needed
        p'(x) = p_{n+1}(x), or norm(max(0, p_{n+1}(x) - q_{n+1}(x))) if n < γ
    Return one token from M_p, and n tokens from M_q          Row.advance (engine.py) takes the Outcome
        t ~ p'(x),  prefix + [x_1..x_n, t]

This yields 1 to γ+1 tokens per target forward, with exactly the target's distribution (Appendix A.1).
Greedy is the same with one-hot p and q (`accept_greedy` compares argmaxes). Lenience l (Appendix A.5)
accepts with min(1, p / (l·q)). Coupling "gumbel" draws each position from the seed and the position alone
(noise.py), accepting a guess iff it is the target's draw. `step` runs every row of a batch at once; a row
may guess a tree (tree.py), scored in the same forward and walked on the host.
"""

import math
import time
from array import array
from itertools import islice
from typing import NamedTuple, Optional

import torch

from ..models.kernels import to_device
from .costs import graphs_met
from .drafters import Proposal, forward, propose_all
from .sampling import adjust, log_probs, path_counts, penalize, sample
from .tree import ancestors, depths, feed_parents, sample_walk, walk


class ChainVerdict(NamedTuple):
    """A chain's verification on the device: n and t ([1] each), Σ_x min(p, q) per verified position (or None)."""
    n: torch.Tensor
    t: torch.Tensor
    overlap: Optional[torch.Tensor]


class Seen(NamedTuple):
    """The tokens the target saw and keeps, and its hidden state at each."""
    tokens: torch.Tensor
    states: torch.Tensor


class Timing(NamedTuple):
    """A lone row's step, in seconds: drafting, and all of it."""
    drafting: float
    step: float


class Outcome(NamedTuple):
    """One row's verified step for Row.advance; a tree's is the chain of its accepted path."""
    n: int  # accepted guesses
    guesses: list  # host ids: a chain's, or a tree's accepted path and its first rejected child
    t: int  # the target's token after the accepted guesses
    accepted: torch.Tensor  # the same n + 1 tokens, on the device
    overlap: Optional[torch.Tensor] = None  # ChainVerdict's
    timing: Optional[Timing] = None  # None when the step's forwards were shared with other rows
    seen: Optional[Seen] = None
    rejected: Optional[list] = None  # what the trace shows as rejected (None: the chain's guess after n)
    nodes: int = 0  # a tree's guesses (0: a chain)
    logprobs: Optional[list] = None  # a TokenLogprob for each of the n + 1 tokens, when the request asks


class TokenLogprob(NamedTuple):
    """An output token's log-probability (sampling.log_probs) and the k likeliest (token, log-probability)."""
    token: int
    logprob: float
    top: list


class HostStep(NamedTuple):
    """One row's part of the step's host transfer (to_host)."""
    guesses: list  # a chain's guesses, or a tree's nodes
    n: Optional[int]  # a chain's
    t: Optional[int]  # a chain's
    choices: Optional[list]  # a tree's: the target's token at its root and each node (tree_choices; else None)
    logprobs: Optional[list]  # a TokenLogprob at each position scored (a chain's k + 1; a greedy tree's every node)


def accept_and_resample(p, q, drafts, lenience, generator, greedy_p=None):
    """Algorithm 1's verification without a host sync: p [k+1, V], q [k, V], drafts [k] -> (n, t), [1] each.
    `greedy_p` (the raw softmax) switches on greedy lenience: accept x when p(x) >= l * max(p)."""
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    p_x, q_x = p[rows, drafts], q[rows, drafts]
    r = torch.rand(k, generator=generator, device=p.device)
    # r < p/(l·q), written without a division so zeros in p or q (top-k masks, one-hot greedy) are safe.
    accepted = r * lenience * q_x < p_x
    if greedy_p is not None:
        accepted = greedy_p[rows, drafts] >= lenience * greedy_p[:k].amax(-1)
    # a 1-element tensor: indexing with a 0-dim one would be a hidden host sync
    n = accepted.long().cumprod(0).sum().view(1)
    # p' = norm(max(0, p_{n+1} - q_{n+1})); with q_{γ+1} := 0 this is p_{γ+1} when all were accepted.
    p_next, q_next = p[n], torch.cat([q, q.new_zeros(1, q.shape[1])])[n]
    residual = (p_next - q_next).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_next)  # p == q up to rounding: p itself
    return n, sample(residual, generator)  # sample() needs no normalization


def one_hot(drafts, vocab_size):
    """q [k, vocab] of deterministic guesses, which drafters report as None."""
    q = torch.zeros(drafts.shape[0], vocab_size, device=drafts.device)
    return q.scatter_(1, drafts.view(-1, 1), 1.0)


def accept_greedy(logits, drafts):
    """accept_and_resample with one-hot p and q: a guess is accepted iff it is the target's argmax."""
    return accept_choices(logits.argmax(-1), drafts)


def accept_choices(choices, drafts):
    """n, t ([1] each) from the target's token at each position, choices [k + 1]."""
    n = (drafts == choices[:-1]).long().cumprod(0).sum().view(1)
    return n, choices[n]


@torch.inference_mode()
def step(target, rows):
    """Algorithm 1's SpeculativeDecodingStep for every row of a batch (in cache-row order), drafted together and
    scored in one forward, each verified with its own sampling and generator. The rows that ended."""
    started, graphs = time.perf_counter(), graphs_met()
    # Sample γ guesses x_1..x_γ from M_q autoregressively (γ as each row's policy chooses; or the grammar's).
    forced = [row.forced() for row in rows]
    if rows[0].drafter is None:  # plain decoding: every step is the target's own token
        proposals = [Proposal(torch.zeros(0, dtype=torch.long, device=target.device), None)] * len(rows)
    else:
        proposals = propose_all([row.ask() for row in rows])
    proposals = [grammatical(row, f, x) for row, f, x in zip(rows, forced, proposals)]
    drafted = time.perf_counter()
    # Run M_p in parallel: p_1..p_{γ+1} in one forward over every row's unseen tokens and guesses.
    logits, states = score(target, rows, proposals)
    logits = [constrained(row, p, x) for row, p, x in zip(rows, logits, proposals)]
    # Determine the number of accepted guesses n, and t ~ p', on the device (a tree: walked on the host).
    verdicts = [verify(p, x.drafts, x.q, row.sampling, row.lenience, row.generator, row.noise)
                if x.parents is None else None for row, p, x in zip(rows, logits, proposals)]
    host = to_host(rows, logits, proposals, verdicts)
    # A step's time is the row's only when the forwards were its own, and none compiled a graph first.
    timed = len(rows) == 1 and graphs_met() == graphs
    timing = Timing(drafted - started, time.perf_counter() - started) if timed else None
    # Return prefix + [x_1..x_n, t]: both caches roll back to it; each target row has yet to see its t.
    ended = []
    for row, p, x, verdict, got, state in zip(rows, logits, proposals, verdicts, host, states):
        if x.parents is None:
            accepted = torch.cat([x.drafts[:got.n], verdict.t]) if len(x.drafts) else verdict.t
            done = row.advance(Outcome(got.n, got.guesses, got.t, accepted, verdict.overlap, timing,
                                       seen(row, x.drafts, state, list(range(got.n))),
                                       logprobs=None if got.logprobs is None else got.logprobs[:got.n + 1]))
        else:
            tree = walk(got.guesses, x.parents, got.choices) if got.choices is not None else \
                sample_walk(got.guesses, x.parents, adjust(p, row.sampling), row.generator, x.q)
            done = row.advance_tree(got.guesses, tree, timing, seen(row, x.drafts, state, tree.path),
                                    tree_logprobs(row, p, got, tree))
        if done:
            ended.append(row)
    return ended


def constrained(row, logits, proposal):
    """A row's logits with its penalties (each position counting the guesses on its path) and its grammar's mask."""
    if row.counts is not None:
        k, parents = len(proposal.drafts), proposal.parents
        paths = torch.ones(k, k, device=logits.device).tril() if parents is None else ancestors(parents, logits.device)
        generated = path_counts(row.counts.generated, proposal.drafts, paths)
        logits = penalize(logits, row.sampling, generated, row.counts.prompt)
    return logits if row.grammar is None else row.grammar.mask(logits, proposal.drafts, proposal.parents)


def grammatical(row, forced, proposal):
    """A row's Proposal under its grammar: the tokens it forces, or a chain cut before its first forbidden guess."""
    if forced:
        return Proposal(to_device(forced, proposal.drafts.device), None)
    if row.grammar is None or proposal.parents is not None:
        return proposal
    n = row.grammar.valid(proposal.drafts)
    return Proposal(proposal.drafts[:n], None if proposal.q is None else proposal.q[:n])


def to_host(rows, logits, proposals, verdicts):
    """The step's one host sync: each row's HostStep."""
    parts, asked, walked = [], [], []
    for row, p, x, v in zip(rows, logits, proposals, verdicts):
        walked.append(v is None and (row.sampling.greedy or row.noise is not None))
        choices = tree_choices(row, p, x.parents) if walked[-1] else x.drafts[:0]
        ids = [v.n, x.drafts, v.t] if v is not None else [choices, x.drafts]
        asked.append(row.request.logprobs is not None and (v is not None or walked[-1]))
        if asked[-1]:  # a sampled tree's tokens are known only after its walk (tree_logprobs)
            # a chain's: the token it emits at each position if it gets there
            tokens = choices if v is None else torch.cat([x.drafts, v.t]).scatter(0, v.n, v.t)
            ids.append(scored(p, row.sampling, tokens, row.request.logprobs))
        parts.append(ids)
    host, out = iter(torch.cat([part.view(-1) for row in parts for part in row]).tolist()), []
    for row, wanted, x, known in zip(parts, asked, proposals, walked):
        lists = [list(islice(host, part.numel())) for part in row]
        logprobs = unpack(lists.pop(), len(x.drafts) + 1) if wanted else None
        if x.parents is None:
            out.append(HostStep(lists[1], lists[0][0], lists[2][0], None, logprobs))
        else:
            out.append(HostStep(lists[1], None, None, lists[0] if known else None, logprobs))
    return out


def tree_choices(row, logits, parents):
    """The target's token at a tree's root and each node: its argmax, or (coupled) its draw there."""
    if row.sampling.greedy:
        return logits.argmax(-1)
    return sample(adjust(logits, row.sampling), row.noise, at=[0] + depths(parents))


def scored(logits, sampling, tokens, k):
    """[m, 2 + 2k] long for the host: each row's token, its and the top k's log-probabilities (bits), the top k."""
    logprobs = log_probs(logits, sampling)
    top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    values = torch.cat([logprobs.gather(-1, tokens.view(-1, 1)), top.values], -1)
    return torch.cat([tokens.view(-1, 1), values.view(torch.int32).long(), top.indices], -1)


def unpack(host, m):
    """scored()'s m rows, read on the host -> a TokenLogprob each."""
    width = len(host) // m
    k = (width - 2) // 2
    out = []
    for i in range(0, len(host), width):
        row = host[i:i + width]
        values = array("f", array("i", row[1:k + 2]).tobytes()).tolist()
        top = [(token, value) for token, value in zip(row[k + 2:], values[1:]) if value != -math.inf]
        out.append(TokenLogprob(row[0], values[0], top))
    return out


def tree_logprobs(row, logits, got, tree):
    """A TokenLogprob for each token of a tree's accepted path and t, when the request asks."""
    if row.request.logprobs is None:
        return None
    at = [0] + [1 + j for j in tree.path]  # the rows of logits that chose each token
    if got.logprobs is not None:
        return [got.logprobs[i] for i in at]
    tokens = torch.tensor([got.guesses[j] for j in tree.path] + [tree.t], device=logits.device)
    return unpack(scored(logits[at], row.sampling, tokens, row.request.logprobs).view(-1).tolist(), len(at))


def verify(logits, drafts, q, sampling, lenience, generator, noise=None):
    """One row's verification of its k guesses (q None: one-hot) -> ChainVerdict."""
    k = drafts.shape[0]
    if k == 0 and noise is None:  # no guesses: the target's own token, drawn as plain decoding draws it
        last = logits[-1]
        t = last.argmax(-1) if sampling.greedy else sample(adjust(last, sampling), generator)
        return ChainVerdict(torch.zeros(1, dtype=torch.long, device=logits.device), t.view(1), None)
    if sampling.greedy and lenience == 1:  # p and q one-hot: verifying is comparing argmaxes
        return ChainVerdict(*accept_greedy(logits, drafts), None)
    p = adjust(logits, sampling)
    q = one_hot(drafts, p.shape[-1]) if q is None else q
    if noise is not None:  # the target's own draw at each position; the guesses equal to them are accepted
        n, t = accept_choices(sample(p, noise), drafts)
    else:
        greedy_p = logits.float().softmax(-1) if sampling.greedy else None  # greedy lenience
        n, t = accept_and_resample(p, q, drafts, lenience, generator, greedy_p)
    verified = torch.arange(k, device=p.device) <= n  # positions whose acceptance test ran
    return ChainVerdict(n, t, torch.minimum(p[:k], q).sum(-1) * verified)


def seen(row, drafts, states, kept):
    """Seen: the row's unseen tokens and its guesses at `kept`, with their states (None without states)."""
    if states is None:
        return None
    u, kept = len(row.unseen), to_device(kept, drafts.device)
    return Seen(torch.cat([row.unseen, drafts[kept]]), torch.cat([states[:u], states[u + kept]]))


def score(target, rows, proposals):
    """Each row's target logits [k+1, vocab] and hidden states at the tokens fed (None unless something reads them)."""
    logits, states, hidden = [None] * len(rows), [None] * len(rows), rows[0].request.reads_states
    drafts = [x.drafts for x in proposals]
    feeds = [torch.cat([row.unseen, d]) if len(d) else row.unseen for row, d in zip(rows, drafts)]
    trees = any(x.parents is not None for x in proposals)  # then every row's feed is a tree
    parents = [feed_parents(len(row.unseen), x.parents, len(x.drafts)) if trees else None
               for row, x in zip(rows, proposals)]
    # rows that join: 0 (their cache rows may hold a stored prefix of the prompt, decoding/prefix.py)
    widths = [len(feed) if row.stats["target_calls"] else 0 for row, feed in zip(rows, feeds)]
    for i, row in enumerate(rows):
        if not widths[i]:  # eager: prompt lengths vary from request to request
            out, fed_states = forward(target, [feeds[i]], [row.length], None if parents[i] is None else [parents[i]],
                                      hidden=hidden, first_row=i, logits_for=len(drafts[i]) + 1, eager=True)
            logits[i], states[i] = out[0], None if fed_states is None else fed_states[0]
            row.length += len(feeds[i])
    if any(widths):
        out, fed_states = forward(target, [feed if w else None for feed, w in zip(feeds, widths)],
                                  [row.length for row in rows],
                                  [p if w else [] for p, w in zip(parents, widths)] if trees else None, hidden=hidden)
        for i, (row, w) in enumerate(zip(rows, widths)):
            if w:
                logits[i] = out[i, :w]
                states[i] = None if fed_states is None else fed_states[i, :w]
                row.length += w
    return logits, states
