"""minispec.generate's contract around the decoding loops: what it refuses before any work, the seed,
statistics at a stop token, and one request per model at a time."""

import threading

import pytest
import torch
import transformers
from conftest import make_reference, save_reference

import minispec

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return save_reference(make_reference("llama"), tmp_path_factory.mktemp("generate_llama"))


@pytest.fixture(scope="module")
def target(llama_dir):
    return minispec.load(llama_dir)


@pytest.fixture(scope="module")
def same(llama_dir):
    return minispec.load(llama_dir)


class CountingForward:
    """Wraps a model's forward and counts its calls."""

    def __init__(self, model, monkeypatch):
        self.calls, self.forward = 0, model.forward
        monkeypatch.setattr(model, "forward", self)

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.forward(*args, **kwargs)


def test_a_path_as_draft_is_refused_with_what_to_do(target, llama_dir):
    with pytest.raises(ValueError, match=r"minispec\.load"):
        minispec.generate(target, PROMPT, draft=str(llama_dir))


def test_a_draft_on_another_device_fails_before_any_work(target, llama_dir, monkeypatch):
    draft = minispec.load(llama_dir).to("meta")  # a device other than the target's, on any machine
    forwards = CountingForward(target, monkeypatch)
    with pytest.raises(ValueError, match="the draft .* is on meta but the target .* is on cpu"):
        minispec.generate(target, PROMPT, draft=draft)
    assert forwards.calls == 0


def test_a_draft_with_a_shorter_context_fails_before_any_work(target, tmp_path, monkeypatch):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, max_position_embeddings=32)
    short = minispec.load(save_reference(transformers.LlamaForCausalLM(config).eval(), tmp_path))
    forwards = CountingForward(target, monkeypatch)
    with pytest.raises(ValueError, match="exceeds the draft .* context of 32 tokens"):
        minispec.generate(target, PROMPT, draft=short, max_new_tokens=40)
    assert forwards.calls == 0
    assert len(minispec.generate(target, PROMPT, draft=short, max_new_tokens=20).tokens) == 20  # 12 + 20 fits


def test_without_a_seed_each_call_samples_afresh_and_stats_give_the_seed(target):
    first, second = (minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=40, ignore_eos=True)
                     for _ in range(2))
    assert first.tokens != second.tokens  # 40 tokens from a 96-token vocabulary: equal by chance ~never
    again = minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=40, ignore_eos=True,
                              seed=first.stats["seed"])
    assert again.tokens == first.tokens
    assert minispec.generate(target, PROMPT, temperature=1.0, max_new_tokens=8, seed=3).stats["seed"] == 3


@pytest.mark.parametrize("gamma", [3, 5])
def test_statistics_count_only_the_guesses_emitted_before_a_stop_token(target, same, gamma):
    """The draft has the target's weights, so every guess is accepted; a stop token placed among the
    guesses of a block ends the output there, and the guesses after it are not counted."""
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    stop = plain.tokens[gamma + 2]  # the second guess of the second block
    first_stop = plain.tokens.index(stop)
    assert first_stop % (gamma + 1) < gamma - 1  # a guess with accepted guesses after it in its block
    original_eos = target.eos_token_ids
    target.eos_token_ids = (stop,)
    try:
        out = minispec.generate(target, PROMPT, draft=same, gamma=gamma, max_new_tokens=30)
    finally:
        target.eos_token_ids = original_eos
    assert out.tokens == plain.tokens[: first_stop + 1]
    emitted_guesses = sum(len(ids) for ids, kind in out.trace if kind == "accepted")
    stats = out.stats
    assert stats["accepted"] == emitted_guesses
    assert sum(n * count for n, count in enumerate(stats["accepted_lengths"])) == emitted_guesses
    assert stats["verified"] == emitted_guesses  # all were accepted: no rejected position was tested
    assert stats["acceptance_rate"] == 1.0


def test_a_model_in_use_by_another_thread_is_refused(target, monkeypatch):
    """Two requests at once on one model would interleave writes to its one KV cache."""
    inside, release = threading.Event(), threading.Event()
    forward = target.forward

    def blocking_forward(*args, **kwargs):
        inside.set()
        release.wait(timeout=30)
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", blocking_forward)
    results = []
    worker = threading.Thread(target=lambda: results.append(minispec.generate(target, PROMPT, max_new_tokens=4)))
    worker.start()
    try:
        assert inside.wait(timeout=30)
        with pytest.raises(RuntimeError, match="already generating"):
            minispec.generate(target, PROMPT, max_new_tokens=4)
    finally:
        release.set()
        worker.join(timeout=60)
    monkeypatch.setattr(target, "forward", forward)
    assert len(results) == 1 and len(results[0].tokens) == 4
    assert minispec.generate(target, PROMPT, max_new_tokens=4).tokens == results[0].tokens  # free again


def test_a_failed_request_frees_its_models(target, same, monkeypatch):
    def failing_forward(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("planted")

    with monkeypatch.context() as patch:
        patch.setattr(target, "forward", failing_forward)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            minispec.generate(target, PROMPT, draft=same)
    assert not target.busy and not same.busy
    assert len(minispec.generate(target, PROMPT, draft=same, max_new_tokens=4).tokens) == 4
