"""One γ for the rows of a batch under gamma="auto". Their shared target forward pads every row to the
widest row's tokens, so one row's guesses make every row pay for rows × (k + 1) positions, a cost no
row's own choice sees. Before each shared step the batch takes the k with the most expected tokens of
all its rows together per second of that forward (k = 0, plain decoding, where guessing does not pay
at this width), and each row guesses up to k, since the padding pays for those guesses anyway.
"""


def choose(batch):
    """Set `chosen` on the policies of the rows that share the step's forward. Those that joined have a
    forward of their own, their prefill, and a grammar's rows may have their guesses forced, which asks
    no policy: they choose alone."""
    sharing = [row for row in batch if row.stats["target_calls"] and row.policy.verify is not None
               and row.grammar is None]
    if not sharing:
        return
    # each row's gains, no longer than its remaining tokens allow it to guess
    gains = [row.policy.gains()[:row.request.max_new_tokens - len(row.tokens)] for row in sharing]
    lead = sharing[0].policy  # every row is the same pair's: one cost line prices the batch's forward
    k = max(range(lead.k_max + 1), key=lambda k: sum(g[min(k, len(g) - 1)] for g in gains) / lead.seconds(k, len(batch)))
    for row in sharing:
        row.policy.chosen = k
