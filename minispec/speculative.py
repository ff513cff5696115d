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

Both models keep static KV caches; after each step they are rolled back to the accepted sequence by
moving their length pointers (the target's cache always holds every accepted token but the last).
"""

import time

import torch

from .sampling import adjust, sample


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
def speculative(target, drafter, prompt_ids, prefix, max_new_tokens, sampling, stop, generator, policy, lenience,
                stats):
    """Generate up to max_new_tokens after `prefix` (the target's decoder start), with γ chosen each
    step by `policy` (minispec.policy) and `stop` (minispec.stopping) ending it early. Yields each step's
    new tokens and its segments of Generation.trace; counts into `stats`."""
    drafter.start(prompt_ids, max_new_tokens, sampling)
    policy.start(target, drafter, prompt_ids)
    unseen = prefix  # accepted tokens the target has not seen: the whole prefix at first, then each t
    produced = 0
    stats.update(target_calls=0, proposed=0, accepted=0, verified=0, accepted_lengths=[0] * (policy.k_max + 1))
    overlap = torch.zeros((), device=target.device)  # Σ_x min(p, q) over verified positions
    verify_by_argmax = sampling.greedy and lenience == 1  # p and q one-hot: verifying is comparing argmaxes

    while produced < max_new_tokens:
        started = time.perf_counter()
        # Sample γ guesses x_1..x_γ from M_q, γ as the policy chooses (never drafting past max_new_tokens).
        gamma = min(policy.guesses(), max_new_tokens - produced - 1)
        drafts, q = drafter.propose(gamma, sampling, generator, policy.keep_guessing)
        drafted = time.perf_counter()
        # One target forward over the unseen tokens and the guesses; its last k+1 rows are p_1 .. p_{k+1}.
        # The first step is the prompt's own forward (the prefill): its guesses cost no extra call.
        k = drafts.shape[0]  # model-free drafters may guess fewer than asked
        tokens = torch.cat([unseen, drafts.view(1, -1)], dim=1)
        logits = (target.decode(tokens) if produced else target.prefill(tokens, logits_for=k + 1))[0, -(k + 1):]
        # n accepted guesses, then t ~ norm(max(0, p_{n+1} - q_{n+1})).
        if verify_by_argmax:
            n, t = accept_greedy(logits, drafts)
        else:
            p = adjust(logits, sampling)
            q = one_hot(drafts, p.shape[-1]) if q is None else q
            greedy_p = logits.float().softmax(-1) if sampling.greedy else None  # greedy lenience
            n, t = accept_and_resample(p, q, drafts, lenience, generator, greedy_p)
            verified = torch.arange(k, device=p.device) <= n  # positions whose acceptance test ran
            step_overlap = torch.minimum(p[:k], q).sum(-1) * verified
            overlap += step_overlap.sum()
        n, *guesses, t_host = torch.cat([n, drafts, t]).tolist()  # the step's one host sync
        new_tokens, stopped = stop.cut(guesses[:n] + [t_host])
        policy.observe(k, n, new_tokens, drafted - started, time.perf_counter() - started if produced else None)
        segments = record_step(stats, guesses, n, new_tokens)
        produced += len(new_tokens)
        if stopped and not verify_by_argmax:  # count only the positions up to the stop
            overlap -= step_overlap[len(new_tokens):].sum()
        if not stopped:
            # Roll both caches back to the accepted sequence; the target has yet to see t.
            unseen = t.view(1, 1)
            target.rollback(target.length - (k - n))
            drafter.accept(new_tokens, torch.cat([drafts[:n], t]))
        yield new_tokens, segments
        if stopped:
            break

    stats["draft_calls"] = drafter.calls
    stats["acceptance_rate"] = stats["accepted"] / stats["verified"] if stats["verified"] else 0.0
    # With one-hot p and q, Σ min(p, q) is 1 at an accepted guess and 0 at a rejected one.
    overlap = stats["accepted"] if verify_by_argmax else overlap.item()
    stats["alpha"] = overlap / stats["verified"] if stats["verified"] else 0.0
    stats["tokens_per_target_call"] = produced / max(stats["target_calls"], 1)
    stats.update(policy.finish())


def record_step(stats, guesses, n, new_tokens):
    """Count one step; its segments of the trace, coloured like the paper's Figure 1: accepted guesses,
    the rejected guess, then the target's own token ("corrected" after a rejection, "target" after
    full acceptance)."""
    k = len(guesses)
    if not stats["target_calls"]:
        stats["first_call_tokens"] = len(new_tokens)  # out of the prompt's forward
    stats["target_calls"] += 1
    stats["proposed"] += k
    # Only what was emitted counts: a stop among the accepted guesses cuts off those after it.
    emitted = min(n, len(new_tokens))
    stats["accepted"] += emitted
    stats["verified"] += min(n + 1, k, len(new_tokens))
    stats["accepted_lengths"][emitted] += 1
    segments = [(new_tokens[:n], "accepted")]
    if len(new_tokens) > n:  # the target's token was not cut off by a stop among the guesses
        segments += [([guesses[n]], "rejected")] if n < k else []
        segments += [([new_tokens[n]], "corrected" if n < k else "target")]
    return [(ids, kind) for ids, kind in segments if ids]
