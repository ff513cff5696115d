"""How many guesses each speculative step makes: a fixed γ (Algorithm 1 as written), or γ = "auto": before
every step the k in 0..γ_max with the most expected tokens per second, E(k) / T(k), E from the pair's
acceptance rates (rates.py), T from its measured step costs (costs.py), both kept for the pair's next
request (profiles.py). A drafter that previews for free is priced on the very guesses it previews; a CPU
draft model stops early (`keep_guessing`); others get 1-guess probes after plain steps. With tree="auto" a
previewed tree is cut to its best prefix (`tree_gains`); trees that cost forwards race chains (`choose_mode`).
The policy only chooses how many guesses Algorithm 1 verifies, and in what shape: exactness is untouched.
"""

import weakref
from typing import Callable, NamedTuple, Optional

from . import profiles
from .costs import VerifyCost, agreed, calibrate, new_pair, reads_on_host, refined, time_draft, tp_of
from .drafters import TREE_WIDTH
from .profiles import PROBE_AFTER, PROBE_MAX, PairProfile
from .rates import PRIOR_WEIGHT, Rate, Seen, carried, count, shrunk
from ..models.checks import is_integer
from ..settings import GAMMA_MAX
from .tree import TREE_AUTO, chain_length, depths

BEAM_GAMMA_MAX = 4  # fewer draft beam steps in speculative beam search, each verifying w + u·k rows
MODE_DECAY = 0.97  # per step of a mode: over fewer than ~30 steps a run of rejections would price it out
MODE_EVIDENCE = 8  # decayed steps of the mode behind before its probes grow apart: a few may lose by chance
HOPE = 0.5  # standard errors a may be above its estimate before a draft rests (hopeful_best)


class FixedGamma:
    """γ guesses every step: the paper's Algorithm 1 as written."""

    keep_guessing = tree_nodes = None  # tree="auto" under a fixed γ verifies chains

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


class Drafting(NamedTuple):
    """What a request's drafter lets gamma="auto" do."""
    early_stop: bool = False  # it reports its confidence in each guess and asks keep_guessing after each
    measure_draft: bool = True  # its time can be read for free: its steps time it
    preview: Optional[Callable] = None  # preview(k): its next k guesses and its confidence in each (lookup.Preview)
    preview_tree: Optional[Callable] = None  # preview_tree(k, budget): its tree, a tree.PreviewedTree
    branching: bool = False  # trees it cannot preview, chosen by measured speed


class Mode(NamedTuple):
    """A step's shape for a branching drafter: "chain" or "tree", and whether it is a probe."""
    name: str
    probing: bool


def drafting(drafter, beams, tree):
    """beams: speculative beam search's (w, u); tree: tree="auto"."""
    on_host = reads_on_host(drafter)
    preview = drafter.preview if beams is None else None
    preview_tree = getattr(drafter, "preview_tree", None) if tree and preview is not None else None
    return Drafting(drafter.model is not None and on_host and beams is None, on_host, preview, preview_tree,
                    tree and preview_tree is None)


# target model -> {drafter key: PairProfile}; weak, so profiles go away with their models
PROFILES = weakref.WeakKeyDictionary()


def profile_for(target, drafter, beams, k_max):
    """The pair's profile: as this process left it, else as the last process here did, else new."""
    owner = drafter.model if drafter.model is not None else getattr(drafter, "weights", None)
    key = (drafter.name if owner is None else id(owner), beams) + getattr(drafter, "mixed_with", ())  # mixed.py
    pairs = PROFILES.setdefault(target, {})
    profile = pairs.get(key)
    if profile is None or (owner is not None and profile.model() is not owner):
        profile = pairs[key] = PairProfile()
        profile.model = weakref.ref(owner) if owner is not None else None
        tp = tp_of(target)
        # rank 0 reads and writes the pair's file; the others take what it read
        profile.key = profiles.pair_key(target, drafter, beams, k_max) if tp is None or tp.rank == 0 else None
        stored_profile(profile)
        if tp is not None:
            values = tp.from_first(*(getattr(profile, name) for name in profiles.FIELDS))
            for name, value in zip(profiles.FIELDS, values):
                setattr(profile, name, value)
    return profile


def stored_profile(profile):
    """Fill a new profile from the pair's file (tests replace this)."""
    profiles.load(profile.key, profile)


