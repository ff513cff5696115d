"""The chances that guesses survive verification, as gamma="auto" estimates them (policy.py): a, that a
step's first guess survives, b, that a guess survives after an accepted one (guesses come in runs), and a
rate per bin of the drafter's confidence, shrunk towards a (or b) while its bin has seen few.
"""

from typing import NamedTuple

DEFAULT_ALPHA = 0.6  # a pair's rates before it has verified anything: hopeful enough to try guessing
PRIOR_WEIGHT = 2.0  # a request starts from the pair's rates as if from this many verified positions
HISTORY_WEIGHT = 16.0  # the pair's rates move from request to request like this many positions' average
DECAY = 0.9  # per verified position, so that the estimates follow the last ~10 positions' text
CONFIDENCE_BINS = 5  # bins of 0.2: coarse enough that each fills within a few requests
BIN_PRIOR = 2.0  # a bin's rate is shrunk towards a (or b) as if by this many verified guesses


class Rate:
    """A guess's chance to survive verification, from decayed counts started at a prior."""

    def __init__(self, prior, weight=PRIOR_WEIGHT):
        self.accepted, self.verified = prior * weight, weight

    def add(self, accepted, verified):
        decay = DECAY ** verified
        self.accepted = self.accepted * decay + accepted
        self.verified = self.verified * decay + verified

    def move_towards(self, rate):
        """A step without evidence: a tenth (1 − DECAY) of the way to `rate`."""
        self.accepted += (1 - DECAY) * (rate * self.verified - self.accepted)

    @property
    def value(self):
        return self.accepted / self.verified


class Seen(NamedTuple):
    """One request's verified guesses: first guesses, and guesses after an accepted one."""
    first_accepted: int = 0
    first_verified: int = 0
    later_accepted: int = 0
    later_verified: int = 0


def carried(accepted, verified, prior, weight=HISTORY_WEIGHT):
    """A pair's rate after a request saw `accepted` of `verified`, from `prior` (as if `weight` positions)."""
    return (accepted + prior * weight) / (verified + weight)


def bin_of(confidence):
    return min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)


def count(bins, confidence, survived):
    counts = bins[bin_of(confidence)]
    counts[:] = [counts[0] * DECAY + survived, counts[1] * DECAY + 1]


def shrunk(bins, confidence, prior):
    """The rate of guesses this sure, shrunk towards `prior` while their bin has seen few."""
    accepted, verified = bins[bin_of(confidence)]
    return (accepted + BIN_PRIOR * prior) / (verified + BIN_PRIOR)
