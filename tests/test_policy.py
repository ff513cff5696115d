"""The per-step choice of how many guesses to make (gamma="auto"): the cost model's arithmetic, its
decisions for known α and timings, early stopping on the draft's confidence, probes after plain
steps, and end to end on tiny pairs whose α is controlled."""

import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from conftest import make_reference, save_reference
from test_heads import KILLING, ROOT

import minispec
from minispec.decoding import batched, costs, drafters, policy, profiles, rates
from minispec.decoding.policy import AdaptiveGamma, Drafting, FixedGamma, make_policy
from minispec.decoding.tree import PreviewedTree

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]


def adaptive(alpha, t_verify, t_draft, k_max=8, confident_drafter=False):
    """An AdaptiveGamma starting a request with the given α and timings, as if measured."""
    profile = profiles.PairProfile()
    profile.t_verify, profile.t_draft, profile.first, profile.later = [0.0, *t_verify], t_draft, alpha, alpha
    chooser = AdaptiveGamma(k_max)
    chooser.start_from(profile, Drafting(early_stop=confident_drafter))
    return chooser


FLAT = [1.0] * 9  # a GPU-like verify cost: 1..9 tokens cost the same
STEEP = [1.0 + 0.25 * w for w in range(9)]  # a CPU-like one: each extra token adds a quarter step


def test_expected_tokens_is_theorem_3_8_per_step_with_a_first_and_a_later_rate():
    chooser = adaptive(0.8, FLAT, 0.1)
    assert chooser.expected(0) == pytest.approx(1.0)
    assert chooser.expected(3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)  # a = b: the i.i.d. model
    chooser.first, chooser.later = rates.Rate(0.5, 1.0), rates.Rate(1.0, 1.0)
    assert chooser.expected(3) == pytest.approx(1 + 0.5 * 3)  # a run that, once started, always holds
    chooser.first = rates.Rate(0.2, 1.0)
    chooser.later = rates.Rate(0.9, 1.0)
    assert chooser.expected(2) == pytest.approx(1 + 0.2 + 0.2 * 0.9)


@pytest.mark.parametrize("alpha, t_verify, t_draft, best", [
    (0.1, FLAT, 0.05, 1),  # cheap guesses pay even when few survive...
    (0.1, STEEP, 0.3, 0),  # ...but not when they and their verification cost a third of a step each
    (0.3, FLAT, 1.0, 0),  # a draft as slow as the target never pays
    (0.95, FLAT, 0.02, 8),  # a good, cheap draft on flat costs: as many as allowed
    (0.7, STEEP, 0.05, 2),
])
def test_guesses_maximize_expected_tokens_per_second(alpha, t_verify, t_draft, best):
    chooser = adaptive(alpha, t_verify, t_draft)
    rate = {k: chooser.expected(k) / (k * t_draft + t_verify[k]) for k in range(9)}
    assert max(rate, key=rate.get) == best  # the cases are what they say (t_verify[k] is width k + 1)
    assert chooser.guesses() == best


def test_rates_follow_the_verified_positions():
    chooser = adaptive(0.6, FLAT, 0.1)
    for _ in range(40):
        chooser.observe(k=4, n=0, emitted=[1], draft_seconds=0.4, step_seconds=1.4)  # every first guess rejected
    # nothing after an accepted guess checked: b drifts to a
    assert chooser.first.value < 0.05 and chooser.later.value < 0.1 and chooser.guesses() == 0
    for _ in range(40):
        chooser.observe(k=4, n=4, emitted=[1] * 5, draft_seconds=0.4, step_seconds=1.4)  # all accepted
    assert chooser.first.value > 0.95 and chooser.later.value > 0.95 and chooser.guesses() == 8
    for _ in range(40):
        chooser.observe(k=4, n=1, emitted=[1] * 2, draft_seconds=0.4, step_seconds=1.4)  # only the first
    assert chooser.first.value > 0.95 and chooser.later.value < 0.05


def test_a_drafter_with_a_preview_is_checked_on_every_step_guessing_or_not():
    """lookup's preview against the emitted tokens is what verification would have found, so steps
    without guesses still tell the rates (and need no probes)."""
    upcoming = [[7, 8, 9, 10]]
    chooser = adaptive(0.05, STEEP, 0.0)
    preview = lambda k: (upcoming[0][:k], [0.5] * len(upcoming[0][:k]))  # noqa: E731
    chooser.start_from(chooser.profile, Drafting(preview=preview))
    assert chooser.guesses() == 0  # unpromising so far: a plain step, with a look at what it would guess
    chooser.observe(k=0, n=0, emitted=[7], draft_seconds=0.0, step_seconds=1.0)  # the first guess was right
    before = chooser.first.value
    assert before > 0.05 and chooser.later.verified == pytest.approx(rates.PRIOR_WEIGHT)  # nothing after it seen
    for _ in range(30):  # a copy that holds: the target emits what the preview says
        k = chooser.guesses()
        chooser.observe(k=k, n=k, emitted=upcoming[0][:k + 1], draft_seconds=0.0, step_seconds=STEEP[k])
    assert chooser.first.value > 0.9 and chooser.later.value > 0.9 and chooser.guesses() >= 3
    upcoming[0] = []  # no match: nothing to check
    state = (chooser.first.accepted, chooser.first.verified)
    chooser.guesses()
    chooser.observe(k=0, n=0, emitted=[5], draft_seconds=0.0, step_seconds=1.0)
    assert (chooser.first.accepted, chooser.first.verified) == state


def test_a_previewing_drafter_guesses_as_far_as_its_confidence_in_these_guesses_pays():
    """Sure guesses (a long lookup match) that hold and unsure ones (a 1-token match) that fail, mixed
    step by step: the pair's overall rate is middling, but each bin learns its own, and a step's k
    follows the confidence of the guesses it previews."""
    upcoming = list(range(7, 15))
    sure = [1.0]
    chooser = adaptive(0.5, STEEP, 0.0)
    preview = lambda k: (upcoming[:k], sure * k)  # noqa: E731
    chooser.start_from(chooser.profile, Drafting(preview=preview))
    for step in range(40):
        sure[0] = 1.0 if step % 2 else 0.2
        k = chooser.guesses()
        emitted = upcoming[:k + 1] if step % 2 else [99]
        chooser.observe(k=k, n=len(emitted) - 1, emitted=emitted, draft_seconds=0.0, step_seconds=STEEP[k])
    assert 0.3 < chooser.first.value < 0.7
    sure[0] = 1.0
    assert chooser.guesses() >= 5
    sure[0] = 0.2
    assert chooser.guesses() == 0


def test_a_guess_after_plain_steps_does_not_price_the_draft():
    """A probe after plain steps makes the draft model feed every token it skipped (a forward over many):
    timing that as its guess would price guessing out for good.
    Only guesses right after guesses refine t_draft."""
    chooser = adaptive(0.5, STEEP, 0.5)
    for _ in range(8):
        chooser.observe(k=0, n=0, emitted=[1], draft_seconds=0.0, step_seconds=STEEP[0])
    chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=5.0, step_seconds=5.0 + STEEP[1])  # the catch-up
    assert chooser.t_draft == 0.5 and chooser.verify(2) == pytest.approx(STEEP[1])
    chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=0.6, step_seconds=0.6 + STEEP[1])
    assert chooser.t_draft == pytest.approx(0.5 + costs.TIME_SMOOTHING * 0.1)


