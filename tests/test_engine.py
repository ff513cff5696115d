"""Batched requests (minispec.decoding.engine, through minispec.generate with a list of prompts): every request's
output is what it gives decoded alone, finished rows hand their cache rows on, bad input fails before
any work, and the forward's rows keep their own positions bit for bit."""

import pytest
import torch

import minispec
from minispec.models.base import Feed
from minispec import api
from minispec.models import kernels
from conftest import make_reference, noisy_copy, save_reference

KINDS = ["gpt2", "llama", "llama_gqa", "qwen2", "qwen3", "t5_v1_1"]
PROMPTS = [[5, 17, 33, 8, 90, 41, 2, 63], [9, 4], [3, 3, 3, 7, 11, 13, 40, 50, 60, 70, 80, 1], [44, 45, 46], [8],
           [12, 30, 31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return {kind: minispec.load(save_reference(make_reference(kind), tmp_path_factory.mktemp(kind))) for kind in KINDS}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", KINDS)
def test_each_request_gets_what_it_gets_alone(targets, kind, temperature):
    """Greedy: the same tokens. Sampled: the same tokens for the same seed (each row draws from its own
    generator, from bit-identical logits), so the distribution is the target's too."""
    target = targets[kind]
    settings = {"max_new_tokens": 20, "ignore_eos": True, "temperature": temperature, "seed": 3}
    alone = [minispec.generate(target, prompt, **settings).tokens for prompt in PROMPTS]
    assert len({tuple(tokens) for tokens in alone}) == len(PROMPTS)
    for batch_size in (None, 4, 2, 1):  # 6 rows at once, and continuous batching with fewer rows
        together = minispec.generate(target, PROMPTS, batch_size=batch_size, **settings)
        assert [out.tokens for out in together] == alone, f"batch_size={batch_size}"


def test_rows_that_finish_early_leave_and_others_take_their_place(targets):
    """Stops at different steps (EOS of each prompt's own continuation, a stop token): each output ends
    where it ends alone, and a row's forwards stop when it does."""
    target = targets["llama"]
    greedy = {"max_new_tokens": 24, "ignore_eos": True}
    ends = [minispec.generate(target, prompt, **greedy).tokens[3 + 2 * i] for i, prompt in enumerate(PROMPTS)]
    settings = {"max_new_tokens": 24, "stop_token_ids": ends[:3]}
    alone = [minispec.generate(target, prompt, **settings) for prompt in PROMPTS]
    assert len({len(out.tokens) for out in alone}) > 2  # they do end at different steps
    together = minispec.generate(target, PROMPTS, batch_size=3, **settings)
    assert [out.tokens for out in together] == [out.tokens for out in alone]
    for out in together:  # its prefill, then one forward per token after the first
        assert out.stats["target_calls"] == len(out.tokens)


def test_a_row_that_ended_never_moves_and_a_move_copies_what_the_row_holds(targets):
    """Each move copies a cache row: over a long context's row, as dear as a wide forward. Rows past the
    batch's new end that go on fill its gaps; rows that ended stay where they are; a move copies the
    positions the row holds, and leaves the rest of the destination's row alone."""
    from types import SimpleNamespace
    from minispec.decoding.engine import leave

    class Caches:
        def __init__(self):
            self.moves = []

        def move_row(self, source, destination, length=None):
            self.moves.append((source, destination, length))

    target, draft = Caches(), Caches()
    batch = [SimpleNamespace(slot=i, length=10 + i, drafter=SimpleNamespace(length=20 + i, model=draft, row=i))
             for i in range(6)]
    rows = list(batch)
    leave(batch, [rows[1], rows[3], rows[5]], [target, draft])  # 5, the last, ended too: 4 fills a gap
    assert target.moves == [(4, 1, 14)] and draft.moves == [(4, 1, 24)]
    assert batch == [rows[0], rows[4], rows[2]] and rows[4].slot == rows[4].drafter.row == 1
    model = targets["llama"]
    model.ensure_caches(2, 16)
    cache = model.kv_caches()[0]
    cache.k[0], cache.k[1] = 1.0, 2.0
    model.move_row(0, 1, 3)
    assert (cache.k[1, :, :3] == 1).all() and (cache.k[1, :, 3:] == 2).all()


def test_tokens_come_to_the_callback_per_request_as_they_are_made(targets):
    got = {i: [] for i in range(len(PROMPTS))}
    out = minispec.generate(targets["gpt2"], PROMPTS, max_new_tokens=10, ignore_eos=True, batch_size=4,
                            on_tokens=lambda i, tokens: got[i].extend(tokens))
    assert [got[i] for i in range(len(PROMPTS))] == [o.tokens for o in out]


# Prompts that repeat themselves, so that lookup and ngram have something to guess.
COPYING = [[5, 6, 7, 8, 9, 5, 6, 7], [9, 4, 9, 4, 9], [3, 3, 3, 7, 11, 13, 3, 3, 3, 7], [44, 45, 46, 44, 45],
           [8, 1, 8, 1, 8, 1], [12, 30, 31, 12, 30, 31, 12]]


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """Per kind: a noisy copy of the target, a draft model accepted most of the time."""
    return {kind: minispec.load(save_reference(noisy_copy(make_reference(kind), seed=1, scale=0.05),
                                               tmp_path_factory.mktemp(f"{kind}_draft"))) for kind in KINDS}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("draft", ["lookup", "ngram", "model"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_speculation_gives_each_request_what_it_gets_alone(targets, drafts, kind, draft, temperature):
    """Each row guesses, verifies and rolls back on its own (a draft model keeps a cache row per request
    too); with a fixed γ even its random draws are the lone request's, so sampled outputs are equal
    for the same seed, and so are the target's and the draft's forward counts."""
    target = targets[kind]
    settings = {"max_new_tokens": 24, "ignore_eos": True, "temperature": temperature, "seed": 5,
                "draft": drafts[kind] if draft == "model" else draft}
    for gamma in (1, 4, "auto"):
        alone = [minispec.generate(target, prompt, gamma=gamma, **settings) for prompt in COPYING]
        assert sum(out.stats["proposed"] for out in alone) > 0 or gamma == "auto"
        for batch_size in (None, 4):
            together = minispec.generate(target, COPYING, gamma=gamma, batch_size=batch_size, **settings)
            if gamma == "auto" and temperature:  # lengths chosen in a batch may differ: the same distribution
                continue
            assert [out.tokens for out in together] == [out.tokens for out in alone], f"{gamma}, {batch_size}"
            if gamma != "auto":
                for key in ("target_calls", "draft_calls", "accepted"):
                    assert [out.stats[key] for out in together] == [out.stats[key] for out in alone], key


def test_t5_runs_its_encoder_once_per_request(targets):
    target = targets["t5_v1_1"]
    before = target.encoder_calls
    minispec.generate(target, PROMPTS, max_new_tokens=4, batch_size=2)
    assert target.encoder_calls - before == len(PROMPTS)


def test_beam_search_requests_run_one_after_another_with_the_same_outputs(targets):
    target = targets["llama"]
    alone = [minispec.generate(target, prompt, beams=3, max_new_tokens=6, ignore_eos=True).tokens
             for prompt in PROMPTS[:3]]
    out = minispec.generate(target, PROMPTS[:3], beams=3, max_new_tokens=6, ignore_eos=True)
    assert [o.tokens for o in out] == alone


def test_bad_input_in_a_batch_fails_before_any_work_naming_the_prompt(targets, monkeypatch):
    target = targets["gpt2"]  # a context of 128 positions
    calls = []
    monkeypatch.setattr(target, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="^prompt 1: the prompt is empty"):
        minispec.generate(target, [[5, 6], []])
    with pytest.raises(ValueError, match="^prompt 2: the prompt has 200 tokens, longer than"):
        minispec.generate(target, [[5, 6], [7], [1] * 200])
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        minispec.generate(target, [[5, 6], [7]], batch_size=0)
    # one row of its cache: 65,536 bytes; its caches hold one block of positions now, so they must grow
    monkeypatch.setattr(api, "available_memory", lambda device: 100_000)
    target.setup_caches(1, 1)
    with pytest.raises(ValueError, match=r"a batch of 2 requests needs .* at most 1 fit: pass batch_size="):
        minispec.generate(target, [[5, 6], [7]], max_new_tokens=100)
    assert calls == []
    assert (target.cache_batch_size, target.cache_max_seq_len) == (1, kernels.KEY_BLOCK)  # checked before allocating


def test_rows_at_their_own_positions_compute_as_they_would_alone(targets):
    """decode_rows: each cache row at its own length, one token each, bit for bit a 1-row decode."""
    target = targets["llama_gqa"]
    target.ensure_caches(len(PROMPTS), 64)
    with torch.inference_mode():
        alone = []
        for prompt in PROMPTS:
            target.prefill(torch.tensor([prompt]))
            alone.append(target.decode(torch.tensor([[7]]))[0, -1])
        for row, prompt in enumerate(PROMPTS):
            target.decode_rows(Feed(torch.tensor([prompt]), [0]), first_row=row, eager=True)
        together = target.decode_rows(Feed(torch.full((len(PROMPTS), 1), 7), [len(p) for p in PROMPTS]))[:, -1]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_at_the_end_of_the_context_limit_no_other_row(targets, drafts, temperature):
    """The longest request reaches the target's context (gpt2: 128 positions) exactly. Rows that skip
    guessing, rows whose guesses are cut at their own end and rows just admitted share forwards with
    rows guessing on; nothing overflows a cache and every row's guesses and random draws stay its own,
    so even sampled outputs equal each request's alone at a fixed γ."""
    target = targets["gpt2"]
    prompts = [[8, 1] * 50, [5, 6, 7, 8, 9, 5, 6, 7] * 4, [9, 4] * 30, [3, 3, 3, 7] * 2, [8, 1] * 49]
    for draft in (drafts["gpt2"], "lookup"):
        for gamma in (3, 8):
            settings = {"ignore_eos": True, "temperature": temperature, "seed": 9, "draft": draft, "gamma": gamma,
                        "max_new_tokens": 128 - len(prompts[0])}
            alone = [minispec.generate(target, prompt, **settings).tokens for prompt in prompts]
            for batch_size in (None, 2):
                together = minispec.generate(target, prompts, batch_size=batch_size, **settings)
                assert [out.tokens for out in together] == alone, (draft, gamma, batch_size)


@pytest.mark.parametrize("kind", ["llama", "t5_v1_1"])
def test_alternating_batches_and_lone_requests_reuse_the_caches(targets, drafts, kind):
    """A lone request is a batch of one: after a batch, neither it nor a smaller batch reallocates (and
    zeroes) the target's or the draft's caches, T5's cross-attention memory included."""
    target, draft = targets[kind], drafts[kind]
    settings = {"max_new_tokens": 8, "draft": draft, "gamma": 2, "ignore_eos": True}
    minispec.generate(target, PROMPTS[:3], **settings)
    before = [list(model.buffers()) for model in (target, draft)]
    minispec.generate(target, PROMPTS[0], **settings)
    minispec.generate(target, PROMPTS[1:3], **settings)
    after = [list(model.buffers()) for model in (target, draft)]
    assert all(a is b for was, now in zip(before, after) for a, b in zip(was, now, strict=True))


def test_batched_statistics_and_traces_are_each_requests_own(targets, drafts):
    target, draft = targets["t5_v1_1"], drafts["t5_v1_1"]
    settings = {"max_new_tokens": 12, "draft": draft, "gamma": 3, "ignore_eos": True, "temperature": 1.0, "seed": 2}
    alone = [minispec.generate(target, prompt, **settings) for prompt in COPYING[:3]]
    together = minispec.generate(target, COPYING[:3], batch_size=2, **settings)
    for one, row in zip(alone, together):
        assert row.trace == one.trace and any(kind == "rejected" for _, kind in row.trace)
        for key in ("target_calls", "draft_calls", "first_call_tokens", "accepted_lengths", "acceptance_rate",
                    "encoder_calls", "draft_encoder_calls", "accepted_at", "verified_at"):
            assert row.stats[key] == one.stats[key], key
        assert row.stats["alpha"] == pytest.approx(one.stats["alpha"], abs=1e-6) and 0 < row.stats["alpha"] < 1
        assert row.stats["encoder_calls"] == row.stats["draft_encoder_calls"] == 1


def test_steps_shared_by_a_batch_do_not_time_the_pair(targets, monkeypatch):
    """gamma="auto" learns a forward's cost from a lone request's steps; a batch's steps (other rows'
    prefills and guesses in them) would teach the next lone request wrong costs."""
    from minispec.decoding import policy

    def calibrate(profile, target, drafter, token, k_max, beams=None):
        profile.t_verify, profile.t_draft = [0.0] + [1.0 + 0.1 * w for w in range(k_max + 1)], 0.0

    monkeypatch.setattr(policy, "calibrate", calibrate)
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())
    target = targets["llama"]
    minispec.generate(target, COPYING, draft="lookup", max_new_tokens=12, ignore_eos=True)
    profile = policy.PROFILES[target]["lookup", None]
    assert profile.t_verify[1:] == pytest.approx([1.0 + 0.1 * w for w in range(policy.GAMMA_MAX + 1)])
    minispec.generate(target, COPYING[0], draft="lookup", max_new_tokens=12, ignore_eos=True)
    assert profile.t_verify[1] < 0.5  # a lone request's steps do (they take milliseconds, not a second)
