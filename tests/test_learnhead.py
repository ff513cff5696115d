"""A draft head that keeps learning while the server uses it (minispec/heads/learn.py): on a repetitive
workload its acceptance rises while every output stays plain greedy's, its weights change only between
the engine's steps, the saved head loads and drafts as it had learnt; off unless asked for; its buffer
within its budget."""

import threading
import time

import pytest
import torch
from test_heads import tiny_training_target

import minispec
from minispec import api
from minispec.decoding import engine
from minispec.heads import save_draft_head
from minispec.heads.learn import Learner
from minispec.serve import __main__ as serve_main
from minispec.serve.scheduler import Failed, Job, Scheduler
from minispec.tools import train_heads as train

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny target heads are trained on in seconds, four of its prompts (the repeated workload), and
    its folder."""
    directory = tmp_path_factory.mktemp("target")
    target, prompts, _, _ = tiny_training_target(directory)
    return target, prompts[:4], directory


def untrained_head(target, kind, directory):
    head, hf = train.new_head(kind, target, 3)
    save_draft_head(head, hf, directory)
    return directory


class Recorded(Job):
    """A job whose tokens are kept, and whose end is an event to wait for."""

    def __init__(self, request):
        super().__init__(request, self.receive)
        self.tokens, self.ended, self.outcome = [], threading.Event(), None

    def advance(self, tokens, logprobs, generation):
        self.tokens += tokens
        super().advance(tokens, logprobs, generation)

    def receive(self, event):
        if isinstance(event, Failed) or event.outcome is not None:  # its end
            self.outcome = event if isinstance(event, Failed) else event.outcome
            self.ended.set()


def serve(scheduler, target, draft, prompt, **settings):
    job = Recorded(api.Request.from_settings(target, prompt, api.Settings(
        draft=draft, gamma=3, max_new_tokens=NEW_TOKENS, tree="off", **settings)))
    scheduler.submit(job)
    assert job.ended.wait(60) and job.outcome.stats is not None, job.outcome
    return job


def acceptance(target, head, prompts):
    out = minispec.generate(target, prompts, draft=head, gamma=3, max_new_tokens=NEW_TOKENS, tree="off")
    return sum(o.stats["accepted"] for o in out) / sum(o.stats["verified"] for o in out)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_a_learning_head_drafts_better_as_it_serves_and_stays_exact(tiny, tmp_path, monkeypatch, kind):
    """24 requests over 4 prompts, each sent once the idle server has learnt from those before (so the
    run is the same every time): the acceptance of the last window of 4 requests is far above the
    first's (0.2 -> about 0.7 for EAGLE, 0.55 for Medusa), every output is plain greedy's, the head's
    weights change only between steps, and the head saved at the end loads and drafts as it had learnt."""
    target, prompts, _ = tiny
    learner = Learner(target, untrained_head(target, kind, tmp_path / "head"), tmp_path / "out", share=1.0,
                      passes=32, window=4)
    before = acceptance(target, learner.head, prompts)
    plain = {i: minispec.generate(target, p, max_new_tokens=NEW_TOKENS).tokens for i, p in enumerate(prompts)}
    inside, changes = [False], []
    real_step, real_learn = engine.step, learner.step

    def step(target, rows):
        inside[0] = True
        try:
            return real_step(target, rows)
        finally:
            inside[0] = False

    def learn():
        changes.append(inside[0])
        real_learn()
    monkeypatch.setattr(engine, "step", step)
    monkeypatch.setattr(learner, "step", learn)
    scheduler = Scheduler(target, learner.head, 3, 2, 128, 64, "off", 0, learner)
    scheduler.start()
    for r in range(24):
        job = serve(scheduler, target, learner.head, prompts[r % 4])
        assert job.tokens == plain[r % 4]
        deadline = time.monotonic() + 60
        while learner.credit > 0:  # the idle server learns from what it has served
            assert time.monotonic() < deadline
            time.sleep(0.01)
    rates = scheduler.load["learning"]["acceptance"]
    scheduler.stop(30)
    print(f"{kind}: acceptance per window of 4 requests {rates}")
    assert len(rates) == 6 and rates[-1] > rates[0] + 0.25 and changes and not any(changes)

    saved = minispec.load_draft_head(tmp_path / "out", target, quantize=None)
    assert not list((tmp_path / "out").glob("*.partial"))
    for mine, theirs in zip(saved.parameters(), learner.head.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    after = acceptance(target, saved, prompts)
    assert after == acceptance(target, learner.head, prompts) and after > before + 0.25, (before, after)


def test_a_learning_heads_server_reuses_stored_prefixes(tiny, tmp_path):
    """With the prefix cache on, a learning head's request over a stored prompt copies its blocks (the head
    reads the target's states stored beside them) and still answers as plain greedy."""
    target, prompts, _ = tiny
    learner = Learner(target, untrained_head(target, "eagle", tmp_path / "head"), tmp_path / "out", share=1.0)
    prompt = (prompts[0] + prompts[1]) * 4  # 40 tokens: two whole blocks before its last
    plain = minispec.generate(target, prompt, max_new_tokens=NEW_TOKENS).tokens
    scheduler = Scheduler(target, learner.head, 3, 2, 128, 64, "off", 64, learner)
    scheduler.start()
    jobs = [serve(scheduler, target, learner.head, prompt) for _ in range(3)]
    scheduler.stop(30)
    assert [job.tokens for job in jobs] == [plain] * 3
    assert [job.outcome.stats["cached_tokens"] for job in jobs] == [0, 32, 32] and learner.steps > 0