def test_a_host_drafters_cost_is_measured_from_its_steps():
    """lookup and ngram start at t_draft 0 (not timed at calibration) and must still be measured: the
    3x cap on a step's timing would otherwise hold 0 for good."""
    chooser = adaptive(0.5, STEEP, 0.0)
    for _ in range(3):
        chooser.observe(k=4, n=2, emitted=[1, 2, 3], draft_seconds=0.2, step_seconds=0.2 + STEEP[4])
    assert chooser.t_draft == pytest.approx(0.05)


@pytest.mark.parametrize("beams", [None, (2, 2)])
def test_calibrated_widths_lie_on_a_line_through_their_timings(monkeypatch, beams):
    """Steps rescale all widths together, so noise in one width's calibration would stay for good: a
    3-token verify timed below a 2-token one. Calibration fits a line in the token positions each
    forward computes (k + 1 tokens, of w + u·k rows with beams), through three widths: the first, the
    middle and the last (a line needs no more, and each width timed is four forwards)."""
    w, u = beams or (1, 0)
    positions = [(w + u * k) * (k + 1) for k in range(5)]
    noise = [0.0, 0.2, -0.2, 0.0, 0.0]
    timed = {k: 1.0 + 0.1 * x + noise[k] for k, x in enumerate(positions)}
    widths = []
    monkeypatch.setattr(costs, "fastest",
                        lambda forwards, device: widths.append(sorted(forwards)) or dict(timed, draft=0.3))
    target = SimpleNamespace(rollback=lambda length: None, length=0, device=torch.device("cpu"))
    profile = profiles.PairProfile()
    costs.calibrate(profile, target, SimpleNamespace(model=None), torch.tensor(5), 4, beams)
    assert widths == [[0, 2, 4]]
    fitted = profile.t_verify[1:]
    assert all(a < b for a, b in zip(fitted, fitted[1:]))  # the 2-3 inversion is gone
    assert fitted == pytest.approx([1.0 + 0.1 * x for x in positions], abs=0.1)
    assert costs.straight_line([1, 2, 3], [2.0, 1.0, 1.5]) == pytest.approx([1.5] * 3)  # never falling


def test_timings_are_refined_from_each_step():
    """Steps all at one width rescale every width's time at once: their ratios stay the line's."""
    chooser = adaptive(0.6, STEEP, 0.1)
    for _ in range(100):  # width 3 (calibrated 1.5 s) really takes 3 s, and a guess 0.3 s
        chooser.observe(k=2, n=1, emitted=[1, 2], draft_seconds=0.6, step_seconds=3.6)
    assert chooser.t_draft == pytest.approx(0.3, rel=1e-3)
    assert chooser.verify(3) == pytest.approx(3.0, rel=0.005)  # the line, and the width's own correction
    assert chooser.verify(1) == pytest.approx(2.0, rel=0.01)  # widths not seen: the same factor
    assert chooser.verify(9) == pytest.approx(6.0, rel=0.01)
    chooser.observe(k=2, n=1, emitted=[1, 2], draft_seconds=0.6, step_seconds=None)  # the prompt's forward
    assert chooser.verify(3) == pytest.approx(3.0, rel=0.005)  # the line, and the width's own correction
    chooser.finish()
    assert chooser.profile.t_verify[1:] == pytest.approx([2.0 * t for t in STEEP], rel=0.01)  # the next request's


def test_steps_at_several_widths_refit_the_slope_of_the_verify_costs():
    """A calibration taken on a busy machine may get the slope wrong. Steps that spread over widths bend
    the line to what they take, whatever the level."""
    chooser = adaptive(0.95, STEEP, 0.3)  # calibrated: 1 s, and each token more adds 0.25 s
    true = [1.3 * (1.0 + 0.15 * w) for w in range(9)]  # the machine is slower, and extra tokens cheaper
    for step in range(60):
        k = [0, 1, 3, 2][step % 4]
        chooser.observe(k=k, n=k, emitted=[1] * (k + 1), draft_seconds=0.3 * k, step_seconds=0.3 * k + true[k])
    # widths 5-9 never seen (at the calibrated slope a 9-token verify would be 3.9 s)
    assert [chooser.verify(w) for w in range(1, 10)] == pytest.approx(true, rel=0.05)
    assert chooser.guesses() == 8
    # at the calibrated slope, whatever the level, fewer
    assert adaptive(0.95, [t * 1.3 for t in STEEP], 0.3).guesses() < 8


def test_a_width_the_line_misses_is_corrected_by_its_own_steps():
    """A CPU's products cost the same from 1 to 6 rows and 15% more at 7: no line holds both. Steps at
    widths 2, 4 and 7 leave the first two on the line and correct 7 alone; once 7 is no longer timed,
    its correction fades back to the line (a width timed in a slow moment must not stay dear)."""
    chooser = adaptive(0.95, FLAT, 0.3)
    true = {2: 1.0, 4: 1.0, 7: 1.15}
    for step in range(60):
        k = [1, 3, 6][step % 3]
        chooser.observe(k=k, n=k, emitted=[1] * (k + 1), draft_seconds=0.0, step_seconds=true[k + 1])
    assert [chooser.verify(w) for w in true] == pytest.approx(list(true.values()), rel=0.02)
    assert chooser.verify(6) == pytest.approx(1.05, rel=0.02)  # never timed: the line's (flat, their mean)
    assert chooser.finish()["cost_model"]["t_verify"][7] == pytest.approx(1.15, rel=0.02)
    assert chooser.profile.t_verify[7] == pytest.approx(1.15, rel=0.02)  # the next request's shape keeps it
    chooser = adaptive(0.95, FLAT, 0.3)
    for width in [7] * 20 + [2] * 100:
        chooser.observe(k=width - 1, n=0, emitted=[1], draft_seconds=0.0, step_seconds=1.15 if width == 7 else 1.0)
    assert chooser.verify(7) == pytest.approx(chooser.verify(6), rel=0.01)


def test_a_one_off_stall_barely_moves_the_timings_but_a_lasting_change_does():
    """A compiled draft compiles a graph the first time it decodes a new width: one proposal takes 90
    times its usual time. That must not price guessing out for the rest of the pair's life."""
    chooser = adaptive(0.9, FLAT, 0.1)
    chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=0.1, step_seconds=1.1)  # as calibrated
    chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=9.0, step_seconds=19.0)  # and the verify 10 s
    assert chooser.t_draft == pytest.approx(0.12) and chooser.verify(2) == pytest.approx(1.2)
    assert chooser.guesses() > 0
    for _ in range(40):  # guessing really became 5x dearer: the estimate follows
        chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=0.5, step_seconds=1.5)
    assert chooser.t_draft == pytest.approx(0.5, rel=0.05)