class AdaptiveGamma:
    """γ = "auto": the k in 0..k_max with the most expected tokens per second (a batch's: `chosen`)."""

    def __init__(self, k_max):
        self.k_max, self.chosen, self.resting = k_max, None, False

    def start(self, target, drafter, prompt_ids, beams=None, timed=True, tree=False):
        """A new request; beams: speculative beam search's (w, u); timed: whether its steps are timed (not
        a batch's, which are shared); tree: whether the policy chooses token trees too."""
        profile = profile_for(target, drafter, beams, self.k_max)
        token = prompt_ids[0, -1]
        if profile.t_verify is None and not timed:
            calibrate(profile, target, drafter, token, self.k_max, beams)
        if profile.t_draft is None and not reads_on_host(drafter):
            profile.t_draft = time_draft(target, drafter, token, (beams or (1, 0))[1])
        self.start_from(profile, drafting(drafter, beams, tree), tp_of(target),
                        new_pair(target, drafter, self.k_max, beams, profile.t_draft is not None))

    def start_from(self, profile, drafting, tp=None, pair=None):
        """start's second half (tests start here); tp: the target's group, whose rank 0's timings all take."""
        self.profile, self.drafting, self.tp, self.pair = profile, drafting, tp, pair
        self.verify = None if profile.t_verify is None else VerifyCost(profile.t_verify)  # None: nothing timed
        self.t_draft = profile.t_draft  # None: nothing timed
        self.first = Rate(profile.first)
        self.later = None if profile.later is None else Rate(profile.later)
        self.keep_guessing = self._keep_guessing if drafting.early_stop else None
        self.tree_nodes = None  # with tree="auto": this step's tree budget (None: a chain), set by guesses()
        self.planned = None  # the planned tree's expected tokens
        self.previewed = self.previewed_tree = None  # this step's previewed guesses, or PreviewedTree
        self.confidences = []  # the drafter's confidence in each guess of this step
        self.histogram = [0] * (self.k_max + 1)
        self.guessed_last_step, self.expected_tokens, self.seen = False, 0.0, Seen()

    def expected(self, k, a=None):
        """E(k): expected new tokens of a step with k guesses (were the first guess's rate `a`)."""
        a, b = self.first.value if a is None else a, self.later_rate()
        return 1.0 + a * (k if b >= 1 else (1 - b ** k) / (1 - b))

    def later_rate(self):
        """b, or a until a guess after an accepted one is verified."""
        return self.first.value if self.later is None else self.later.value

    def survival(self, bins, confidence, first):
        """The chance a guess this sure survives after those before it did: its bin's rate, shrunk to a or b."""
        return shrunk(bins, confidence, self.first.value if first else self.later_rate())

    def expected_with(self, sure):
        """[E(0), E(1), ..] for guesses this sure, one after another."""
        tokens, survive = [1.0], 1.0
        for place, confidence in enumerate(sure, 1):
            survive *= self.survival(self.profile.confidence, confidence, place == 1)
            tokens.append(tokens[-1] + survive)
        return tokens

    def seconds(self, k, rows=1):
        """T(k) for `rows` rows that each feed k + 1 tokens; draft steps grow with rows as a verify does."""
        return k * self.t_draft * self.verify(rows) / self.verify(1) + self.verify(rows * (k + 1))

    def gains(self):
        """[E(0), E(1), ..] for this step, from the drafter's previewed guesses or tree if it has them."""
        self.tree_nodes, self.confidences = None, []
        if self.drafting.preview_tree is not None:
            return self.tree_gains()
        if self.drafting.preview is not None:  # checked every step: no probes needed
            self.previewed, self.confidences = self.drafting.preview(self.k_max)
            return self.expected_with(self.confidences)
        return [self.expected(k) for k in range(self.k_max + 1)]

    def rest(self):
        """A batch step that neither guesses nor looks at its guesses (batched.py backs off)."""
        self.resting, self.tree_nodes, self.confidences = True, None, []
        self.previewed = self.previewed_tree = None

    def guesses(self):
        if self.resting:
            self.resting = False
            return 0
        chosen, self.chosen = self.chosen, None  # the batch's, whose gains() previewed this step
        gains = self.gains() if chosen is None else None
        if self.verify is None:  # a new pair: plain steps until one is timed
            return 0
        best = chosen if gains is None else max(range(len(gains)), key=lambda k: gains[k] / self.seconds(k))
        if self.drafting.preview_tree is not None:
            return self.take_tree(best)
        if self.drafting.preview is not None:
            return best
        if chosen is not None:  # a batch's chains, probed as a lone row's are
            return self.probed(chosen)
        mode = self.choose_mode() if self.drafting.branching else Mode("chain", False)
        best = best or (self.hopeful_best() if self.keep_guessing else 0)
        if best == 0 and (self.trees_pay() or mode == ("tree", True)):
            best = 1  # measured, or due to be, whatever a's estimate says: a's is of a chain's first guess
        best = self.probed(best)
        if best and mode.name == "tree":  # one depth of TREE_WIDTH first guesses: deeper ones did not pay
            self.tree_nodes = TREE_WIDTH
            return 1
        return self.k_max if best and self.keep_guessing else best

    def hopeful_best(self):
        """The best k were a up to HOPE standard errors higher (at most the request's rate so far): a short run
        of rejections must not rest a CPU draft model that pays, since resting learns nothing of a."""
        a, seen = self.first.value, self.seen
        error = (a * (1 - a) / (self.first.verified + seen.first_verified)) ** 0.5
        hopeful = max(a, min(a + HOPE * error, carried(seen.first_accepted, seen.first_verified, self.profile.first)))
        return max(range(self.k_max + 1), key=lambda k: self.expected(k, hopeful) / self.seconds(k))

    def probed(self, best):
        """best, or after probe_after plain steps (across requests) a 1-guess probe where guesses could pay."""
        profile = self.profile
        if best:  # speculation pays again: should it stop, probe soon
            profile.plain_steps, profile.probe_after = 0, PROBE_AFTER
            return best
        profile.plain_steps += 1
        if profile.plain_steps < profile.probe_after or not self.could_pay():
            return 0
        profile.plain_steps, profile.probe_after = 0, min(2 * profile.probe_after, PROBE_MAX)
        return 1

    def could_pay(self):
        """Would some k beat plain steps if every guess survived (k + 1 tokens a step)?"""
        return any((k + 1) * self.seconds(0) > self.seconds(k) for k in range(1, self.k_max + 1))

    def _keep_guessing(self, i, confidence):
        """Guess once more after guess i (1-based), `confidence` sure? Yes while some more guesses, each as
        likely as b, pay: a CPU's verify may jump at one width, so one more may not pay where three do."""
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

    def tree_gains(self):
        """The expected tokens with the previewed tree's first 0, 1, .. nodes (up to k_max in a chain or
        TREE_AUTO branching): each node adds the chance its path survives."""
        _, parents, sure = self.previewed_tree = self.drafting.preview_tree(self.k_max, max(self.k_max, TREE_AUTO))
        self.previewed, depth, reach, self.tree_expected = None, depths(parents), [], [1.0]
        for j, (parent, confidence) in enumerate(zip(parents[:max(chain_length(parents), TREE_AUTO)], sure)):
            bins = self.profile.tree_confidence[depth[j] > 1]
            reach.append((1.0 if parent < 0 else reach[parent]) * self.survival(bins, confidence, depth[j] == 1))
            self.tree_expected.append(self.tree_expected[-1] + reach[-1])
        return self.tree_expected

    def take_tree(self, nodes):
        """The previewed tree's first `nodes` nodes as this step's (tree_nodes); returns their depth."""
        nodes = min(nodes, len(self.tree_expected) - 1)
        self.tree_nodes, self.planned = nodes or None, self.tree_expected[nodes]
        return max(depths(self.previewed_tree.parents)[:nodes], default=0)

    def learn_tree(self, emitted):
        """Count each previewed node whose parent survived: it survives iff the target emitted it there."""
        tokens, parents, sure = self.previewed_tree
        survived = []
        for token, parent, confidence, depth in zip(tokens, parents, sure, depths(parents)):
            checked = depth <= len(emitted) and (parent < 0 or survived[parent])
            survived.append(checked and token == emitted[depth - 1])
            if checked:
                count(self.profile.tree_confidence[depth > 1], confidence, survived[-1])

    def trees_pay(self):
        """Whether a branching drafter's tree steps measured more tokens per second than plain steps."""
        (tokens, seconds, _), (plain_tokens, plain_seconds, _) = self.profile.modes["tree"], self.profile.modes["plain"]
        return (self.drafting.branching and seconds > 0 and plain_seconds > 0
                and tokens / seconds > plain_tokens / plain_seconds)

    def choose_mode(self):
        """Mode(the faster of "tree" and "chain", False), or Mode(the other, True) after mode_probe_after
        steps of any kind; the interval doubles once the other has MODE_EVIDENCE steps to its name."""
        profile = self.profile
        (chain_tokens, chain_seconds, _), (tree_tokens, tree_seconds, _) = profile.modes["chain"], profile.modes["tree"]
        preferred = "tree" if tree_seconds and (not chain_seconds or
                                               tree_tokens / tree_seconds > chain_tokens / chain_seconds) else "chain"
        if preferred != profile.preferred:  # the last probe found the other faster
            profile.preferred, profile.mode_probe_after = preferred, PROBE_AFTER
        profile.mode_steps += 1
        if profile.mode_steps < profile.mode_probe_after:
            return Mode(preferred, False)
        other = "chain" if preferred == "tree" else "tree"
        profile.mode_steps = 0
        if profile.modes[other][2] >= MODE_EVIDENCE:
            profile.mode_probe_after = min(2 * profile.mode_probe_after, PROBE_MAX)
        return Mode(other, True)

    def observe(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        """A step of k guesses (a tree's: its path and first rejected child; nodes: all it had) accepted n
        and emitted `emitted` in step_seconds (None: the prompt's forward), draft_seconds drafting."""
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
        self.learn_rates(n, min(n + 1, compared if previewed else k))
        # After plain steps a draft model feeds the many tokens it skipped: no guess's cost.
        regular, self.guessed_last_step = self.guessed_last_step, k > 0
        if step_seconds is not None:
            self.learn_costs(k, len(emitted), nodes, regular, *agreed(self.tp, [draft_seconds, step_seconds]))

    def learn_rates(self, n, verified):
        """A step verified the first `verified` guesses (previewed or made) and n of them survived."""
        if verified:  # the first guess, then those after an accepted one
            self.first.add(n > 0, 1)
            if verified > 1:
                if self.later is None:
                    self.later = Rate(self.first.value)
                self.later.add(n - (n > 0), verified - 1)
            self.seen = Seen(*(x + y for x, y in zip(self.seen, (n > 0, 1, n - (n > 0), verified - 1))))
        if not verified and self.drafting.preview is None:
            # a drifts back to the request's rate: a run of rejections must not keep guessing out till a probe
            seen = self.seen
            self.first.move_towards(carried(seen.first_accepted, seen.first_verified, self.profile.first, PRIOR_WEIGHT))
        if verified <= 1 and self.later is not None:
            # b drifts to a: a low b learnt on other text would keep a sure draft at one guess for good
            self.later.move_towards(self.first.value)
        for j, confidence in enumerate(self.confidences[:verified]):
            count(self.profile.confidence, confidence, j < n)

    def learn_costs(self, k, tokens, nodes, regular, draft_seconds, step_seconds):
        """A timed step of k guesses (nodes: a tree's) made `tokens`; regular: it followed one with guesses."""
        if self.verify is None:  # the pair's first timed step, a plain one
            self.verify = VerifyCost([step_seconds * t for t in self.pair.shape])
            self.t_draft = self.pair.draft_ratio * step_seconds if self.t_draft is None else self.t_draft
            return
        if regular or not k:
            mode = self.profile.modes["plain" if not k else "tree" if nodes else "chain"]
            mode[:] = [x * MODE_DECAY + y for x, y in zip(mode, (tokens, step_seconds, 1))]
        measure_draft = self.drafting.measure_draft
        # after plain steps the draft's time also fed skipped tokens: only an upper bound on a guess's
        if k and measure_draft and not nodes and (regular or draft_seconds / k < self.t_draft):
            self.t_draft = refined(self.t_draft, draft_seconds / k)
        if nodes and self.drafting.preview_tree is None:
            return  # a draft model's or head's tree: chosen by measured speed, and its k guesses took fewer drafts
        # the draft's cost measured in the same slower moment as the line: rescaled with it
        self.t_draft *= self.verify.add((nodes or k) + 1, step_seconds - (draft_seconds if measure_draft
                                                                          else k * self.t_draft))

    def finish(self):
        """Keep what this request learnt for the pair's next one; the statistics to report."""
        profile, seen = self.profile, self.seen
        if seen.first_verified:
            profile.first = carried(seen.first_accepted, seen.first_verified, profile.first)
        if seen.later_verified:
            prior = profile.first if profile.later is None else profile.later
            profile.later = carried(seen.later_accepted, seen.later_verified, prior)
        if self.verify is not None:
            profile.t_verify = self.verify.line()
            profile.t_draft = self.t_draft
        profiles.save(profile.key, profile)
        steps = sum(self.histogram)
        # the rate per confidence bin (0-0.2, ..., 0.8-1); with previewed trees, their nodes' at every depth
        bins = profile.confidence if self.drafting.preview_tree is None else [
            (a + c, v + w) for (a, v), (c, w) in zip(*profile.tree_confidence)]
        return {
            "gamma": "auto",
            "guesses_histogram": self.histogram,
            "alpha_estimate": {"first_guess": self.first.value, "after_an_accepted_guess": self.later_rate()},
            "acceptance_by_confidence": [accepted / verified if verified else None for accepted, verified in bins],
            "cost_model": {"t_draft": self.t_draft,
                           "t_verify": {w: self.verify(w) if self.verify else None for w in range(1, self.k_max + 2)}},
            "expected_tokens_per_call": self.expected_tokens / steps if steps else 0.0,
        }


def make_policy(gamma, k_max=GAMMA_MAX):
    """gamma: an integer >= 1 (fixed) or "auto" (up to k_max guesses, chosen per step)."""
    if gamma == "auto":
        return AdaptiveGamma(k_max)
    if is_integer(gamma) and gamma >= 1:
        return FixedGamma(gamma)
    raise ValueError(f"gamma (draft tokens per step) must be an integer >= 1 or 'auto', got {gamma!r}")
