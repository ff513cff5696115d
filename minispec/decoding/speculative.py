"""Speculative decoding: Algorithm 1 of Leviathan, Kalman & Matias (ICML 2023), step by step.

    for each step:
        x_1..x_γ ~ q_1..q_γ               the drafter guesses γ tokens autoregressively
        p_1..p_{γ+1} = M_p(prefix + x)     the target scores all of them in ONE forward
        r_i ~ U(0, 1)
        n = first i with r_i > p_i(x_i) / q_i(x_i), else γ
        t ~ norm(max(0, p_{n+1} - q_{n+1}))   (just p_{γ+1} when all γ were accepted)
        prefix += x_1..x_n, t

This yields between 1 and γ+1 tokens per target forward, and the tokens have exactly the target's
distribution (Appendix A.1). Greedy decoding is the same algorithm with one-hot p and q: a guess is
accepted iff it is the target's argmax, so the output equals target-only greedy token for token.
`accept_greedy` computes exactly that with a comparison, a few device operations instead of ~30 over
the vocabulary (a test checks it against `accept_and_resample` on one-hot p and q).
Lenience l (Appendix A.5) accepts with probability min(1, p / (l·q)) instead; l = 1 is exact.

Requests are decoded together, each in a row of the static KV caches (minispec.decoding.engine; a lone request
is a batch of one), and `step` is the loop body above for every row at once. After each step both
models' cache rows are rolled back to the accepted sequence by moving their length pointers (the
target's row always holds every accepted token but the last).
"""

import time

import torch

from ..models.kernels import to_device
from .costs import graphs_met
from .drafters import propose_all
from .sampling import adjust, sample
from .tree import feed_parents, sample_walk, walk


def accept_and_resample(p, q, drafts, lenience, generator, greedy_p=None):
    """Algorithm 1's verification, on the device, without a host sync.

    p [k+1, V]: the target's adjusted distributions at the k draft positions and one beyond;
    q [k, V]: the drafter's; drafts [k]. Returns (n, t), both of shape [1]: how many drafts are
    accepted, and the token that follows them. `greedy_p` (raw target softmax) switches on greedy
    lenience: accept x when p(x) >= l * max(p), the paper's rule for argmax sampling.
    """
    k = drafts.shape[0]
    rows = torch.arange(k, device=drafts.device)
    p_x, q_x = p[rows, drafts], q[rows, drafts]
    r = torch.rand(k, generator=generator, device=p.device)
    # r < p/(l·q), written without a division so zeros in p or q (top-k masks, one-hot greedy) are safe.
    accepted = r * lenience * q_x < p_x
    if greedy_p is not None:
        accepted = greedy_p[rows, drafts] >= lenience * greedy_p[:k].amax(-1)
    # The leading run of acceptances, as a 1-element tensor: indexing with a 0-dim tensor would read
    # it on the host, a hidden device sync.
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
    """accept_and_resample at temperature 0 and lenience 1, in a handful of operations. p and q are
    one-hot there, so a guess is accepted iff it is the target's argmax, and after a rejection
    norm(max(0, p - q)) is p itself: t is the target's argmax right after the accepted guesses."""
    best = logits.argmax(-1)
    n = (drafts == best[:-1]).long().cumprod(0).sum().view(1)
    return n, best[n]


@torch.inference_mode()
def step(target, rows):
    """One step of Algorithm 1 for every row of a batch (a lone request is a batch of one row, in cache
    row 0; rows are in cache-row order). Each row verifies its own guesses with its own sampling and
    generator; the guesses of all rows are drafted together and verified in one target forward.
    Returns the rows that ended."""
    models = [target] + [getattr(row.drafter, "model", None) for row in rows]  # whose graphs a step may compile
    started, graphs = time.perf_counter(), graphs_met(*models)
    # Sample γ guesses x_1..x_γ from M_q, γ as each row's policy chooses (never past max_new_tokens).
    if rows[0].drafter is None:  # plain decoding: every step is the target's own token
        proposals = [(torch.zeros(0, dtype=torch.long, device=target.device), None, None)] * len(rows)
    else:
        proposals = propose_all([(row.drafter, row.wanted_guesses(), row.sampling, row.generator,
                                  row.policy.keep_guessing, row.tree_budget()) for row in rows])
    drafted = time.perf_counter()
    # One target forward over every row's unseen tokens and guesses; a row's last k+1 are p_1 .. p_{k+1}
    # (a tree's: p at its root, then at each of its k nodes).
    logits, states = score(target, rows, proposals)
    # n accepted guesses, then t ~ norm(max(0, p_{n+1} - q_{n+1})), for each row. A tree is walked on
    # the host (tree.py): greedy, by the target's argmax at each node; sampled, node by node. A tree's
    # verdict holds in n's place its choices to bring to the host: the argmaxes, or none when sampled.
    verdicts = [verify(p, drafts, q, row.sampling, row.lenience, row.generator) if parents is None
                else (p.argmax(-1) if row.sampling.greedy else drafts[:0], None, None)
                for row, p, (drafts, q, parents) in zip(rows, logits, proposals)]
    parts = [torch.cat([n, drafts, t]) if t is not None else torch.cat([n, drafts])
             for (n, t, _), (drafts, _, _) in zip(verdicts, proposals)]
    host = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()  # the step's one host sync
    # Roll both caches back to the accepted sequence; each target row has yet to see its t.
    ended, start = [], 0
    # A step's time is the row's only when the forwards were its own, and none compiled a graph first.
    timed = len(rows) == 1 and graphs_met(*models) == graphs
    for row, p, (drafts, q, parents), (n, t, overlap), state in zip(rows, logits, proposals, verdicts, states):
        k = drafts.shape[0]
        timing = (drafted - started, time.perf_counter() - started) if timed else None
        if parents is None:
            n, guesses, t_host = host[start], host[start + 1:start + 1 + k], host[start + 1 + k]
            start += k + 2
            done = row.advance(n, guesses, t_host, torch.cat([drafts[:n], t]) if k else t, overlap, timing,
                               seen(row, drafts, state, list(range(n))))
        else:
            choices, nodes = host[start:start + len(n)], host[start + len(n):start + len(n) + k]
            start += len(n) + k
            verdict = walk(nodes, parents, choices) if row.sampling.greedy else \
                sample_walk(nodes, parents, adjust(p, row.sampling), row.generator, q)
            done = row.advance_tree(nodes, parents, *verdict, timing, seen(row, drafts, state, verdict[0]))
        if done:
            ended.append(row)
    return ended


