"""What a speculative step costs (policy.py): T(k) = k·t_draft + t_verify(k + 1), both from the wall time of
steps decoding takes anyway; a pair new to a batch (whose steps are shared) and a GPU draft model's step
(whose time would need a host sync) are timed up front (`calibrate`, `time_draft`).
"""

import itertools
import sys
import time
from typing import NamedTuple

import torch

# A new pair prices a verify over x positions at t·(1 + PRIOR_SLOPE·(x − x₀)) from its first plain step (t
# over x₀): dearer than a CPU's forwards, so it starts careful. Other devices: as a CPU.
PRIOR_SLOPE = {"cpu": 0.1, "cuda": 0.01}
TIME_SMOOTHING = 0.1  # weight of each step's timing in the running average of t_draft (~10 steps)
TIME_DECAY = 0.9  # per step, so that the verify costs follow the last ~10 steps
SHAPE_PRIOR = 0.1  # how firmly the widths keep the line's ratios while steps at one width cannot tell
LEVEL_MIN = 0.01  # a 1-token verify's least share of the line's: a fit to busy moments must not price it free
# A width's own correction starts at none, as if from this many steps, and follows the last ~20 steps.
CORRECTION_PRIOR, CORRECTION_DECAY = 1.0, 0.95
CORRECTION_MAX = 1.5  # a step further off the line than this either way is a stall, not a width's shape
OUTLIER = 3.0  # a step counts at most this many times the average: a one-off stall must not price guessing out
CALIBRATION_ROUNDS = 3  # the fastest of this many runs: other work only ever slows a forward down


class NewPair(NamedTuple):
    """A new pair's costs over its first timed (plain) step's: each verify width's (index w), and a guess's."""
    shape: list  # the PRIOR_SLOPE line (index 0 unused)
    draft_ratio: float  # the draft's weight bytes over the target's


def reads_on_host(drafter):
    """Whether a draft's time and confidence are free to read (on a GPU they would be a host sync)."""
    return drafter.model is None or drafter.model.device.type == "cpu"


def graphs_met():
    """Graphs torch.compile has made: a step that adds one paid a one-off cost, so it is not timed."""
    utils = sys.modules.get("torch._dynamo.utils")  # not imported until something compiles
    return utils.counters["stats"]["unique_graphs"] if utils else 0


def weight_bytes(model):
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())


def tp_of(target):
    """The target's tensor-parallel group, or None."""
    return getattr(target, "tp", None)


def agreed(tp, seconds):
    """Timings (a list or a dict) as rank 0 took them, so that every rank of a sharded target chooses alike."""
    if tp is None:
        return seconds
    if isinstance(seconds, dict):
        return dict(zip(seconds, tp.first_numbers(list(seconds.values()))))
    return tp.first_numbers(seconds)


def fastest(forwards, device):
    """{name: the fastest of CALIBRATION_ROUNDS interleaved runs of forward()}, after an untimed one."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda device: None
    for forward in forwards.values():
        forward()
    best = dict.fromkeys(forwards, float("inf"))
    for _ in range(CALIBRATION_ROUNDS):
        for name, forward in forwards.items():
            sync(device)
            start = time.perf_counter()
            forward()
            sync(device)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def decode_at_end(model, token, rows, width):
    """A forward of `rows` rows of `width` tokens past the cache's length, rolled back after."""
    length = model.length
    tokens = token.view(1, 1).expand(rows, width)

    def forward():
        model.decode(tokens)
        model.rollback(length)

    return forward