def simulated_pair(chooser, steps, slow_steps, seed=0):
    """A small draft on a CPU: a guess costs 0.45 of a plain step, a verify 3% more a token, 3 guesses in 4
    survive (the draft sure of each, 0.8), and the first `slow_steps` steps take 10 times as long (a
    machine busy at the start). chooser: AdaptiveGamma or FixedGamma. (tokens, seconds) of the rest."""
    rng, made, seconds, regular = random.Random(seed), 0, 0.0, False
    for step in range(steps):
        k, slow = chooser.guesses(), 10.0 if step < slow_steps else 1.0
        if k and chooser.keep_guessing:  # a draft that reads its confidence stops where keep_guessing says
            k = next(i for i in range(1, k + 1) if i == k or not chooser.keep_guessing(i, 0.8))
        n = next((i for i in range(k) if rng.random() >= 0.75), k)
        feeds = k + (0 if regular or not k else 2)  # after plain steps the draft feeds what it skipped
        draft = 0.045 * feeds * slow
        step_seconds = draft + 0.1 * (1 + 0.03 * k) * slow
        chooser.observe(k=k, n=n, emitted=[1] * (n + 1), draft_seconds=draft, step_seconds=step_seconds)
        regular = k > 0
        if step >= slow_steps:
            made, seconds = made + n + 1, seconds + step_seconds
    return made, seconds


def test_costs_timed_while_the_machine_was_busy_do_not_lock_guessing_out():
    """A pair's first steps timed on a busy machine priced its draft and its wider verifies 10 times
    too dear; plain steps then showed the machine quick again, but told nothing of the draft or the
    wider widths, which no guess measured any more. A plain step far faster than the line rescales
    every cost, and a short run of rejections does not keep guessing out: gamma="auto" guesses on
    most steps and is as fast as a fixed γ of 2."""
    chooser = AdaptiveGamma(8)
    shape = [0.0] + [1 + costs.PRIOR_SLOPE["cpu"] * (w - 1) for w in range(1, 10)]
    chooser.start_from(profiles.PairProfile(), Drafting(early_stop=True), pair=costs.NewPair(shape, 0.35))
    tokens, seconds = simulated_pair(chooser, 300, slow_steps=6)
    fixed_tokens, fixed_seconds = simulated_pair(FixedGamma(2), 300, slow_steps=6)
    assert sum(chooser.histogram[1:]) > 0.8 * 300
    assert tokens / seconds >= 0.97 * fixed_tokens / fixed_seconds  # this draw's luck aside


def test_a_short_run_of_rejections_does_not_rest_a_draft_that_pays_on_the_request():
    """A CPU pair near break-even (a guess 0.39 of a step, each verified token 11% more: guessing pays above
    a = 0.5): four rejected first guesses after a run of accepted ones pull a, which follows ~10 positions,
    under break-even, and a resting draft learns nothing of a until a probe. It rests only where a is below
    break-even by more than half a standard error of the request's evidence, or the request's rate so far
    says so: a draft that fails on the request still rests."""
    cpu = [1.0 + 0.11 * w for w in range(9)]
    chooser = adaptive(0.75, cpu, 0.39, confident_drafter=True)
    for n in [1, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0]:
        assert chooser.guesses() > 0
        chooser.observe(k=1, n=n, emitted=[1] * (n + 1), draft_seconds=0.39, step_seconds=1.5)
    assert chooser.expected(1) / chooser.seconds(1) < 1 / chooser.seconds(0)  # a alone says: rest
    assert chooser.guesses() > 0
    failing, made = adaptive(0.75, cpu, 0.39, confident_drafter=True), []
    for _ in range(30):
        made.append(min(failing.guesses(), 1))
        failing.observe(k=made[-1], n=0, emitted=[1], draft_seconds=0.39 * made[-1], step_seconds=1.0 + 0.5 * made[-1])
    assert sum(made[:3]) >= 1 and sum(made[3:]) <= 3  # the probes after plain steps only


def batch_of(choosers, max_new_tokens=64):
    """Rows that share a step's forward, as batched.choose sees them."""
    return [SimpleNamespace(policy=chooser, stats={"target_calls": 1}, grammar=None, tokens=[],
                            request=SimpleNamespace(max_new_tokens=max_new_tokens)) for chooser in choosers]


def test_a_wide_batch_prices_a_step_at_its_width_and_decodes_plain_where_guesses_do_not_pay():
    """A CPU's forward is compute-bound at a batch's width: each position costs half a 1-token step. One
    row gains from good guesses; 16 rows, whose one forward computes 16 positions per token each guesses,
    gain nothing from them: the batch's rows choose plain steps together (batched.py)."""
    compute_bound = [0.5 + 0.5 * w for w in range(1, 10)]
    chooser = adaptive(0.8, compute_bound, 0.05)
    assert chooser.guesses() > 0
    assert chooser.seconds(0, rows=16) == pytest.approx(0.5 + 0.5 * 16)  # the line goes on straight past width 9
    sixteen = [adaptive(0.8, compute_bound, 0.05) for _ in range(16)]
    batched.choose(batch_of(sixteen))
    assert [row.guesses() for row in sixteen] == [0] * 16
    alone = adaptive(0.8, compute_bound, 0.05)
    batched.choose(batch_of([alone]))  # a batch of one row guesses as a lone request does
    assert alone.guesses() == chooser.guesses() > 0


def test_one_sure_row_does_not_make_a_batch_pay_for_its_padding():
    """The batch's forward pads every row to the widest: a row whose guesses pay at its own share of the
    cost makes the other rows pay for positions that gain them nothing. The rows choose one k for the
    batch from all their gains: plain steps here, though the sure row alone, priced at the batch's
    width, would guess; where guesses do pay, every row takes the batch's k, which the padding pays for."""
    compute_bound = [0.5 + 0.5 * w for w in range(1, 10)]
    rows = [adaptive(0.95, compute_bound, 0.05)] + [adaptive(0.05, compute_bound, 0.05) for _ in range(3)]
    sure = rows[0]
    assert max(range(9), key=lambda k: sure.expected(k) / sure.seconds(k, rows=4)) > 0
    batched.choose(batch_of(rows))
    assert [row.guesses() for row in rows] == [0] * 4
    rows = [adaptive(0.95, FLAT, 0.01)] + [adaptive(0.05, FLAT, 0.01) for _ in range(3)]
    alone = [row.guesses() for row in rows]
    batched.choose(batch_of(rows))
    together = [row.guesses() for row in rows]
    assert together == [together[0]] * 4 and together[0] >= max(alone) and together[0] > min(alone)
    batched.choose(batch_of(rows, max_new_tokens=3))  # two tokens left: two guesses at most pay
    assert [row.guesses() for row in rows] == [2] * 4
    rows = batch_of([adaptive(0.95, FLAT, 0.01) for _ in range(2)])
    rows[1].stats["target_calls"] = 0  # it joins: its prompt's forward is its own, its guesses a tree's
    batched.choose(rows)
    assert rows[0].policy.guesses() > 0 and rows[1].policy.guesses() == 0


