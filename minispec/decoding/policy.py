"""How many guesses each speculative step makes: a fixed γ, or γ = "auto", chosen before every step from
a cost model of this target and drafter measured on this machine (paper section 3.5, per step).

A step with k guesses yields E(k) = 1 + a·(1 − b^k) / (1 − b) tokens, where a is the chance that its
first guess survives and b that a guess survives given the one before did (k = 0 is a plain decoding
step, one token). With a = b = α this is Theorem 3.8's i.i.d. model; two rates are kept because
guesses come in runs: lookup's copy either holds for a while or fails at once. The step takes
T(k) = k·t_draft + t_verify(k + 1), t_verify(w) being a target forward over w tokens, which on a CPU
grows with w. "auto" takes the k in 0..γ_max with the most expected tokens per second, E(k) / T(k):

- t_verify(w) and t_draft come from the steps decoding takes anyway, each timed by its own wall time
  (no extra host sync: the step has one). A pair this process has not decoded starts from the costs
  its last process learnt on this machine (`profiles.py`, a file per pair); a pair never decoded
  here takes plain steps until one is timed, then a careful line through the widths (PRIOR_SLOPE)
  and a draft step priced by the models' sizes, and speculates from there. Steps refit the line's
  level and slope together (`VerifyCost`): steps at one width rescale every width at once, steps
  spread over widths also bend it. Only a step right after one with guesses refines t_draft (after
  plain steps a draft model first feeds every token it skipped). Requests in a batch time no step
  of their own, so a pair new to a batch is timed up front (`calibrate`), as is a draft model's step
  on a GPU, where reading its time would be a host sync.
- a and b are estimated from the positions the target verified, recent ones weighing more, and each
  request starts from what the pair's earlier requests saw. A drafter whose guesses cost nothing to
  preview (lookup; ngram when greedy) is checked every step, guessing or not: its preview against the
  tokens the target emitted is exactly what verification would have found (a guess x survives with
  probability p(x), the chance that the target's token is x), so its rates stay current without
  spending a forward.
- How sure a drafter is of a guess says much about its chances: the draft model's probability of it
  (on a CPU, where reading that is free), ngram's share of the counts, how long a match lookup's copy
  follows. Each pair keeps an acceptance rate per bin of that confidence, learnt from verified
  guesses across requests and shrunk towards a (b after the first guess) while a bin has seen few. A
  previewing drafter's confidences are known before the step, so it takes the k that pays most for
  these very guesses; a draft model stops early when one more guess costs more time than it is
  expected to gain (`keep_guessing`).
- With tree="auto" (decoding/tree.py), a drafter whose trees cost nothing to preview (lookup; ngram when
  greedy) offers its tree of k_max guesses every step, each node with its confidence given its
  parent, and the policy verifies the first nodes of it (the nodes come likeliest first by the drafter's
  own confidences, so each number of them is the likeliest tree that size, a chain where they form one)
  with the most expected tokens per second, up to k_max nodes that form a chain or TREE_AUTO that branch:
  a node's expected contribution is the chance its whole path survives, from rates per confidence bin
  learnt from every previewed node against what the target emitted (shrunk towards a and b while a bin
  has seen few), and a forward is priced by the one line of its width, whatever its shape: tree steps
  time it too (a tree's attention mask costs 1-3% over a chain's on this CPU). A chain or no guess at
  all are among the choices, so trees come only where they are expected to pay. A drafter whose trees
  cost forwards to grow (a draft model, a head) cannot be previewed: the
  policy keeps the tokens per second that its steps with guesses measured as chains and as trees, takes
  the better, and tries the other again after PROBE_AFTER steps of any kind, the interval doubling up to
  PROBE_MAX while it stays behind over MODE_EVIDENCE steps or more. Its tree is its TREE_WIDTH likeliest
  first guesses; where its trees measured faster than plain steps, it guesses whatever a says.
- Other drafters are checked only when they guess, so after k = 0 has been chosen for a while a
  1-guess probe checks whether speculation pays again; the interval doubles (8 to 128 steps) after
  every probe that finds it still does not. No probe where the timings say that even guesses that all
  survive would not pay (speculative beam search on a CPU, whose verify forwards are w + u·k rows).

Exactness is untouched: the policy only chooses how many guesses Algorithm 1 verifies.
"""

import time
import weakref

import torch

from . import profiles
from .drafters import TREE_WIDTH
from .sampling import is_integer
from .tree import TREE_AUTO, chain_length, depths