def verify(logits, drafts, q, sampling, lenience, generator):
    """One row's verification: logits [k+1, vocab] of the target at its k guesses `drafts` and one
    beyond, q [k, vocab] (None: one-hot at the guesses). Returns n and t as 1-element device tensors,
    and Σ_x min(p, q) at each verified guess position (zeros past them; None where p and q are one-hot:
    1 at an accepted guess, 0 at a rejected one)."""
    k = drafts.shape[0]
    if k == 0:  # no guesses: the target's own token, drawn as plain decoding draws it
        last = logits[-1]
        t = last.argmax(-1) if sampling.greedy else sample(adjust(last, sampling), generator)
        return torch.zeros(1, dtype=torch.long, device=logits.device), t.view(1), None
    if sampling.greedy and lenience == 1:  # p and q one-hot: verifying is comparing argmaxes
        return *accept_greedy(logits, drafts), None
    p = adjust(logits, sampling)
    q = one_hot(drafts, p.shape[-1]) if q is None else q
    greedy_p = logits.float().softmax(-1) if sampling.greedy else None  # greedy lenience
    n, t = accept_and_resample(p, q, drafts, lenience, generator, greedy_p)
    verified = torch.arange(k, device=p.device) <= n  # positions whose acceptance test ran
    return n, t, torch.minimum(p[:k], q).sum(-1) * verified


def seen(row, drafts, states, kept):
    """For a draft head or a request's on_states (else None): the tokens the target saw this step and
    keeps (the row's unseen tokens and its guesses at indices `kept`), and its hidden state at each."""
    if states is None:
        return None
    u, kept = len(row.unseen), to_device(kept, drafts.device)
    return torch.cat([row.unseen, drafts[kept]]), torch.cat([states[:u], states[u + kept]])


def score(target, rows, proposals):
    """The target's logits [k+1, vocab] at each row's guesses and one beyond: a row that has just
    joined has its prompt forward of its own (its prefill), the others one forward together, each at
    its own positions, rows with fewer tokens padded (models/base.py, decode_rows). A tree's nodes
    each attend to their own path (feed_parents). Also each row's hidden states [width, dim] at every
    token fed when its drafter reads them (a draft head; an EAGLE-3 head's: those entering the layers it
    reads, side by side) or its request's on_states does, else None."""
    logits = [None] * len(rows)
    hidden = rows[0].request.reads_states
    states = [None] * len(rows)
    drafts = [d for d, _, _ in proposals]
    feeds = [torch.cat([row.unseen, d]) if len(d) else row.unseen for row, d in zip(rows, drafts)]
    trees = any(tree is not None for _, _, tree in proposals)  # then every row's feed is a tree
    parents = [feed_parents(len(row.unseen), tree, len(d)) if trees else None
               for row, (d, _, tree) in zip(rows, proposals)]
    widths = [len(feed) if row.length else 0 for row, feed in zip(rows, feeds)]  # rows that join: 0
    for i, row in enumerate(rows):
        if not widths[i]:  # eager: prompt lengths vary from request to request
            out = target.decode_rows(feeds[i].view(1, -1), [0], first_row=i, logits_for=len(drafts[i]) + 1,
                                     eager=True, parents=None if parents[i] is None else [parents[i]], hidden=hidden)
            logits[i], states[i] = (out[0][0], out[1][0]) if hidden else (out[0], None)
            row.length = len(feeds[i])
    if any(widths):
        tokens, _ = target.padded([feed if w else None for feed, w in zip(feeds, widths)])
        out = target.decode_rows(tokens, [row.length for row in rows], widths,
                                 parents=[p if w else [] for p, w in zip(parents, widths)] if trees else None,
                                 hidden=hidden)
        out, fed_states = out if hidden else (out, None)
        for i, (row, w) in enumerate(zip(rows, widths)):
            if w:
                logits[i] = out[i, :w]
                states[i] = None if fed_states is None else fed_states[i, :w]
                row.length += w
    return logits, states