def batch_steps(right, steps):
    """16 rows of one pair whose previewing drafter is sure of every guess, decoded `steps` batch steps
    with a CPU-like forward; right(step): whether its guesses are the target's tokens. Each step's k,
    and how many rows looked at their guesses (previewed) in it."""
    profile = adaptive(0.6, STEEP, 0.0).profile
    ks, looks = [], []

    def preview(k):
        looks[-1] += 1
        return [7 if right(len(ks)) else 8] * k, [0.9] * k

    rows = [AdaptiveGamma(8) for _ in range(16)]
    for row in rows:
        row.start_from(profile, Drafting(preview=preview))
    for _ in range(steps):
        looks.append(0)
        plan = batched.choose(batch_of(rows))
        guesses = [row.guesses() for row in rows]
        for row, k in zip(rows, guesses):
            n = k if right(len(ks)) else 0
            row.observe(k=k, n=n, emitted=[7] * (n + 1), draft_seconds=0.0, step_seconds=None)
        plan.load.timed(plan, rows[0].seconds(plan.k, 16))  # as the line says: the measured scale is 1
        ks.append(max(guesses))
    return ks, looks


def test_a_batch_whose_guesses_never_pay_stops_looking_at_them_and_comes_back_when_they_do():
    """Previewing every row's guesses is host work at every step: where they never pay, a batch of 16
    rows settles on plain steps and then looks at its guesses ever more rarely (two looks, then 1, 2, 4,
    .. plain steps, up to PROBE_MAX); once its guesses are right again, it guesses again within two
    back-offs (its rates, learnt wrong over many steps, take a look or two to turn). A drafter that is
    always right guesses at every step."""
    ks, looks = batch_steps(lambda step: True, 50)
    assert all(k > 0 for k in ks[2:]) and all(looks)  # from the second look on: the first taught the rates
    ks, looks = batch_steps(lambda step: step >= 200, 600)
    assert all(k == 0 for k in ks[10:200])
    assert sum(1 for n in looks[100:200] if n) <= 2  # a pair of looks in 100 plain steps
    assert all(n in (0, 16) for n in looks)  # a look previews every row once
    back = next(step for step, k in enumerate(ks) if k and step >= 200)
    assert back <= 200 + 2 * (profiles.PROBE_MAX + 2) and all(ks[back:])  # its rates take a look or two


def test_a_width_prices_guesses_it_has_not_timed_as_the_nearest_width_timed_them():
    """The lone rows' line calls 48 positions nearly the price of 16 (FLAT); 16 rows measured k = 2 at
    1.8 plain steps. When a row ends, 15 rows price k = 2 and k = 3 at the price per position that
    16 rows paid, not from the line."""
    chooser = adaptive(0.8, FLAT, 0.01)
    load = batched.Load()
    for _ in range(20):
        load.timed(batched.Plan(load, 16, 0, 1.0), 1.0)
        load.timed(batched.Plan(load, 16, 2, 1.8), 1.8)
    assert load.seconds(chooser, 16, 2) / load.seconds(chooser, 16, 0) == pytest.approx(1.8, rel=0.05)
    assert load.seconds(chooser, 15, 2) / load.seconds(chooser, 15, 0) == pytest.approx(1.8, rel=0.05)
    assert chooser.seconds(2, 15) / chooser.seconds(0, 15) < 1.2  # what the line alone would say
    per_position = 0.8 / 32  # what each of 16 rows' 2 extra positions cost
    assert load.seconds(chooser, 15, 3) == pytest.approx(load.seconds(chooser, 15, 0) + per_position * 45)


def test_a_wide_batch_that_timed_one_k_prices_every_wider_k_from_it():
    """The lone rows' line (FLAT) calls 16 rows' guesses nearly free, but each position a step adds
    costs a tenth of a plain step there. Once one step with guesses is timed, every k is priced at
    that price per position, not from the line: a batch does not time each k at a loss in turn."""
    chooser = adaptive(0.8, FLAT, 0.01)
    load = batched.Load()
    load.timed(batched.Plan(load, 16, 0, 1.0), 1.0)
    load.timed(batched.Plan(load, 16, 1, 1.0), 1.0 + 0.1 * 16)
    for k in range(2, 9):
        assert load.seconds(chooser, 16, k) == pytest.approx(1.0 + 0.1 * 16 * k, rel=0.05)
        assert chooser.seconds(k, 16) < 1.1  # what the line alone would say


def test_a_width_that_timed_guesses_before_any_plain_step_prices_every_k_from_them():
    """A batch's first regular step may guess: its rows' plain steps were the prompt's or a joining row's, which
    are not timed. That one step prices every other k at its width against the line's plain step, so the
    batch does not time each k once, at a loss, before it times k = 0."""
    chooser = adaptive(0.8, FLAT, 0.01)
    load = batched.Load()
    plain = chooser.seconds(0, 4)
    load.timed(batched.Plan(load, 4, 3, plain), plain + 0.1 * 12)
    for k in (1, 2, 4, 8):
        assert load.seconds(chooser, 4, k) == pytest.approx(plain + 0.1 * 4 * k, rel=0.05)
        assert chooser.seconds(k, 4) < plain + 0.1 * 4 * k / 2  # what the line alone would say


def test_a_probe_follows_a_run_of_plain_steps_and_backs_off_while_probes_fail():
    chooser = adaptive(0.05, STEEP, 0.5)
    choices = []
    for _ in range(8 + 16 + 1):
        k = chooser.guesses()
        choices.append(k)
        chooser.observe(k=k, n=0, emitted=[1], draft_seconds=0.5 * k, step_seconds=STEEP[k] + 0.5 * k)
    assert [i for i, k in enumerate(choices) if k] == [7, 7 + 16]  # after 8 plain steps, then after 16


def test_no_probe_where_even_perfect_guesses_would_not_pay():
    """Each extra token verified costs 1.5 steps (beam search's wide forwards on a CPU): k guesses that
    all survive make k + 1 tokens in more than k + 1 steps' time, so a probe can only lose."""
    costly = [1.0 + 1.5 * w for w in range(9)]
    chooser = adaptive(0.05, costly, 0.1)
    for _ in range(200):
        assert chooser.guesses() == 0
        chooser.observe(k=0, n=0, emitted=[1], draft_seconds=0.0, step_seconds=1.0)
    assert chooser.could_pay() is False
    # cheaper verification: the next plain step is followed by a probe
    chooser.verify = costs.VerifyCost([0.0, *STEEP])
    assert chooser.could_pay() is True and chooser.guesses() == 1


def test_a_step_timed_at_zero_or_less_measures_nothing():
    """Under load a step's own time (its whole time less its draft's) can come out at 0 s or less: such a
    step leaves the verify line as it was, so no width is priced as free (a division by zero failed a
    server's batch)."""
    verify = costs.VerifyCost([0.0, *STEEP])
    before = verify.line()
    for seconds in (0.0, -0.01, -1.0):
        verify.add(3, seconds)
    assert verify.line() == before and all(verify(w) > 0 for w in range(1, 9))


def test_the_verify_line_never_prices_a_width_at_zero():
    """A line whose wider forward was timed faster than a narrower one, then steps timed in busy moments
    (tiny at one token, long at three): every width still costs more than nothing, and no less than a
    narrower one (a server's batch failed on a division by zero)."""
    verify = costs.VerifyCost([0.0, 1.0, 0.5, 2.0])
    for _ in range(200):
        verify.add(1, 1e-6)
        verify.add(3, 10.0)
    line = verify.line()[1:]
    assert all(t > 0 for t in line) and line == sorted(line)


