"""One γ for the rows of a batch under gamma="auto". Their shared target forward pads every row to the
widest row's tokens, so one row's guesses make every row pay for rows × (k + 1) positions, a cost no
row's own choice sees. Before each shared step the batch takes the k with the most expected tokens of
all its rows together per second of that forward (k = 0, plain decoding, where guessing does not pay
at this width), and each row guesses up to k, since the padding pays for those guesses anyway.
"""


def choose(batch):
    """Set `chosen` on the rows' policies (a grammar's rows may have their guesses forced, which asks no
    policy: they choose alone). A row that joins decodes its prompt in a forward of its own, where its
    guesses would cost little, but as a tree they would make every row's feed of the shared forward a
    tree, a dearer forward: it guesses nothing."""
    ruled = [row for row in batch if row.policy.verify is not None and row.grammar is None]
    if not ruled:
        return
    # each row's gains, no longer than its remaining tokens allow it to guess
    gains = [row.policy.gains()[:row.request.max_new_tokens - len(row.tokens)] for row in ruled]
    sharing = [g for row, g in zip(ruled, gains) if row.stats["target_calls"]]
    lead = ruled[0].policy  # every row is the same pair's: one cost line prices the batch's forward
    def rate(k):  # the sharing rows' expected tokens per second of the padded forward
        return sum(g[min(k, len(g) - 1)] for g in sharing) / lead.seconds(k, len(batch))

    k = max(range(lead.k_max + 1), key=rate)
    for row in ruled:
        row.policy.chosen = k if row.stats["target_calls"] else 0