GAMMA_MAX = 8  # "auto" chooses among 0..GAMMA_MAX guesses
BEAM_GAMMA_MAX = 4  # and among 0..4 draft beam steps in speculative beam search, each verifying w + u·k rows
DEFAULT_ALPHA = 0.6  # a pair's acceptance rates before it has verified anything: hopeful enough to try
PRIOR_WEIGHT = 2.0  # a request starts from the pair's rates as if from this many verified positions
HISTORY_WEIGHT = 16.0  # the pair's rates move from request to request like this many positions' average
DECAY = 0.9  # per verified position: the estimates follow the last ~10 positions
TIME_SMOOTHING = 0.1  # weight of each step's timing in the running average of t_draft
TIME_DECAY = 0.9  # per step: the verify costs follow the last ~10 steps (see VerifyCost)
SHAPE_PRIOR = 0.1  # how firmly the widths keep the ratios of the pair's line while steps cannot tell
# A width's own correction to the line (VerifyCost) starts at none, as if from this many steps on the
# line, and follows the last ~20 steps of any width: widths are timed seldom where trees vary them.
# A step off the line by more than CORRECTION_MAX either way is a stall (a compile, another process),
# no width's shape: it corrects nothing.
CORRECTION_PRIOR, CORRECTION_DECAY, CORRECTION_MAX = 1.0, 0.95, 1.5
# A step's timing counts as at most this many times the running average: a one-off stall (a compiled
# draft compiling its graph for a new width on first use, another process taking the cores) must not
# price guessing out for good, while a lasting change still comes through within a few steps.
OUTLIER = 3.0
# Per step of each kind (a chain's, a tree's, a plain one): their tokens per second follow the last ~30
# such steps. A step's tokens vary from 1 to k + 1, so over ~10 a short run of rejections (one hard
# sentence) would price trees below plain steps, and their next probe could come a hundred steps later.
MODE_DECAY = 0.97
MODE_EVIDENCE = 8  # steps (decayed) of the mode not preferred before its probes grow apart (choose_mode)
CALIBRATION_ROUNDS = 3
# Before any step is timed, a verify over x token positions is priced at t·(1 + PRIOR_SLOPE·(x − x₀)),
# t being a plain step over x₀ positions: dearer than measured on CPUs here (9 tokens at about 1.25x
# one in float32), so that a new pair starts careful; steps then refit the line (VerifyCost). A GPU's
# forward costs about the same at these widths.
PRIOR_SLOPE = {"cpu": 0.1, "cuda": 0.01}  # other devices: as on a CPU
PROBE_AFTER, PROBE_MAX = 8, 128  # plain steps before a probe; doubled after each that finds it still does not pay
CONFIDENCE_BINS = 5  # how sure the drafter is of a guess, in bins of 0.2
BIN_PRIOR = 2.0  # a bin's rate is shrunk towards a (or b) as if by this many verified guesses