def test_plain_steps_count_toward_a_probe_across_requests():
    """Many short requests (a server's) must not lock the pair out of speculating for good: the pair's
    α is low, so each request starts with plain steps, but a probe comes after 8 of them in all."""
    chooser = adaptive(0.05, STEEP, 0.5)
    choices = []
    for _ in range(4):  # 4 requests of 3 steps
        chooser.start_from(chooser.profile, Drafting())
        for _ in range(3):
            k = chooser.guesses()
            choices.append(k)
            chooser.observe(k=k, n=0, emitted=[1], draft_seconds=0.5 * k, step_seconds=STEEP[k] + 0.5 * k)
    assert [i for i, k in enumerate(choices) if k] == [7]


def test_the_rate_after_an_accepted_guess_follows_the_first_until_measured():
    """A sure draft whose first guesses all survive: with b at a prior of 0.6 its second guess would not
    be worth a guess's cost, none would be made and b never measured. Until one is, b is a."""
    profile = profiles.PairProfile()  # a new pair: nothing measured but its timings
    profile.t_verify, profile.t_draft = [0.0, *FLAT], 0.5
    chooser = AdaptiveGamma(8)
    chooser.start_from(profile, Drafting(early_stop=True))
    for _ in range(20):  # one sure guess a step, each accepted
        chooser.guesses()
        chooser.keep_guessing(1, 0.99)
        chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=0.5, step_seconds=1.5)
    assert chooser.later is None and chooser.later_rate() == chooser.first.value > 0.95
    chooser.guesses()
    assert chooser.keep_guessing(1, 0.99)  # a second guess pays at b = a
    chooser.profile.later = 0.6  # what a prior of its own did: stuck at one guess
    chooser.start_from(chooser.profile, Drafting(early_stop=True))
    chooser.guesses()
    assert not chooser.keep_guessing(1, 0.99)
    chooser.profile.later = None
    chooser.start_from(chooser.profile, Drafting(early_stop=True))
    chooser.guesses()
    chooser.keep_guessing(1, 0.99)
    chooser.keep_guessing(2, 0.99)
    chooser.observe(k=2, n=1, emitted=[1, 2], draft_seconds=1.0, step_seconds=2.0)  # guess 2 rejected
    assert chooser.later is not None and chooser.later_rate() < chooser.first.value
    chooser.finish()
    assert chooser.profile.later is not None and chooser.profile.later < chooser.profile.first


def test_a_low_rate_after_an_accepted_guess_drifts_back_to_the_first_without_evidence():
    """b learnt low on other text and a sure draft now: at b = 0.5 a second guess does not pay, so none
    is made and b would never be measured again. Steps that check no later guess move b towards a."""
    profile = profiles.PairProfile()
    profile.t_verify, profile.t_draft, profile.first, profile.later = [0.0, *STEEP], 0.5, 0.99, 0.5
    chooser = AdaptiveGamma(8)
    chooser.start_from(profile, Drafting(early_stop=True))
    seconds = 0.5 + STEEP[1]  # a guess and a 2-token verify
    for step in range(30):
        chooser.guesses()
        if chooser.keep_guessing(1, 0.99):
            break
        chooser.observe(k=1, n=1, emitted=[1, 2], draft_seconds=0.5, step_seconds=seconds)
    assert 10 <= step <= 20 and chooser.later_rate() > 0.85


def test_keep_guessing_stops_when_the_draft_is_unsure():
    chooser = adaptive(0.7, FLAT, 0.2, confident_drafter=True)
    # what the confidence bins have learnt: sure guesses survive, unsure ones do not
    chooser.profile.confidence = [[0.1, 10.0], [1.0, 10.0], [5.0, 10.0], [8.0, 10.0], [9.9, 10.0]]
    assert chooser.guesses() == 8  # a drafter that reports confidences may go up to k_max
    assert chooser.keep_guessing(1, 0.95) and chooser.keep_guessing(2, 0.97)
    assert not chooser.keep_guessing(3, 0.05)  # survival now ~0.01: another guess is not worth its cost
    chooser.guesses()
    assert not chooser.keep_guessing(1, 0.1)


def test_keep_guessing_looks_past_a_jump_in_the_verify_costs():
    """Flat to 6 tokens, 30% dearer from 7 on, flat again (a CPU's products): after 5 sure guesses a
    sixth alone does not pay for the jump, but three more do."""
    jump = [1.0] * 6 + [1.3] * 3
    chooser = adaptive(0.95, jump, 0.02, confident_drafter=True)
    chooser.guesses()
    assert all(chooser.keep_guessing(i, 0.99) for i in range(1, 6))
    expected = chooser.expected_with(chooser.confidences)
    rate = expected[5] / chooser.seconds(5)
    assert (expected[5] + chooser.later_rate() * (expected[5] - expected[4])) / chooser.seconds(6) < rate
    chooser.guesses()
    assert all(chooser.keep_guessing(i, 0.99) for i in range(1, 8))  # 8 = k_max: no more


def test_confidence_bins_learn_from_verified_guesses_only():
    chooser = adaptive(0.5, FLAT, 0.05, confident_drafter=True)
    chooser.guesses()
    for i, c in enumerate([0.9, 0.9, 0.1, 0.9], 1):
        chooser.keep_guessing(i, c)
    before = [list(b) for b in chooser.profile.confidence]
    chooser.observe(k=4, n=2, emitted=[1, 2, 3], draft_seconds=0.2, step_seconds=1.2)  # 1, 2 accepted, 3 not
    top, low = chooser.profile.confidence[4], chooser.profile.confidence[0]
    decay = rates.DECAY
    assert top == pytest.approx([(before[4][0] * decay + 1) * decay + 1, (before[4][1] * decay + 1) * decay + 1])
    assert low == pytest.approx([before[0][0] * decay, before[0][1] * decay + 1])


def test_make_policy():
    assert isinstance(make_policy(3), FixedGamma) and make_policy(3).guesses() == 3
    assert isinstance(make_policy("auto"), AdaptiveGamma) and make_policy("auto").k_max == policy.GAMMA_MAX
    for bad in (0, -1, 2.5, True, "fast", None):
        with pytest.raises(ValueError, match="gamma"):
            make_policy(bad)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    reference = make_reference("llama_gqa")
    directory = save_reference(reference, tmp_path_factory.mktemp("policy"))
    return {
        "target": minispec.load(directory),
        "same": minispec.load(directory),  # alpha = 1
        "independent": minispec.load(save_reference(make_reference("llama_gqa", seed=7),
                                                    tmp_path_factory.mktemp("policy_indep"))),
    }


def test_what_each_drafter_lets_the_policy_do(pair):
    """lookup is previewed, its trees too under tree="auto", but not in beam search; a draft model on a
    CPU stops early on its confidence (not in beam search), and its trees are chosen by measured speed."""
    target = pair["target"]
    lookup, model = drafters.make_drafter("lookup", target), drafters.make_drafter(pair["same"], target)
    assert policy.drafting(lookup, None, False) == Drafting(preview=lookup.preview)
    assert policy.drafting(lookup, None, True) == Drafting(preview=lookup.preview, preview_tree=lookup.preview_tree)
    assert policy.drafting(model, None, False) == Drafting(early_stop=True)
    assert policy.drafting(model, None, True) == Drafting(early_stop=True, branching=True)
    assert policy.drafting(lookup, (2, 2), False) == policy.drafting(model, (2, 2), False) == Drafting()