def test_a_head_served_without_a_learner_never_changes(tiny, tmp_path):
    """Off by default: a scheduler (or generate) drafting with a head leaves its weights as loaded, asks
    no states beyond the head's, and reports no learning."""
    target, prompts, _ = tiny
    head = minispec.load_draft_head(untrained_head(target, "eagle", tmp_path / "head"), target, quantize=None)
    weights = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    scheduler = Scheduler(target, head, 3, 2, 128, 64, "off", 0)
    scheduler.start()
    jobs = [serve(scheduler, target, head, prompt) for prompt in prompts * 2]
    assert "learning" not in scheduler.load and all(job.request.on_states is None for job in jobs)
    scheduler.stop(30)
    acceptance(target, head, prompts)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in head.state_dict().items())


def test_the_kept_states_stay_within_their_budget(tiny, tmp_path):
    """The kept sequences never take more than buffer_mb: the oldest go first, a request longer than
    the budget keeps its last tokens, one cancelled keeps what it had, and no state is kept twice."""
    target, _, _ = tiny
    per_token = 8 + 4 * target.hidden_size  # an int64 token and its float32 state
    learner = Learner(target, untrained_head(target, "eagle", tmp_path / "head"), tmp_path / "out",
                      buffer_mb=100 * per_token / 2**20)
    firsts = []
    for index, length in enumerate([30, 30, 30, 30, 250, 40]):
        for start in range(0, length, 10):  # a step's kept tokens at a time
            tokens = torch.arange(start, start + 10) + 1000 * index
            learner.record(index, tokens, torch.randn(10, target.hidden_size))
        learner.finish(index, None if index == 3 else {"accepted": 1, "verified": 2})
        assert learner.bytes <= learner.budget and not learner.pending
        assert learner.bytes == sum(len(tokens) for tokens, _ in learner.kept) * per_token
        firsts.append([int(tokens[0]) for tokens, _ in learner.kept])
    assert firsts == [[0], [0, 1000], [0, 1000, 2000], [1000, 2000, 3000], [4150], [5000]]


def test_only_heads_that_can_learn_are_taken(tiny, tmp_path):
    """An EAGLE-3 head (its states give no distribution of the target's to learn) is refused with one line,
    and so is a quantized target (the loss's labels are its float output head's); the server's flags:
    a --draft that is no head's folder, and --draft-quantize (the head drafts in float), before loading."""
    target, _, directory = tiny
    with pytest.raises(ValueError, match="eagle3 head does not learn while serving"):
        Learner(target, untrained_head(target, "eagle3", tmp_path / "eagle3"), tmp_path / "out")
    with pytest.raises(ValueError, match="load it without --quantize"):
        Learner(minispec.load(directory, quantize="int8"), tmp_path / "eagle3", tmp_path / "out")
    flags = ["--target", "t", "--learn-head", "o"]
    with pytest.raises(ValueError, match="--draft suffix is not a head's folder"):
        serve_main.check_flags(serve_main.parse_args(flags))
    with pytest.raises(ValueError, match="--learn-head drafts with the float head it trains"):
        serve_main.check_flags(serve_main.parse_args([*flags, "--draft", str(tmp_path / "eagle3"), "--draft-quantize",
                                                      "int8"]))
