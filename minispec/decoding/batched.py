"""One γ for the rows of a batch under gamma="auto". Their shared target forward pads every row to the
widest row's tokens, so one row's guesses make every row pay for rows × (k + 1) positions, a cost no
row's own choice sees. Before each shared step the batch takes the k with the most expected tokens of
all its rows together per second of that forward (k = 0, plain decoding, where guessing does not pay
at this width), and each row guesses up to k, since the padding pays for those guesses anyway.

The forward's price is what the batch's own steps measured at that many rows: its plain step, plus a
price for each position the guesses add, from the pair's cost line (costs.py, timed on lone rows) or the
nearest width's steps with guesses, whichever is dearer: a wide forward is no line through narrow
ones. Where guessing does not pay at two looks in a row, the rows do not even look at their guesses for
a while (previewing every row's guesses is no free work at a batch's width), a while that doubles as
long as guessing keeps not paying.
"""

import time
import weakref
from typing import NamedTuple

from .costs import OUTLIER
from .profiles import PROBE_MAX

DECAY = 0.9  # per timed step at the same rows and k, so that a cell follows its last ~10 steps
# A cell's measured seconds are shrunk towards the scaled line as if by this many steps: one step timed
# in a busy moment must not price its k out for good, as it would never be timed again.
CELL_PRIOR = 1.0


class Load:
    """A pair's batch steps: decayed [seconds, steps] of the steps timed at each (rows, k), how many
    steps the rows rest (neither guess nor preview) before they look at their guesses again, and whether
    the last step looked and found guessing not paying."""

    def __init__(self):
        self.cells, self.rest, self.back_off, self.looked = {}, 0, 1, False

    def seconds(self, policy, rows, k):
        """T(k) for `rows` rows: what this width's steps at k measured, shrunk towards the estimate."""
        seconds, steps = self.cells.get((rows, k), (0.0, 0.0))
        return (seconds + CELL_PRIOR * self.estimate(policy, rows, k)) / (steps + CELL_PRIOR)

    def estimate(self, policy, rows, k):
        """The width's plain step (as timed, else the line's) and a price for each of the rows × k positions
        it adds: the line's (scaled as the plain step is), or what the nearest width that timed guesses paid
        per position, whichever is dearer. A CPU's wide forward grows with its positions far more steeply than lone rows' few tokens
        show, so a width times one k too cheap at most, which then prices all of its guesses."""
        line = policy.seconds(0, rows)
        plain = self.mean(rows, 0, line)
        if not k:
            return plain
        # the line's price per position, at this width's scale as its plain step measured it
        per_position = (policy.seconds(k, rows) - line) * plain / line / (rows * k)
        timed = [(r, j) for r, j in self.cells if j and (r, 0) in self.cells]
        if timed:
            near = min(abs(r - rows) for r, j in timed)
            per_position = max([per_position] + [(self.mean(r, j) - self.mean(r, 0)) / (r * j)
                                                 for r, j in timed if abs(r - rows) == near])
        return plain + per_position * rows * k

    def mean(self, rows, k, default=None):
        """The decayed mean of the steps timed at (rows, k), or `default` where none was."""
        seconds, steps = self.cells.get((rows, k), (default, 1.0))
        return seconds / steps

    def timed(self, plan, seconds):
        """The planned step took `seconds` (at most OUTLIER times its price: a stall is no width's cost)."""
        cell = self.cells.setdefault((plan.rows, plan.k), [0.0, 0.0])
        cell[:] = [cell[0] * DECAY + min(seconds, OUTLIER * plan.price), cell[1] * DECAY + 1]


class Plan(NamedTuple):
    """A step the batch chose, to be timed: its rows, its k and the price it was chosen at."""
    load: Load
    rows: int
    k: int
    price: float


LOADS = weakref.WeakKeyDictionary()  # a pair's profile -> its Load


def choose(batch):
    """Set `chosen` on the rows' policies (a grammar's rows may have their guesses forced, which asks no
    policy: they choose alone). A row that joins decodes its prompt in a forward of its own, where its
    guesses would cost little, but as a tree they would make every row's feed of the shared forward a
    tree, a dearer forward: it guesses nothing. Returns the Plan to time, or None: a step in which a row
    joins or a grammar forces guesses is no measure of the width's forwards."""
    ruled = [row for row in batch if row.policy.verify is not None and row.grammar is None]
    if not ruled:
        return None
    lead = ruled[0].policy  # every row is the same pair's: one cost line prices the batch's forward
    load = LOADS.setdefault(lead.profile, Load())
    if load.rest:
        load.rest -= 1
        k = 0
        for row in ruled:
            row.policy.rest()
    else:
        k = chosen(batch, ruled, load)
    regular = len(ruled) == len(batch) and all(row.stats["target_calls"] for row in batch)
    return Plan(load, len(batch), k, load.seconds(lead, len(batch), k)) if regular else None


def chosen(batch, ruled, load):
    """The batch's k from its rows' gains, set on each; after k = 0 the rows rest (Load.rest)."""
    # each row's gains, no longer than its remaining tokens allow it to guess
    gains = [row.policy.gains()[:row.request.max_new_tokens - len(row.tokens)] for row in ruled]
    sharing = [g for row, g in zip(ruled, gains) if row.stats["target_calls"]]
    lead = ruled[0].policy

    def rate(k):  # the sharing rows' expected tokens per second of the padded forward
        return sum(g[min(k, len(g) - 1)] for g in sharing) / load.seconds(lead, len(batch), k)

    k = max(range(lead.k_max + 1), key=rate)
    for row in ruled:
        row.policy.chosen = k if row.stats["target_calls"] else 0
    if k:
        load.back_off, load.looked = 1, False
    elif load.looked:  # the second look in a row, taught by the first's previews: guessing still does not pay
        load.rest, load.back_off, load.looked = load.back_off, min(2 * load.back_off, PROBE_MAX), False
    else:
        load.looked = True
    return k


def timed(plan, started):
    """Time a planned step that began at `started` (perf_counter)."""
    plan.load.timed(plan, time.perf_counter() - started)