def test_end_to_end_long_drafts_when_alpha_is_high_and_none_when_low(pair, known_costs):
    target = pair["target"]
    plain = minispec.generate(target, PROMPT, max_new_tokens=60, ignore_eos=True)
    good = minispec.generate(target, PROMPT, draft=pair["same"], gamma="auto", max_new_tokens=60, ignore_eos=True)
    bad = minispec.generate(target, PROMPT, draft=pair["independent"], gamma="auto", max_new_tokens=60,
                            ignore_eos=True)
    assert good.tokens == plain.tokens == bad.tokens
    histogram = good.stats["guesses_histogram"]
    assert sum(k * steps for k, steps in enumerate(histogram)) >= 5 * sum(histogram)  # α = 1: long drafts
    histogram = bad.stats["guesses_histogram"]
    assert bad.stats["alpha_estimate"]["first_guess"] < 0.3 and histogram[0] >= 0.7 * sum(histogram)  # plain steps
    assert good.stats["expected_tokens_per_call"] > 5 and bad.stats["expected_tokens_per_call"] < 1.5


def test_the_prior_carries_alpha_to_the_next_request(pair, known_costs):
    target, draft = pair["target"], pair["independent"]
    first = minispec.generate(target, PROMPT, draft=draft, gamma="auto", max_new_tokens=40, ignore_eos=True)
    second = minispec.generate(target, PROMPT, draft=draft, gamma="auto", max_new_tokens=40, ignore_eos=True)
    # the first request starts hopeful (DEFAULT_ALPHA) and learns; the second starts from what it learnt
    assert first.stats["guesses_histogram"][0] < second.stats["guesses_histogram"][0]
    assert policy.PROFILES[target][id(draft), None].first < rates.DEFAULT_ALPHA


def test_stats_report_the_cost_model(pair):
    out = minispec.generate(pair["target"], PROMPT, draft="lookup", gamma="auto", max_new_tokens=20)
    stats = out.stats
    assert stats["gamma"] == "auto" and sum(stats["guesses_histogram"]) == stats["target_calls"]
    assert set(stats["cost_model"]["t_verify"]) == set(range(1, policy.GAMMA_MAX + 2))
    assert all(t > 0 for t in stats["cost_model"]["t_verify"].values())
    assert all(0 <= rate <= 1 for rate in stats["alpha_estimate"].values()) and stats["expected_tokens_per_call"] >= 1
    by_confidence = stats["acceptance_by_confidence"]
    assert len(by_confidence) == rates.CONFIDENCE_BINS and any(rate is not None for rate in by_confidence)
    assert all(rate is None or 0 <= rate <= 1 for rate in by_confidence)


# --- no up-front timing; the costs kept between processes (profiles.py) ---------------------------
REPEATING = [5, 17, 33, 8, 90, 41] * 4  # lookup finds matches in it


def count_forwards(model, monkeypatch):
    calls = []
    forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: calls.append(1) or forward(*args, **kwargs))
    return calls


@pytest.fixture
def fresh_profiles(monkeypatch, tmp_path):
    """An empty folder for the pairs' files, and a process that has decoded nothing yet."""
    monkeypatch.setenv("MINISPEC_PROFILES", str(tmp_path / "profiles"))
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())
    monkeypatch.setattr(profiles, "unwritable", False)
    return tmp_path / "profiles"


@pytest.fixture
def steady_clock(monkeypatch):
    """Every step takes a millisecond, whatever its width, and drafting none: guesses cost nothing, so a
    policy speculates wherever its drafter guesses (real times on a busy machine may say otherwise)."""
    observe = AdaptiveGamma.observe

    def steady(self, k, n, emitted, draft_seconds, step_seconds, nodes=0):
        return observe(self, k, n, emitted, 0.0, step_seconds and 1e-3, nodes)
    monkeypatch.setattr(AdaptiveGamma, "observe", steady)


@pytest.mark.parametrize("draft", ["lookup", "same"])
def test_a_new_pair_times_no_forward_before_it_decodes(pair, draft, fresh_profiles, steady_clock, monkeypatch):
    """No calibration: every target forward is one of the request's steps. The first steps are plain
    (the prompt's forward, then the step that gives the costs their scale), then it speculates."""
    target = pair["target"]
    draft = pair.get(draft, draft)
    plain = minispec.generate(target, REPEATING, max_new_tokens=30, ignore_eos=True)
    forwards = count_forwards(target, monkeypatch)
    out = minispec.generate(target, REPEATING, draft=draft, max_new_tokens=30, ignore_eos=True)
    assert out.tokens == plain.tokens
    assert len(forwards) == out.stats["target_calls"]
    histogram = out.stats["guesses_histogram"]
    assert histogram[0] >= 2, histogram
    if draft == "lookup":  # free guesses that the repeating text confirms (a draft model as large as its
        assert sum(histogram[1:]) >= 1, histogram  # target is not worth its cost: it may never guess)


def test_costs_are_kept_for_the_next_process(pair, fresh_profiles, steady_clock, monkeypatch):
    target, draft = pair["target"], "lookup"
    first = minispec.generate(target, REPEATING, draft=draft, max_new_tokens=20, ignore_eos=True)
    [path] = fresh_profiles.glob("*.json")
    stored = json.loads(path.read_text())
    assert stored["key"]["target"]["checkpoint"] == target.fingerprint and stored["key"]["k_max"] == policy.GAMMA_MAX
    assert stored["profile"]["t_verify"][1:] == pytest.approx(list(first.stats["cost_model"]["t_verify"].values()))
    assert list(fresh_profiles.iterdir()) == [path]  # written whole: no temporary file left
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())  # a new process
    chooser = AdaptiveGamma(policy.GAMMA_MAX)
    chooser.start(target, drafters.make_drafter(draft, target), torch.tensor([REPEATING]))
    # costs known from its first step, and the rates the last process learnt
    assert chooser.verify is not None and chooser.profile.t_verify == stored["profile"]["t_verify"]
    assert chooser.first.value == pytest.approx(stored["profile"]["first"]) != rates.DEFAULT_ALPHA
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())
    torch.set_num_threads(2)  # another setting the costs depend on: another file
    try:
        minispec.generate(target, REPEATING, draft=draft, max_new_tokens=4, ignore_eos=True)
    finally:
        torch.set_num_threads(1)
    assert len(list(fresh_profiles.glob("*.json"))) == 2


def test_a_changed_checkpoint_is_another_pair(tmp_path):
    directory = save_reference(make_reference("gpt2"), tmp_path / "ckpt")
    before = minispec.load(directory).fingerprint
    assert minispec.load(directory).fingerprint == before
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # the same bytes, written again: a new file time
    assert minispec.load(directory).fingerprint != before
    assert minispec.load(directory, quantize="int8").fingerprint not in (before, minispec.load(directory).fingerprint)