def calibrate(profile, target, drafter, token, k_max, beams=None):
    """Time verifies of 0, k_max / 2 and k_max guesses (with beams (w, u): of w + u·k hypotheses), whose line
    prices every k, and a draft model's guess."""
    w, u = beams or (1, 0)
    rows = [max(w + u * k, 1) for k in range(k_max + 1)]
    target.rollback(0)  # the request's prefill resets the cache anyway
    timed = sorted({0, k_max // 2, k_max})  # three widths: a line is fitted through them anyway
    forwards = {k: decode_at_end(target, token, rows[k], k + 1) for k in timed}
    if drafter.model is not None:  # its cache may hold the prompt already: decode_at_end keeps that
        forwards["draft"] = decode_at_end(drafter.model, token.to(drafter.model.device), max(u, 1), 1)
    seconds = agreed(tp_of(target), fastest(forwards, target.device))
    # steps rescale all widths together, so one width's noise would stay: a line averages it away
    positions = [r * (k + 1) for k, r in enumerate(rows)]
    profile.t_verify = [0.0] + straight_line([positions[k] for k in timed], [seconds[k] for k in timed], positions)
    # a host drafter's cost is measured on its first steps with guesses
    profile.t_draft = seconds["draft"] if drafter.model is not None else 0.0


def time_draft(target, drafter, token, u):
    """A draft model's step, timed from an empty cache row (each beam's)."""
    drafter.model.rollback(0)
    forward = decode_at_end(drafter.model, token.to(drafter.model.device), max(u, 1), 1)
    return agreed(tp_of(target), fastest({"draft": forward}, drafter.model.device))["draft"]


def new_pair(target, drafter, k_max, beams, draft_timed):
    """NewPair for a request's first timed step; draft_timed: whether t_draft is known already."""
    w, u = beams or (1, 0)
    positions = [max(w + u * k, 1) * (k + 1) for k in range(k_max + 1)]  # the tokens each verify computes
    slope = PRIOR_SLOPE.get(target.device.type, PRIOR_SLOPE["cpu"])
    ratio = 0.0  # a host drafter's cost is measured on its first steps with guesses
    if not draft_timed and drafter.model is not None:  # a sharded target's slices differ from rank to rank
        ratio, = agreed(tp_of(target), [weight_bytes(drafter.model) / weight_bytes(target)])
    return NewPair([0.0] + [1 + slope * (x - positions[0]) for x in positions], ratio)


def straight_line(xs, ys, at=None):
    """The least-squares line a + b·x (b >= 0, never below the lowest y) through the points, at `at` (default: xs)."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return [max(mean_y + max(slope, 0.0) * (x - mean_x), min(ys)) for x in (xs if at is None else at)]


def refined(average, seconds):
    """The running average of t_draft after one more step (see OUTLIER); the first is taken as it is."""
    if average <= 0:
        return seconds
    return average + TIME_SMOOTHING * (min(seconds, OUTLIER * average) - average)


class VerifyCost:
    """t_verify(w), seconds of a target forward over w tokens, refitted at every step: in 1-token units,
    level + slope·u(w) (u(w): the line's excess over one token), fitted by decayed least squares with a penalty
    on slope − level, so steps at one width rescale every width and steps over many widths bend the line. Each
    width's steps also correct it (a CPU's cost may jump at one width), relative to all widths' together."""

    def __init__(self, line):
        self.one = line[1]
        # u(w), never below a narrower width's
        self.added = [0.0] + list(itertools.accumulate((max(t / self.one - 1.0, 0.0) for t in line[1:]), max))
        self.sums = [0.0] * 5  # decayed sums over the steps of 1, u, u², y, u·y
        for u in (0.0, self.added[-1]):
            self.add_point(u, 1.0 + u, weight=0.5 / (1.0 - TIME_DECAY))
        self.level, self.slope = 1.0, 1.0
        self.corrections = {}  # width -> decayed [sum of its steps' time over the line's, steps]
        self.every_width = 1.0  # the same over all widths' steps (kept by add: a tree plan prices many widths)

    def __call__(self, width):
        """The line, times the width's steps' time over the line's over the same for all widths' (shape only)."""
        return self.on_line(width) * (corrected_mean(*self.corrections.get(width, (0.0, 0.0))) / self.every_width)

    def on_line(self, width):
        return self.one * (self.level + self.slope * self.extra(width))

    def extra(self, width):
        """u(width); past the widths of the line, the line goes on straight."""
        if width < len(self.added):
            return self.added[width]
        last = len(self.added) - 1
        return self.added[last] * (width - 1) / (last - 1)

    def line(self):
        return [0.0] + [self(w) for w in range(1, len(self.added))]

    def add(self, width, seconds):
        """A step verified `width` tokens in `seconds` (<= 0: a busy moment, nothing measured). Returns the
        factor every cost was rescaled by: a plain step far faster than the line shows it was timed slow."""
        if seconds <= 0:
            return 1.0
        faster = seconds / self(width) if width == 1 else 1.0
        faster = faster if faster < 1 / CORRECTION_MAX else 1.0
        self.one *= faster
        y = min(seconds, OUTLIER * self(width)) / self.one
        self.sums = [s * TIME_DECAY for s in self.sums]
        self.add_point(self.extra(width), y, weight=1.0)
        ones, us, uus, ys, uys = self.sums
        # minimize sum (y - level - slope·u)² + SHAPE_PRIOR·(slope - level)²: a 2x2 linear system
        a, b, d = ones + SHAPE_PRIOR, us - SHAPE_PRIOR, uus + SHAPE_PRIOR
        det = a * d - b * b
        self.slope = max((a * uys - b * ys) / det, 0.0)  # a wider forward never costs less
        self.level = max((ys - b * self.slope) / a, LEVEL_MIN)
        ratio = y * self.one / self.on_line(width)
        if 1 / CORRECTION_MAX < ratio < CORRECTION_MAX:  # else a stall, not the width's shape
            for ratios in self.corrections.values():
                ratios[:] = [ratios[0] * CORRECTION_DECAY, ratios[1] * CORRECTION_DECAY]
            ratios = self.corrections.setdefault(width, [0.0, 0.0])
            ratios[:] = [ratios[0] + ratio, ratios[1] + 1.0]
            self.every_width = corrected_mean(*(sum(column) for column in zip(*self.corrections.values())))
        return faster

    def add_point(self, u, y, weight):
        for i, value in enumerate((1.0, u, u * u, y, u * y)):
            self.sums[i] += weight * value


def corrected_mean(ratios, steps):
    """A width's correction: its steps' mean ratio to the line, shrunk towards none."""
    return (ratios + CORRECTION_PRIOR) / (steps + CORRECTION_PRIOR)
