"""n answers of one prompt (Settings.n): rows of one batch, each with its own seed, the prompt's forward
shared; each answer is what its seed gives alone."""

import json
import sys
from pathlib import Path

import pytest

import minispec
from conftest import target_and_drafts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]
SAMPLED = {"temperature": 1.5, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return target_and_drafts("llama_gqa", tmp_path_factory)


def prompt_forwards(target, monkeypatch):
    """The target forwards that feed a prompt's first tokens (widths of at least len(PROMPT) - 1), counted."""
    forwards, decode_rows = [], target.decode_rows

    def counting(feed, *args, **kwargs):
        forwards.extend(width for width in [feed.tokens.shape[1]] if width >= len(PROMPT) - 1)
        return decode_rows(feed, *args, **kwargs)

    monkeypatch.setattr(target, "decode_rows", counting)
    return forwards


@pytest.mark.parametrize("draft", [None, "noisy", "lookup"])
def test_n_answers_are_each_what_their_seed_gives_alone_and_share_the_prompts_forward(llama, draft, monkeypatch):
    target = llama["target"]
    draft = llama.get(draft, draft)
    forwards = prompt_forwards(target, monkeypatch)
    answers = minispec.generate(target, PROMPT, n=3, seed=4, draft=draft, gamma=2, **SAMPLED)
    assert len(forwards) == 1  # one prefill for the three rows
    assert len(answers) == 3 and answers[0].stats["seed"] == 4
    assert len({answer.stats["seed"] for answer in answers}) == 3
    assert len({tuple(answer.tokens) for answer in answers}) > 1
    assert [answer.stats.get("shared_tokens") for answer in answers] == [None] + [len(PROMPT) - 1] * 2
    for answer in answers:
        alone = minispec.generate(target, PROMPT, seed=answer.stats["seed"], draft=draft, gamma=2, **SAMPLED)
        assert answer.tokens == alone.tokens
    # the same seed, answered again: the same answers (the seeds of answers 1.. come from the first's)
    assert [a.tokens for a in minispec.generate(target, PROMPT, n=3, seed=4, **SAMPLED)] == [a.tokens for a in answers]


def test_greedy_answers_are_all_the_same_and_batches_nest_their_answers(llama):
    target = llama["target"]
    greedy = minispec.generate(target, PROMPT, n=3, max_new_tokens=10)
    assert len(greedy) == 3 and greedy[0].tokens == greedy[1].tokens == greedy[2].tokens
    prompts = [PROMPT, [1, 2, 3, 4]]
    batch = minispec.generate(target, prompts, n=2, seed=[7, 9], batch_size=3, **SAMPLED)
    assert [len(answers) for answers in batch] == [2, 2]
    for prompt, answers in zip(prompts, batch):
        for answer in answers:
            assert answer.tokens == minispec.generate(target, prompt, seed=answer.stats["seed"], **SAMPLED).tokens


@pytest.mark.parametrize("settings, message", [
    ({"n": 0}, "n (answers of each prompt) must be an integer in [1, 32]"),
    ({"n": 33}, "must be an integer in [1, 32]"),
    ({"n": 2, "beams": 2}, "n needs decoding without beams"),
])
def test_bad_n_is_named(llama, settings, message):
    with pytest.raises(minispec.SettingError, match=message.replace("[", r"\[").replace("(", r"\(")
                       .replace(")", r"\)")) as error:
        minispec.generate(llama["target"], PROMPT, **settings)
    assert error.value.field == "n"


def test_stream_refuses_n(llama):
    with pytest.raises(minispec.SettingError, match="stream.. streams one answer"):
        minispec.stream(llama["target"], PROMPT, n=2)


def test_run_json_prints_n_answers(tmp_path, capsys):
    from conftest import make_reference, save_reference

    directory = str(save_reference(make_reference("gpt2"), tmp_path / "gpt2"))
    assert run.main(["--target", directory, "--prompt-ids", "5,17,33", "--n", "3", "--temperature", "1.5",
                     "--seed", "3", "--max-new-tokens", "8", "--ignore-eos", "--device", "cpu", "--json"]) == 0
    answers = json.loads(capsys.readouterr().out)
    target = minispec.load(directory)
    assert len(answers) == 3 and answers[0]["stats"]["seed"] == 3
    for answer in answers:
        alone = minispec.generate(target, [5, 17, 33], temperature=1.5, seed=answer["stats"]["seed"], max_new_tokens=8,
                                  ignore_eos=True)
        assert answer["tokens"] == alone.tokens