def test_an_unreadable_file_is_ignored_and_replaced(pair, fresh_profiles, capsys):
    target = pair["target"]
    minispec.generate(target, REPEATING, draft="lookup", max_new_tokens=4, ignore_eos=True)
    [path] = fresh_profiles.glob("*.json")
    good = path.read_text()
    broken = [good.replace('"t_verify": [', '"t_verify": [1, '), good.replace('"first": ', '"first": -'),
              good.replace('"t_verify": [0.0,', '"t_verify": [NaN,')]
    assert all(bad != good for bad in broken)
    for bad in ("{not json", json.dumps({"key": "another", "profile": {}}), *broken):
        path.write_text(bad)
        policy.PROFILES.clear()
        out = minispec.generate(target, REPEATING, draft="lookup", max_new_tokens=4, ignore_eos=True)
        assert out.stats["guesses_histogram"][0] >= 2  # started from nothing
        assert f"minispec: ignoring the stored costs {path}" in capsys.readouterr().err
        json.loads(path.read_text())  # written again, whole


def test_a_pair_not_timed_yet_keeps_its_rates(pair, fresh_profiles, capsys):
    """A request too short to time a step (the prompt's forward, then one step) keeps what it saw."""
    minispec.generate(pair["target"], REPEATING, draft="lookup", max_new_tokens=1, ignore_eos=True)
    [path] = fresh_profiles.glob("*.json")
    assert json.loads(path.read_text())["profile"]["t_verify"] is None
    policy.PROFILES.clear()
    minispec.generate(pair["target"], REPEATING, draft="lookup", max_new_tokens=8, ignore_eos=True)
    assert "ignoring" not in capsys.readouterr().err and json.loads(path.read_text())["profile"]["t_verify"]


def test_a_folder_that_cannot_be_written_is_noted_once(pair, fresh_profiles, capsys):
    fresh_profiles.parent.mkdir(exist_ok=True)
    fresh_profiles.write_text("a file where the folder should be")
    for _ in range(2):
        policy.PROFILES.clear()
        minispec.generate(pair["target"], REPEATING, draft="lookup", max_new_tokens=4, ignore_eos=True)
    assert capsys.readouterr().err.count("cannot keep gamma='auto' costs") == 1


# --- tree="auto": which tree a step verifies ------------------------------------------------------

# A previewed tree: the chain 7 8 9 (each node at confidence 0.5), 20 beside 7 and 21 below 7 beside 8
# (0.3 each). While their bins have seen nothing, each node survives as any guess in its place does:
# a at depth one, b below (both 0.5 here), whatever the drafter's confidence.
TREE = ([7, 8, 9, 20, 21], [-1, 0, 1, -1, 0], [0.5, 0.5, 0.5, 0.3, 0.3])


def tree_chooser(t_verify, tree=TREE, alpha=0.5):
    chooser = adaptive(alpha, t_verify, 0.0)
    previewed = PreviewedTree(*tree)
    chooser.start_from(chooser.profile, Drafting(preview=lambda k: ([], []), preview_tree=lambda k, budget: previewed))
    return chooser


def test_a_previewed_tree_verifies_the_first_nodes_with_the_most_expected_tokens_per_second():
    # Flat costs: the chain 7 8 9 expects 1 + 0.5 + 0.25 + 0.125 tokens a call, with 20 0.5 more, with
    # 21 (below 7) 0.25 more: all five, 2.625 tokens.
    chooser = tree_chooser(FLAT)
    assert chooser.guesses() == 3 and chooser.tree_nodes == 5
    assert chooser.planned == pytest.approx(2.625)
    # CPU-like costs (a quarter step a token): 1 guess, 1.5 / 1.25, beats 7 8 9 20's 2.375 / 2.0
    chooser = tree_chooser(STEEP)
    assert chooser.guesses() == 1 and chooser.tree_nodes == 1
    # guesses that seldom survive: no guess at all
    chooser = tree_chooser(STEEP, alpha=0.05)
    assert chooser.guesses() == 0 and chooser.tree_nodes is None


def test_a_tree_branches_over_at_most_tree_auto_nodes_and_a_chain_runs_to_k_max():
    from minispec.decoding.tree import TREE_AUTO

    sure = [0.9] * 8
    chooser = tree_chooser(FLAT, tree=(list(range(8)), list(range(-1, 7)), sure), alpha=0.9)
    assert chooser.guesses() == 8 and chooser.tree_nodes == 8  # a chain: as long as it pays
    branching = (list(range(8)), [-1, -1, 0, 1, 2, 3, 4, 5], sure)  # two chains from the root
    chooser = tree_chooser(FLAT, tree=branching, alpha=0.9)
    chooser.guesses()
    assert chooser.tree_nodes == TREE_AUTO


def test_every_previewed_node_whose_parent_survived_is_checked():
    """Below 7: 8 (0.5); beside 7: 20 (0.3), and below 20 another 8 (0.9). The target emitted 7, 8 and
    then its own 40: 7 and 8 survived, 20 did not, and the 8 below 20 was never reached."""
    chooser = tree_chooser(FLAT, tree=([7, 8, 20, 8], [-1, 0, -1, 2], [0.5, 0.5, 0.3, 0.9]))
    chooser.guesses()
    chooser.observe(k=2, n=2, emitted=[7, 8, 40], draft_seconds=0.0, step_seconds=1.2, nodes=4)
    first, later = chooser.profile.tree_confidence
    bin_of = rates.bin_of
    assert first[bin_of(0.5)] == [1.0, 1.0] and first[bin_of(0.3)] == [0.0, 1.0]
    assert later[bin_of(0.5)] == [1.0, 1.0] and later[bin_of(0.9)] == [0.0, 0.0]
    # one miss in its bin, shrunk towards a (which that step's accepted first guess raised)
    assert chooser.survival(first, 0.3, True) == pytest.approx((0 + 2 * chooser.first.value) / 3)


def test_a_tree_step_times_the_line_a_chain_is_priced_by():
    """A forward is priced by its width, tree or chain: tree steps refit the one line."""
    chooser = tree_chooser(FLAT)
    chooser.guesses()
    before = chooser.verify(6)
    for _ in range(10):
        chooser.observe(k=2, n=1, emitted=[7, 30], draft_seconds=0.0, step_seconds=3.0, nodes=5)
    assert chooser.verify(6) > before + 0.5
    # a draft model's tree, chosen by measured speed: its k guesses took fewer draft forwards than k,
    # so a GPU's verify time (the step's less k drafts) would be off; it times no line
    chooser = adaptive(0.9, FLAT, 0.05)
    chooser.start_from(chooser.profile, Drafting(measure_draft=False, branching=True))
    before = chooser.verify(5)
    for _ in range(10):
        chooser.observe(k=2, n=1, emitted=[7, 30], draft_seconds=0.0, step_seconds=3.0, nodes=4)
    assert chooser.verify(5) == before


