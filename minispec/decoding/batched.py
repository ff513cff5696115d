"""One γ for a batch's rows under gamma="auto": the shared forward pads every row to the widest, so the
batch takes the k with the most expected tokens of all rows per second of that forward. Where guessing does
not pay twice in a row, the rows rest (do not even preview) for a while that doubles while it keeps not paying.
"""

import weakref
from typing import NamedTuple

from .costs import OUTLIER
from .profiles import PROBE_MAX

DECAY = 0.9  # per timed step at the same rows and k, so that a cell follows its last ~10 steps
# A cell's seconds are shrunk towards the estimate as if by this many steps: one busy step must not price k out.
CELL_PRIOR = 1.0


class Load:
    """A pair's batch steps: decayed [seconds, steps] per (rows, k), steps left to rest, the last look's verdict."""

    def __init__(self):
        self.cells, self.rest, self.back_off, self.looked = {}, 0, 1, False

    def seconds(self, policy, rows, k):
        """T(k) for `rows` rows: what this width's steps at k measured, shrunk towards the estimate."""
        seconds, steps = self.cells.get((rows, k), (0.0, 0.0))
        return (seconds + CELL_PRIOR * self.estimate(policy, rows, k)) / (steps + CELL_PRIOR)

    def estimate(self, policy, rows, k):
        """The width's plain step (as timed, else the line's) plus, per each of the rows × k positions it adds,
        the dearer of the line's price (scaled as the plain step is) and what the nearest width that timed
        guesses paid: a CPU's wide forward grows more steeply than lone rows' few tokens show."""
        line = policy.seconds(0, rows)
        plain = self.mean(rows, 0, line)
        if not k:
            return plain
        # the line's price per position, at this width's scale as its plain step measured it
        per_position = (policy.seconds(k, rows) - line) * plain / line / (rows * k)
        # a width's first steps with guesses may come before any of its plain ones: the line's plain step then
        timed = [(r, j) for r, j in self.cells if j]
        if timed:
            near = min(abs(r - rows) for r, j in timed)
            per_position = max([per_position] + [(self.mean(r, j) - self.mean(r, 0, policy.seconds(0, r))) / (r * j)
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
    """Set `chosen` on the rows' policies (a grammar's rows choose alone; a joining row guesses nothing).
    Returns the Plan to time, or None where a row joins or a grammar rules: no measure of the width."""
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