class FixedGamma:
    """γ guesses every step: the paper's Algorithm 1 as written."""

    keep_guessing = None
    tree_nodes = None  # tree="auto" under a fixed γ verifies chains: the paper's Algorithm 1 as written

    def __init__(self, gamma):
        self.k_max = gamma

    def start(self, target, drafter, prompt_ids, beams=None, timed=True, tree=False):
        pass

    def guesses(self):
        return self.k_max

    def observe(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        pass

    def finish(self):
        return {"gamma": self.k_max}


class Rate:
    """A guess's chance to survive verification, from decayed counts started at a prior."""

    def __init__(self, prior, weight):
        self.accepted, self.verified = prior * weight, weight

    def add(self, accepted, verified):
        decay = DECAY ** verified
        self.accepted = self.accepted * decay + accepted
        self.verified = self.verified * decay + verified

    def move_towards(self, rate):
        """A step without evidence: the rate moves a tenth (1 − DECAY) of the way to `rate`."""
        self.accepted += (1 - DECAY) * (rate * self.verified - self.accepted)

    @property
    def value(self):
        return self.accepted / self.verified


class PairProfile:
    """What one (target, drafter) pair has learnt across requests: its timings and acceptance rates."""

    def __init__(self):
        self.t_verify = None  # seconds of a target forward over w tokens, index w (0 unused): a line
        self.t_draft = None  # seconds per guess
        # a and b (module docstring); b is None until a guess after an accepted one has been verified:
        # till then a stands in for it (the paper's i.i.d. α). A prior of its own would lock a pair out:
        # a confident draft whose early stop finds the second guess not worth its cost at that prior
        # never makes one, so b is never measured.
        self.first, self.later = DEFAULT_ALPHA, None
        self.plain_steps, self.probe_after = 0, PROBE_AFTER  # steps without guesses since the last probe
        # per bin of the drafter's confidence in a guess: decayed [accepted, verified] guesses that sure
        self.confidence = [[0.0, 0.0] for _ in range(CONFIDENCE_BINS)]
        # tree="auto": decayed [accepted, verified] previewed tree nodes per confidence bin at depth 1 and
        # deeper, and decayed [tokens, seconds, steps] of the steps with guesses verified as chains and as
        # trees, and of plain steps
        self.tree_confidence = [[[0.0, 0.0] for _ in range(CONFIDENCE_BINS)] for _ in range(2)]
        self.modes = {"chain": [0.0, 0.0, 0.0], "tree": [0.0, 0.0, 0.0], "plain": [0.0, 0.0, 0.0]}
        self.mode_steps, self.mode_probe_after, self.preferred = 0, PROBE_AFTER, "chain"
        self.key = None  # of the pair's file (profiles.pair_key); None: kept in this process only


# target model -> {drafter key: PairProfile}; weak, so profiles go away with their models
PROFILES = weakref.WeakKeyDictionary()


def profile_for(target, drafter, beams, k_max):
    """The pair's profile: as this process left it, else as the last process here did, else new."""
    # what drafts: a draft model, a model-free drafter's own weights (Medusa heads), or its name alone
    owner = drafter.model if drafter.model is not None else getattr(drafter, "weights", None)
    key = (drafter.name if owner is None else id(owner), beams)
    pairs = PROFILES.setdefault(target, {})
    profile = pairs.get(key)
    if profile is None or (owner is not None and profile.model() is not owner):
        profile = pairs[key] = PairProfile()
        profile.model = weakref.ref(owner) if owner is not None else None
        profile.key = profiles.pair_key(target, drafter, beams, k_max)
        tp = tp_of(target)
        if tp is not None and tp.rank != 0:
            profile.key = None  # rank 0 reads and writes the pair's file; the others take what it read
        stored_profile(profile)
        if tp is not None:
            values = tp.from_first(*(getattr(profile, name) for name in profiles.FIELDS))
            for name, value in zip(profiles.FIELDS, values):
                setattr(profile, name, value)
    return profile


def stored_profile(profile):
    """Fill a new profile from the pair's file, if there is one (tests replace this)."""
    profiles.load(profile.key, profile)


def reads_on_host(drafter):
    """Whether a draft's time and its confidence in a guess can be read for free: not on a GPU, where
    reading them would be a host sync."""
    return drafter.model is None or drafter.model.device.type == "cpu"


def graphs_met(*models):
    """How many graphs the models' compiled forwards have compiled (None: no model): a step that adds
    one compiled it first, seconds to minutes on a CPU that no later step costs again, so its time is
    no measure of the costs."""
    return sum(model.graphs for model in models if model is not None)


def weight_bytes(model):
    return sum(tensor.numel() * tensor.element_size() for tensor in model.state_dict().values())


def fastest(forwards, device, rounds=CALIBRATION_ROUNDS):
    """{name: the fastest of `rounds` runs of forward(), in seconds}: one untimed run each first (it
    may allocate or compile), then rounds in which each runs once in turn. Other work on the machine
    only ever slows a run down, so the fastest is the forward's own cost, and taking turns keeps one
    busy moment from skewing a single width."""
    def run(forward):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        forward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    for forward in forwards.values():
        forward()
    best = dict.fromkeys(forwards, float("inf"))
    for _ in range(rounds):
        for name, forward in forwards.items():
            best[name] = min(best[name], run(forward))
    return best


def decode_at_end(model, token, rows, width):
    """A function that decodes `rows` batch rows of `width` tokens past the cache's length and rolls
    back: what the cache holds is untouched."""
    length = model.length
    tokens = token.view(1, 1).expand(rows, width)

    def forward():
        model.decode(tokens)
        model.rollback(length)

    return forward


def calibrate(profile, target, drafter, token, k_max, beams=None):
    """Time a verification of k = 0..k_max guesses (a target forward over k + 1 tokens; with beams =
    (w, u), of w + u·k hypotheses at once) and a guess of a draft model (a draft beam step of u)."""
    w, u = beams or (1, 0)
    rows = [max(w + u * k, 1) for k in range(k_max + 1)]
    target.rollback(0)  # the request's prefill resets the cache anyway
    forwards = {k: decode_at_end(target, token, rows[k], k + 1) for k in range(k_max + 1)}
    if drafter.model is not None:  # its cache may hold the prompt already: decode_at_end keeps that
        forwards["draft"] = decode_at_end(drafter.model, token.to(drafter.model.device), max(u, 1), 1)
    seconds = agreed(tp_of(target), fastest(forwards, target.device))
    # Steps rescale the widths together, so noise in one width's timing would stay in the shape for
    # good (a 3-token verify timed below a 2-token one made auto stop at 2 guesses where 8 paid). A line
    # through them, in the token positions each forward computes, averages it away: on a CPU the cost
    # grows about linearly with them, on a GPU it is flat at these widths.
    profile.t_verify = [0.0] + straight_line([r * (k + 1) for k, r in enumerate(rows)],
                                             [seconds[k] for k in range(k_max + 1)])
    # A host-side drafter's cost is measured on its first steps with guesses (refined takes the first
    # as it is): next to a forward, lookup's is microseconds, but ngram's sampled walk over a large
    # vocabulary is not.
    profile.t_draft = seconds["draft"] if drafter.model is not None else 0.0


def tp_of(target):
    """The target's tensor-parallel group, None when it is whole (or a stand-in without one, in tests)."""
    return getattr(target, "tp", None)


def agreed(tp, seconds):
    """Timings taken on this rank (a list or a {name: seconds} dict), as rank 0 took them when the target
    is sharded over processes (models/tp.py; tp: its group, None when it is not): each rank times its
    own steps, and choices made from different timings would send the ranks different ways."""
    if tp is None:
        return seconds
    if isinstance(seconds, dict):
        return dict(zip(seconds, tp.first_numbers(list(seconds.values()))))
    return tp.first_numbers(seconds)


def straight_line(xs, ys):
    """The least-squares line a + b·x (b >= 0) through the points, at each x, and no lower than the
    lowest y."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread if spread else 0.0
    return [max(mean_y + max(slope, 0.0) * (x - mean_x), min(ys)) for x in xs]


class VerifyCost:
    """t_verify(w), seconds of a target forward over w tokens: the pair's line through the widths (as
    calibrated, or as its last request left it), refitted to every step's own time.

    In units of the line's 1-token time, a w-token verify costs level + slope·u(w), where u(w) is what
    the line adds over one token: level follows how fast the machine runs now, slope what each token
    more costs. Both are fitted by least squares to the steps, recent ones weighing more, with the line
    itself counting as a memory's worth of steps at its two ends, and a penalty on slope − level: steps
    all at one width (or at two close ones) cannot tell the two apart, so they rescale every width at
    once, keeping the line's ratios (were each width refined alone, one timed in a slow moment would
    keep its stale time, never be chosen, and so never be corrected). Steps spread over widths bend
    the line: a calibration on a busy machine can get the line's slope wrong either way.

    What no line holds, each width's steps correct: a CPU's matrix products cost the same from 1 to 6
    rows and a seventh costs 15% more. A width's
    correction is its steps' time over the line's, decayed at every step of any width, so that a width
    timed in a slow moment and then avoided drifts back to the line. It counts relative to all the
    widths' steps together, so it is shape only: steps at one width still rescale every width at once
    (plain steps alone must not make guesses look dearer while the line catches up with a faster
    machine). The line a request leaves for the next (line()) keeps the corrections as its shape."""

    def __init__(self, line):
        self.one = line[1]
        self.added = [0.0] + [t / self.one - 1.0 for t in line[1:]]  # u(w)
        self.sums = [0.0] * 5  # decayed sums over the steps of 1, u, u², y, u·y
        for u in (0.0, self.added[-1]):
            self.add_point(u, 1.0 + u, weight=0.5 / (1.0 - TIME_DECAY))
        self.level, self.slope = 1.0, 1.0
        self.corrections = {}  # width -> decayed [sum of its steps' time over the line's, steps]
        self.every_width = 1.0  # the same over all widths' steps (kept by add: a tree plan prices many widths)

    def __call__(self, width):
        return self.on_line(width) * self.correction(width)

    def correction(self, width):
        """The width's steps' time over the line's, over the same for all widths' steps (shape only)."""
        return corrected_mean(*self.corrections.get(width, (0.0, 0.0))) / self.every_width

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
        """A step verified `width` tokens in `seconds` (see OUTLIER)."""
        y = min(seconds, OUTLIER * self(width)) / self.one
        self.sums = [s * TIME_DECAY for s in self.sums]
        self.add_point(self.extra(width), y, weight=1.0)
        ones, us, uus, ys, uys = self.sums
        # minimize sum (y - level - slope·u)² + SHAPE_PRIOR·(slope - level)²: a 2x2 linear system
        a, b, d = ones + SHAPE_PRIOR, us - SHAPE_PRIOR, uus + SHAPE_PRIOR
        det = a * d - b * b
        self.slope = max((a * uys - b * ys) / det, 0.0)  # a wider forward never costs less
        self.level = (ys - b * self.slope) / a
        ratio = y * self.one / self.on_line(width)
        if 1 / CORRECTION_MAX < ratio < CORRECTION_MAX:  # else a stall, not the width's shape
            for ratios in self.corrections.values():
                ratios[:] = [ratios[0] * CORRECTION_DECAY, ratios[1] * CORRECTION_DECAY]
            ratios = self.corrections.setdefault(width, [0.0, 0.0])
            ratios[0] += ratio
            ratios[1] += 1.0
            self.every_width = corrected_mean(*(sum(column) for column in zip(*self.corrections.values())))

    def add_point(self, u, y, weight):
        for i, value in enumerate((1.0, u, u * u, y, u * y)):
            self.sums[i] += weight * value


def corrected_mean(ratios, steps):
    """A width's correction (VerifyCost): its steps' mean ratio to the line, shrunk towards none."""
    return (ratios + CORRECTION_PRIOR) / (steps + CORRECTION_PRIOR)


class AdaptiveGamma:
    """γ = "auto": before each step, the k in 0..k_max with the most expected tokens per second."""

    tp = None  # the target's tensor-parallel group (set by start): timings are then rank 0's (`agreed`)
    tree_nodes = None  # with tree="auto": this step's tree budget (None: a chain), set by guesses()

    def __init__(self, k_max):
        self.k_max = k_max

    def start(self, target, drafter, prompt_ids, beams=None, timed=True, tree=False):
        """A new request; beams = (w, u) for speculative beam search, whose steps verify w + u·k
        hypotheses and whose draft steps each extend u. timed: whether its steps will be timed (not
        in a batch, whose steps are shared). tree: whether the policy chooses token trees too."""
        profile = profile_for(target, drafter, beams, self.k_max)
        self.tp = tp_of(target)
        token, (w, u) = prompt_ids[0, -1], beams or (1, 0)
        if profile.t_verify is None and not timed:
            calibrate(profile, target, drafter, token, self.k_max, beams)
        on_host = reads_on_host(drafter)
        if profile.t_draft is None and not on_host:
            # The draft's cache row (each beam's) holds nothing yet: its step is timed from position 0.
            drafter.model.rollback(0)
            forward = decode_at_end(drafter.model, token.to(drafter.model.device), max(u, 1), 1)
            profile.t_draft = agreed(tp_of(target), fastest({"draft": forward}, drafter.model.device))["draft"]
        self.positions = [max(w + u * k, 1) * (k + 1) for k in range(self.k_max + 1)]  # of each verify
        self.prior_slope = PRIOR_SLOPE.get(target.device.type, PRIOR_SLOPE["cpu"])
        # what a new pair's first timing prices a draft model's guess at (first_timing); others never read it
        new_draft = profile.t_draft is None and drafter.model is not None
        self.draft_ratio = weight_bytes(drafter.model) / weight_bytes(target) if new_draft else 0.0
        if new_draft:  # a sharded target's slices differ in size from rank to rank (biases on rank 0)
            self.draft_ratio, = agreed(self.tp, [self.draft_ratio])
        early_stop = drafter.model is not None and on_host and beams is None
        preview = drafter.preview if beams is None else None
        preview_tree = getattr(drafter, "preview_tree", None) if tree and preview is not None else None
        self.begin(profile, early_stop=early_stop, measure_draft=on_host, preview=preview, preview_tree=preview_tree,
                   branching=tree and preview_tree is None)

    def begin(self, profile, early_stop, measure_draft, preview=None, preview_tree=None, branching=False):
        """Start a request from what the pair has learnt (its timings and rates). early_stop: the
        drafter reports its confidence in each guess and stops when one more does not pay (a draft
        model on a CPU). preview(k), if given, returns the drafter's next k guesses without making
        them, and its confidence in each (two lists, empty for none). preview_tree(k, budget), if
        given, returns the tree the drafter would propose (tokens, parents, confidences: tree.py's
        form), and trees are chosen from it; branching: trees are chosen by measured speed instead."""
        self.profile = profile
        self.preview_tree, self.previewed_tree, self.branching = preview_tree, None, branching
        self.tree_nodes, self.planned = None, None
        self.verify = None if profile.t_verify is None else VerifyCost(profile.t_verify)  # None: nothing timed
        self.t_draft = profile.t_draft  # None: nothing timed
        self.measure_draft = measure_draft
        self.preview, self.previewed = preview, None
        self.first = Rate(profile.first, PRIOR_WEIGHT)
        self.later = None if profile.later is None else Rate(profile.later, PRIOR_WEIGHT)
        self.confidence = profile.confidence
        self.keep_guessing = self._keep_guessing if early_stop else None
        self.confidences = []  # the drafter's confidence in each guess of the current step
        self.histogram = [0] * (self.k_max + 1)
        self.guessed_last_step = False
        self.expected_tokens = 0.0
        self.request = [0, 0, 0, 0]  # this request's accepted and verified first guesses, later guesses

    def expected(self, k):
        """E(k): expected new tokens of a step with k guesses."""
        a, b = self.first.value, self.later_rate()
        return 1.0 + a * (k if b >= 1 else (1 - b ** k) / (1 - b))

    def later_rate(self):
        """b, or a while no guess after an accepted one has been verified for this pair."""
        return self.first.value if self.later is None else self.later.value

    def seconds(self, k):
        return k * self.t_draft + self.verify(k + 1)

    def survival(self, confidence, place):
        """The chance that a guess this sure survives, given that the guesses before it did: its bin's
        rate, shrunk towards the rate of any guess in its place (a for the first, b after it)."""
        accepted, verified = self.confidence[self.bin(confidence)]
        prior = self.first.value if place == 1 else self.later_rate()
        return (accepted + BIN_PRIOR * prior) / (verified + BIN_PRIOR)

    def guesses(self):
        self.tree_nodes = None
        if self.preview_tree is not None:
            return self.plan_tree()
        if self.verify is None:  # a new pair: plain steps until one is timed
            self.previewed, self.confidences = self.preview(self.k_max) if self.preview else (None, [])
            return 0
        if self.preview is not None:  # checked every step: no probes needed
            self.previewed, self.confidences = self.preview(self.k_max)
            return self.best_for(self.confidences)
        best = max(range(self.k_max + 1), key=lambda k: self.expected(k) / self.seconds(k))
        mode, probing = self.choose_mode() if self.branching else ("chain", False)
        if best == 0 and (self.trees_pay() or mode == "tree" and probing):
            best = 1  # measured, or due to be, whatever a's estimate says: a's is of a chain's first guess
        if best == 0:
            # Plain steps count across requests: many short ones must not lock a pair out of speculating.
            profile = self.profile
            profile.plain_steps += 1
            # Has speculation started paying again? Only worth a probe where it can: if even guesses that
            # all survive make tokens slower than plain steps (wide beam forwards on a CPU), none can.
            if profile.plain_steps >= profile.probe_after and self.could_pay():
                profile.plain_steps, best = 0, 1
                profile.probe_after = min(2 * profile.probe_after, PROBE_MAX)
        else:  # speculation pays again: should it stop, probe soon
            self.profile.plain_steps, self.profile.probe_after = 0, PROBE_AFTER
        self.confidences = []
        if best and mode == "tree":
            # The drafter's TREE_WIDTH likeliest first guesses, one depth: every depth more costs a draft
            # forward, and trees as deep as the chain the costs choose (TREE_WIDTH children a depth, or
            # one) were slower with a head on a CPU.
            self.tree_nodes = TREE_WIDTH
            return 1
        # A drafter that reports confidences guesses on while the rule says so, up to k_max.
        return self.k_max if best and self.keep_guessing else best

    def trees_pay(self):
        """Whether a branching drafter's tree steps measured more tokens per second than plain steps did:
        both wall-clock times of whole steps, so alike (the cost model's plain step is a fit)."""
        (tokens, seconds, _), (plain_tokens, plain_seconds, _) = self.profile.modes["tree"], self.profile.modes["plain"]
        return self.branching and seconds > 0 and plain_seconds > 0 and tokens / seconds > plain_tokens / plain_seconds

    def plan_tree(self):
        """The previewed tree's first nodes with the most expected tokens per second (module docstring):
        sets tree_nodes to their number (None: no guess) and returns their depth. Nodes that form a
        chain are verified as one (tree.tree_or_chain), priced as one."""
        _, parents, sure = self.previewed_tree = self.preview_tree(self.k_max, max(self.k_max, TREE_AUTO))
        self.previewed, self.confidences = None, []
        if self.verify is None:  # a new pair: plain steps until one is timed
            return 0
        chain, depth = chain_length(parents), depths(parents)
        reach, expected = [], 1.0
        best, self.planned, best_rate = 0, 1.0, 1.0 / self.verify(1)
        for j, (parent, confidence) in enumerate(zip(parents, sure)):
            nodes = j + 1
            if nodes > max(chain, TREE_AUTO):  # a chain may be k_max long, a tree TREE_AUTO nodes
                break
            reach.append((1.0 if parent < 0 else reach[parent]) * self.tree_survival(confidence, depth[j]))
            expected += reach[-1]
            rate = expected / self.verify(nodes + 1)
            if rate > best_rate:
                best, self.planned, best_rate = nodes, expected, rate
        self.tree_nodes = best or None
        return max(depth[:best], default=0)

    def tree_survival(self, confidence, depth):
        """The chance that a previewed node this sure survives, given that its parent did: its bin's rate
        at its depth (the first or a later one), shrunk towards the rate of any guess there (a, or b),
        as a chain's guesses are: shrunk towards the confidence itself, ngram's trees came out surer
        than its chains for the same guesses (a bigram seen once is "sure") and lost to them."""
        accepted, verified = self.profile.tree_confidence[depth > 1][self.bin(confidence)]
        prior = self.first.value if depth == 1 else self.later_rate()
        return (accepted + BIN_PRIOR * prior) / (verified + BIN_PRIOR)

    def learn_tree(self, emitted):
        """Every previewed node whose parent survived, against the tokens the target emitted: the node
        survives iff its token is the one emitted at its depth (exact for any verification)."""
        tokens, parents, sure = self.previewed_tree
        survived = []
        for token, parent, confidence, depth in zip(tokens, parents, sure, depths(parents)):
            checked = depth <= len(emitted) and (parent < 0 or survived[parent])
            survived.append(checked and token == emitted[depth - 1])
            if checked:
                counts = self.profile.tree_confidence[depth > 1][self.bin(confidence)]
                counts[0] = counts[0] * DECAY + survived[-1]
                counts[1] = counts[1] * DECAY + 1

    def choose_mode(self):
        """A branching drafter's step: ("tree" or "chain", whichever measured the more tokens per second
        in steps with guesses, False), or (the other, True) once profile.mode_probe_after steps of any
        kind have passed since it was last tried (module docstring): counting plain steps too, a tree
        that measured slow once is tried again while a's estimate keeps chains out. The interval doubles
        only once the other has MODE_EVIDENCE steps to its name: a step makes 1 to 5 tokens, and a head's
        trees, faster by a sixth, lost their first probes and then waited 300 steps for their next."""
        profile = self.profile
        (chain_tokens, chain_seconds, _), (tree_tokens, tree_seconds, _) = profile.modes["chain"], profile.modes["tree"]
        preferred = "tree" if tree_seconds and (not chain_seconds or
                                               tree_tokens / tree_seconds > chain_tokens / chain_seconds) else "chain"
        if preferred != profile.preferred:  # the last probe found the other faster
            profile.preferred, profile.mode_probe_after = preferred, PROBE_AFTER
        profile.mode_steps += 1
        if profile.mode_steps < profile.mode_probe_after:
            return preferred, False
        other = "chain" if preferred == "tree" else "tree"
        profile.mode_steps = 0
        if profile.modes[other][2] >= MODE_EVIDENCE:
            profile.mode_probe_after = min(2 * profile.mode_probe_after, PROBE_MAX)
        return other, True

    def expected_with(self, sure):
        """[E(0), E(1), ..] for guesses this sure, one after another."""
        tokens, survive = [1.0], 1.0
        for place, confidence in enumerate(sure, 1):
            survive *= self.survival(confidence, place)
            tokens.append(tokens[-1] + survive)
        return tokens

    def best_for(self, sure):
        """The k with the most expected tokens per second, for guesses whose confidences are known."""
        tokens = self.expected_with(sure)
        return max(range(len(tokens)), key=lambda k: tokens[k] / self.seconds(k))

    def could_pay(self):
        """Would some k beat plain steps if every guess survived (k + 1 tokens a step)?"""
        return any((k + 1) * self.seconds(0) > self.seconds(k) for k in range(1, self.k_max + 1))

    def _keep_guessing(self, i, confidence):
        """After guess i (1-based) with the draft's probability `confidence` of it: guess once more?
        Yes while more guesses, each as likely as any after an accepted one, are expected to make more
        tokens per second than the step so far. Looking past the next one: a CPU's verify costs jump
        at some width and are flat after it (VerifyCost), where one guess more would not pay but three
        would."""
        self.confidences.append(confidence)
        if i >= self.k_max:
            return False
        expected = self.expected_with(self.confidences)
        tokens, survive = expected[-1], expected[-1] - expected[-2]  # with i guesses; P(all i accepted)
        rate, later = tokens / self.seconds(i), self.later_rate()
        for more in range(i + 1, self.k_max + 1):
            survive *= later
            tokens += survive
            if tokens / self.seconds(more) > rate:
                return True
        return False

    def confidence_counts(self):
        """(accepted, verified) per confidence bin: the chain's guesses', or the previewed trees' nodes'."""
        if self.preview_tree is None:
            return self.confidence
        first, later = self.profile.tree_confidence
        return [(a + c, v + w) for (a, v), (c, w) in zip(first, later)]

    @staticmethod
    def bin(confidence):
        return min(int(confidence * CONFIDENCE_BINS), CONFIDENCE_BINS - 1)

    def observe(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        """A step made k guesses, the target accepted n and emitted `emitted` (host ids; a stop may cut
        them short); it took step_seconds (None for the prompt's forward, which also verified the
        first guesses), draft_seconds of them drafting. nodes: the tree's guesses, 0 for a chain (a
        tree's k guesses are its accepted path and the first rejected child)."""
        self.histogram[k] += 1
        previewed = self.previewed is not None
        if self.previewed_tree is not None:
            self.expected_tokens += self.planned or 1.0
            self.learn_tree(emitted)
        else:
            self.expected_tokens += self.expected_with(self.confidences[:k])[-1] if previewed else self.expected(k)
        if previewed:  # the preview against what the target emitted
            compared = min(len(self.previewed), len(emitted))
            n = next((i for i in range(compared) if self.previewed[i] != emitted[i]), compared)
            verified = min(n + 1, compared)
        else:
            verified = min(n + 1, k)
        if verified:  # the first guess, then those after an accepted one
            self.first.add(n > 0, 1)
            if verified > 1:
                if self.later is None:
                    self.later = Rate(self.first.value, PRIOR_WEIGHT)
                self.later.add(n - (n > 0), verified - 1)
            self.request = [x + y for x, y in zip(self.request, (n > 0, 1, n - (n > 0), verified - 1))]
        if verified <= 1 and self.later is not None:
            # Nothing checked after an accepted guess: b drifts to a (the i.i.d. model), or a low b
            # learnt on other text would keep a sure draft at one guess a step, never measuring b again.
            self.later.move_towards(self.first.value)
        for j, c in enumerate(self.confidences[:verified]):
            counts = self.confidence[self.bin(c)]
            counts[0] = counts[0] * DECAY + (j < n)
            counts[1] = counts[1] * DECAY + 1
        # A draft model feeds the tokens it has not seen at its next guess: one or two after a step with
        # guesses, but after plain steps (or the prompt) many, a cost that is no guess's: timed as one,
        # it would make probes look so dear that guessing could never pay again.
        regular, self.guessed_last_step = self.guessed_last_step, k > 0
        if step_seconds is None:
            return
        draft_seconds, step_seconds = agreed(self.tp, [draft_seconds, step_seconds])
        if self.verify is None:  # the pair's first timed step, a plain one
            self.first_timing(step_seconds)
            return
        if regular or not k:
            mode = self.profile.modes["plain" if not k else "tree" if nodes else "chain"]
            mode[:] = [x * MODE_DECAY + y for x, y in zip(mode, (len(emitted), step_seconds, 1))]
        if k and self.measure_draft and regular and not nodes:
            self.t_draft = refined(self.t_draft, draft_seconds / k)
        if nodes and self.preview_tree is None:
            return  # a draft model's or head's tree: chosen by measured speed, and its k guesses took fewer drafts
        self.verify.add((nodes or k) + 1, step_seconds - (draft_seconds if self.measure_draft else k * self.t_draft))

    def first_timing(self, seconds):
        """A new pair's first timed step, a plain one, took `seconds`: the verify line through it at
        the careful prior slope, and a draft step at the models' size ratio (a host drafter's is
        measured on its first steps with guesses: refined takes the first as it is)."""
        x0 = self.positions[0]
        self.verify = VerifyCost([0.0] + [seconds * (1 + self.prior_slope * (x - x0)) for x in self.positions])
        if self.t_draft is None:
            self.t_draft = self.draft_ratio * seconds

    def finish(self):
        """Keep what this request learnt for the pair's next one; the statistics to report."""
        profile = self.profile
        first_accepted, first_verified, later_accepted, later_verified = self.request
        if first_verified:
            profile.first = (first_accepted + profile.first * HISTORY_WEIGHT) / (first_verified + HISTORY_WEIGHT)
        if later_verified:
            prior = profile.first if profile.later is None else profile.later
            profile.later = (later_accepted + prior * HISTORY_WEIGHT) / (later_verified + HISTORY_WEIGHT)
        if self.verify is not None:
            profile.t_verify = self.verify.line()
            profile.t_draft = self.t_draft
        profiles.save(profile.key, profile)
        steps = sum(self.histogram)
        return {
            "gamma": "auto",
            "guesses_histogram": self.histogram,
            "alpha_estimate": {"first_guess": self.first.value, "after_an_accepted_guess": self.later_rate()},
            # the pair's rate per bin of the drafter's confidence (0-0.2, ..., 0.8-1), None before any guess;
            # with previewed trees, their nodes' (each given its parent survived), at every depth
            "acceptance_by_confidence": [accepted / verified if verified else None
                                         for accepted, verified in self.confidence_counts()],
            "cost_model": {"t_draft": self.t_draft,
                           "t_verify": {w: self.verify(w) if self.verify else None for w in range(1, self.k_max + 2)}},
            "expected_tokens_per_call": self.expected_tokens / steps if steps else 0.0,
        }


def refined(average, seconds):
    """The running average of t_draft after one more observation (see OUTLIER); the first (average 0,
    nothing measured yet) is taken as it is."""
    if average <= 0:
        return seconds
    return average + TIME_SMOOTHING * (min(seconds, OUTLIER * average) - average)


def make_policy(gamma, k_max=GAMMA_MAX):
    """gamma: an integer >= 1 (fixed) or "auto" (up to k_max guesses, chosen per step)."""
    if gamma == "auto":
        return AdaptiveGamma(k_max)
    if is_integer(gamma) and gamma >= 1:
        return FixedGamma(gamma)
    raise ValueError(f"gamma (draft tokens per step) must be an integer >= 1 or 'auto', got {gamma!r}")