@pytest.mark.parametrize("tree_tokens, most", [(6, "tree"), (2, "chain")])
def test_a_branching_drafter_takes_the_faster_of_chain_and_tree_and_probes_the_other(tree_tokens, most):
    """A draft model's trees cost forwards to grow: the policy compares the tokens per second of its
    chain and tree steps. Chains first; a tree after PROBE_AFTER steps; then whichever measured faster,
    the other tried every PROBE_AFTER steps until it has MODE_EVIDENCE steps to its name, then at
    intervals that double while it stays behind."""
    chooser = adaptive(0.9, FLAT, 0.05)
    chooser.start_from(chooser.profile, Drafting(branching=True))
    trees = []
    for _ in range(300):
        k = chooser.guesses()
        trees.append(chooser.tree_nodes is not None)
        emitted = [1] * (tree_tokens if trees[-1] else 4)
        chooser.observe(k=k, n=len(emitted) - 1, emitted=emitted, draft_seconds=0.1, step_seconds=1.0,
                        nodes=chooser.tree_nodes or 0)
    first_tree = trees.index(True)
    assert first_tree == profiles.PROBE_AFTER - 1
    probes = [i for i in range(first_tree, len(trees)) if trees[i] == (most == "chain")]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] == profiles.PROBE_AFTER and all(b in (a, 2 * a) for a, b in zip(gaps, gaps[1:]))
    assert gaps.count(profiles.PROBE_AFTER) >= 4 and gaps[-1] >= 64  # 8 steps apart till measured, then 16, 32, ..


def test_trees_that_lose_their_first_probes_by_chance_are_measured_before_being_left():
    """A step makes 1 to 5 tokens: a head's trees, truly faster, may make 1 token at each of their first
    two probes. They are probed every PROBE_AFTER steps until measured over MODE_EVIDENCE steps, and so
    taken within ~50 steps, not after the 250 that doubling intervals from the first probe would take."""
    chooser = adaptive(0.9, FLAT, 0.05)
    chooser.start_from(chooser.profile, Drafting(branching=True))
    trees, tree_steps = [], 0
    for _ in range(150):
        k = chooser.guesses()
        trees.append(chooser.tree_nodes is not None)
        tree_steps += trees[-1]
        emitted = [1] * ((1 if tree_steps <= 2 else 6) if trees[-1] else 4)
        chooser.observe(k=k, n=len(emitted) - 1, emitted=emitted, draft_seconds=0.1, step_seconds=1.0,
                        nodes=chooser.tree_nodes or 0)
    assert sum(trees[100:]) >= 45, trees


def test_a_branching_drafters_tree_is_its_likeliest_first_guesses():
    """A tree step of a draft model or head: each depth costs a draft forward, and deeper trees measured
    slower than one depth, so the tree is the drafter's TREE_WIDTH likeliest first
    guesses, however deep a chain the cost model would verify, for a weak drafter and a sure one."""
    from minispec.decoding.drafters import TREE_WIDTH

    for alpha, t_draft in ((0.4, 0.1), (0.95, 0.02)):
        chooser = adaptive(alpha, STEEP, t_draft, confident_drafter=True)
        chooser.start_from(chooser.profile, Drafting(early_stop=True, branching=True))
        chain = max(range(9), key=lambda k: chooser.expected(k) / chooser.seconds(k))
        # trees measured faster
        chooser.profile.modes = {"chain": [1.0, 1.0, 1.0], "tree": [9.0, 1.0, 1.0], "plain": [0.0, 0.0, 0.0]}
        assert chain > 1 or alpha < 0.5
        assert chooser.guesses() == 1 and chooser.tree_nodes == TREE_WIDTH


def test_trees_measured_faster_than_plain_steps_are_taken_whatever_a_says():
    """A head right a third of the time: a's estimate, from its last ~10 first guesses, often falls
    below where one guess pays, and plain steps never correct it. Its trees' measured speed against the
    plain steps' measured speed decides (not the cost model's plain step: a fit, not a measurement)."""
    for tree_rate, plain_seconds, guesses in ((1.5, 1.0, 1), (0.8, 1.0, 0), (1.5, 0.5, 0), (1.5, 0.0, 0)):
        chooser = adaptive(0.02, [1.0] * 9, 0.3)  # the cost model's plain step: 1 s
        chooser.start_from(chooser.profile, Drafting(early_stop=True, branching=True))
        chooser.profile.modes = {"chain": [1.0, 2.0, 1.0], "tree": [tree_rate, 1.0, 1.0],
                                 "plain": [1.0, plain_seconds, 1.0]}
        chooser.profile.preferred = "tree"
        assert chooser.guesses() == guesses
        assert (chooser.tree_nodes is not None) == bool(guesses)


def test_a_branching_drafters_tree_is_probed_while_a_keeps_chains_out():
    """Plain steps count towards the next try of the mode not preferred: with a's estimate too low for
    any guess, a head's tree is still tried every PROBE_AFTER steps (and so measured), not never."""
    chooser = adaptive(0.02, [1.0] * 9, 0.3)
    chooser.start_from(chooser.profile, Drafting(early_stop=True, branching=True))
    steps = [(chooser.guesses(), chooser.tree_nodes) for _ in range(profiles.PROBE_AFTER)]
    assert steps[:-1] == [(0, None)] * (profiles.PROBE_AFTER - 1)
    assert steps[-1][0] == 1 and steps[-1][1] is not None


def test_stored_tree_costs_and_rates_are_checked():
    profile = profiles.PairProfile()
    values = {name: getattr(profile, name) for name in profiles.FIELDS}
    profiles.check(values, policy.GAMMA_MAX + 2)
    for name, bad in [("t_verify", [1.0] * 3),
                      ("modes", {"chain": [1.0, -1.0, 1.0], "tree": [0.0] * 3, "plain": [0.0] * 3}),
                      ("tree_confidence", [[[2.0, 1.0]] * rates.CONFIDENCE_BINS] * 2), ("modes", {"tree": [0, 0, 0]}),
                      ("modes", {"chain": [0.0] * 2, "tree": [0.0] * 2, "plain": [0.0] * 2})]:
        with pytest.raises(ValueError, match="out of range"):
            profiles.check({**values, name: bad}, policy.GAMMA_MAX + 2)


def test_a_profile_write_killed_at_any_point_leaves_the_last_whole_file(tmp_path, monkeypatch):
    """kill -9 in the middle of the Nth of a run of profile writes: the file holds the (N-1)th, whole, and
    the next run reads it and writes over it."""
    saving = KILLING + """
from minispec.decoding import profiles
for value in range(1, 5):
    profile = profiles.PairProfile()
    profile.t_draft = value / 1000
    profiles.save({"version": profiles.VERSION, "k_max": 4, "pair": "killed"}, profile)
"""
    monkeypatch.setenv("MINISPEC_PROFILES", str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    key = {"version": profiles.VERSION, "k_max": 4, "pair": "killed"}
    for kill_at in (2, 3, 4):
        killed = subprocess.run([sys.executable, "-c", saving], env={**env, "KILL_AT": str(kill_at)},
                                capture_output=True, text=True, timeout=120)
        assert killed.returncode == -9, killed.stderr[-2000:]
        profile = profiles.PairProfile()
        assert profiles.load(key, profile) and profile.t_draft == (kill_at - 1) / 1000
        profile.t_draft = 0.5
        profiles.save(key, profile)
        assert profiles.load(key, profiles.PairProfile())
