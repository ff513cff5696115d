"""Beam search: target-only beam search equals the reference implementation's, and speculative beam
search (paper A.4) equals target-only beam search for every family, width, draft width, gamma and draft,
with and without EOS; the saving in target calls; the trie layout; the command line; bad input."""

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_reference, target_and_drafts

import minispec
from minispec.decoding import beam, policy
from minispec.decoding.beam import speculative_beam_search, trie_rows
from minispec.decoding.drafters import ModelDrafter
from minispec.decoding.policy import BEAM_GAMMA_MAX, FixedGamma

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import run  # noqa: E402

TARGETS = ["gpt2", "llama", "t5_v1_1"]
DRAFTS = ["same", "noisy", "independent"]
PROMPT = [3, 17, 42, 8, 61, 25, 9, 77, 4, 30]  # beam outputs vary for every family
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: target_and_drafts(kind, tmp_path_factory) for kind in TARGETS}


def beam_search(target, w, eos=None, max_new_tokens=NEW_TOKENS, **kwargs):
    """minispec beam search with EOS ids `eos` (None: EOS disabled)."""
    saved = target.eos_token_ids
    target.eos_token_ids = tuple(eos or ())
    try:
        return minispec.generate(target, PROMPT, beams=w, max_new_tokens=max_new_tokens, ignore_eos=eos is None,
                                 **kwargs)
    finally:
        target.eos_token_ids = saved


def reference_beam_search(reference, w, eos=None):
    """The reference's w hypotheses (generated ids, each padded as the reference pads) and scores."""
    out = reference.generate(torch.tensor([PROMPT]), num_beams=w, num_return_sequences=w, do_sample=False,
                             early_stopping=True, length_penalty=1.0, max_new_tokens=NEW_TOKENS,
                             eos_token_id=eos, pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    start = 1 if reference.config.is_encoder_decoder else len(PROMPT)  # T5: drop the decoder start token
    return out.sequences[:, start:].tolist(), out.sequences_scores.tolist()


def eos_ids(target, w):
    """Two tokens that some hypotheses reach mid-way, so EOS changes the search."""
    sequences = beam_search(target, w).sequences
    return [sequences[0][5], sequences[-1][3]]


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("w", [2, 4])
def test_beam_search_equals_reference(models, kind, w):
    target, reference = models[kind]["target"], models[kind]["reference"]
    out = beam_search(target, w)
    sequences, scores = reference_beam_search(reference, w)
    assert out.sequences == sequences and out.tokens == sequences[0]
    assert len(set(out.tokens)) >= 3 and len(set(map(tuple, sequences))) == w
    torch.testing.assert_close(torch.tensor(out.scores), torch.tensor(scores), atol=1e-5, rtol=0)
    assert out.stats["beam_steps"] == out.stats["target_calls"] == NEW_TOKENS


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("w", [2, 4])
def test_beam_search_with_eos_equals_reference(models, kind, w):
    target, reference = models[kind]["target"], models[kind]["reference"]
    eos = eos_ids(target, w)
    out = beam_search(target, w, eos)
    sequences, scores = reference_beam_search(reference, w, eos)
    assert any(len(s) < NEW_TOKENS for s in out.sequences)  # EOS finished some hypotheses early
    assert all(s[-1] in eos or len(s) == NEW_TOKENS for s in out.sequences)
    # The reference pads shorter hypotheses with the first EOS id (its pad_token_id 0 is falsy).
    padded = [s + [eos[0]] * (len(sequences[0]) - len(s)) for s in out.sequences]
    assert padded == sequences
    torch.testing.assert_close(torch.tensor(out.scores), torch.tensor(scores), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", TARGETS)
@pytest.mark.parametrize("w", [2, 4])
def test_speculative_beam_search_equals_beam_search(models, kind, w):
    target = models[kind]["target"]
    for eos in (None, eos_ids(target, w)):
        baseline = beam_search(target, w, eos)
        for name, u, gamma in itertools.product(DRAFTS, [w, 2 * w], [1, 3, 5, "auto"]):
            out = beam_search(target, w, eos, draft=models[kind][name], draft_beams=u, gamma=gamma)
            where = f"{kind} w={w} u={u} gamma={gamma} {name} draft, eos={eos}"
            assert out.sequences == baseline.sequences and out.tokens == baseline.tokens, where
            torch.testing.assert_close(torch.tensor(out.scores), torch.tensor(baseline.scores), atol=1e-5, rtol=0)
            stats = out.stats
            assert stats["beam_steps"] == baseline.stats["beam_steps"], where
            # Every target call advances at least one step, and at most 1 + the accepted guessed steps.
            assert stats["beam_steps"] == stats["target_calls"] + stats["accepted"], where
            if name == "same" and u == w and stats["verified"]:  # the draft's beam search is the target's
                assert stats["acceptance_rate"] == 1.0, where


def test_noisy_draft_saves_target_calls(models):
    """The saving over plain beam search: w=4, u=8, gamma=3, 32 new tokens."""
    report = []
    for kind in TARGETS:
        target = models[kind]["target"]
        plain = beam_search(target, 4, max_new_tokens=32)
        spec = beam_search(target, 4, max_new_tokens=32, draft=models[kind]["noisy"], draft_beams=8, gamma=3)
        assert spec.sequences == plain.sequences
        report.append(f"{kind}: target_calls {plain.stats['target_calls']} plain vs {spec.stats['target_calls']} "
                      f"speculative ({spec.stats['beam_steps']} beam steps)")
        assert spec.stats["target_calls"] < 0.75 * plain.stats["target_calls"], report[-1]
    print("\n" + "\n".join(report))


@pytest.mark.parametrize("kind", ["gpt2", "t5_v1_1"])
def test_auto_gamma_drafts_long_when_the_draft_agrees_and_not_at_all_when_it_does_not(models, kind, known_costs):
    """gamma="auto" per iteration: with costs that make speculation pay (known_costs), the target's own
    weights as draft (every step accepted) get the longest drafts, an independent model plain beam steps;
    the result is plain beam search's either way."""
    target = models[kind]["target"]
    plain = beam_search(target, 4, max_new_tokens=24)
    same = beam_search(target, 4, max_new_tokens=24, draft=models[kind]["same"], gamma="auto")
    other = beam_search(target, 4, max_new_tokens=24, draft=models[kind]["independent"], gamma="auto")
    assert same.sequences == plain.sequences == other.sequences
    histogram = same.stats["guesses_histogram"]
    assert histogram[BEAM_GAMMA_MAX] >= 0.8 * sum(histogram) and same.stats["target_calls"] <= 24 // 4
    histogram = other.stats["guesses_histogram"]
    assert other.stats["acceptance_rate"] < 0.1 and histogram[0] > sum(histogram[1:])


class PlainFirst(FixedGamma):
    """`plain` plain beam steps, then γ guessed ones."""

    def __init__(self, plain, gamma):
        super().__init__(gamma)
        self.plain = plain

    def guesses(self):
        self.plain -= 1
        return 0 if self.plain >= 0 else self.k_max


@pytest.mark.parametrize("kind", ["llama", "t5_v1_1"])
def test_the_draft_and_the_rows_for_guesses_wait_for_the_first_guesses(models, kind):
    """Speculative beam search runs the draft, and allocates a row for every leaf, only once the policy
    first guesses ("auto" on a CPU may never): caches too small for the guesses grow mid-request and are
    refilled, with plain beam search's result; a request that never guesses never runs the draft."""
    target, draft = models[kind]["target"], models[kind]["noisy"]
    plain = beam_search(target, 4)
    prompt = torch.tensor([PROMPT])
    for plain_steps, gamma in ((NEW_TOKENS, 2), (3, 2)):
        target.setup_caches(4, 64)
        draft.setup_caches(1, 64)
        encoded = draft.encoder_calls
        finished, stats = speculative_beam_search(target, ModelDrafter(draft), target.encode(prompt), prompt, 4, 8,
                                                  PlainFirst(plain_steps, gamma), NEW_TOKENS, ())
        assert [sequence for _, sequence in finished] == plain.sequences
        if plain_steps == NEW_TOKENS:  # never guessed
            assert stats["draft_calls"] == 0 and draft.encoder_calls == encoded and draft.cache_batch_size == 1
            assert target.cache_batch_size == 4 and stats["target_calls"] == plain.stats["target_calls"]
        else:
            assert stats["draft_calls"] > 0 and target.cache_batch_size >= 4 + 8 * gamma
            assert stats["target_calls"] < plain.stats["target_calls"]


@pytest.mark.parametrize("kind", ["llama", "t5_v1_1"])
def test_a_draft_whose_time_cannot_be_read_is_timed_first(models, kind, monkeypatch):
    """On a GPU (pretended here) reading a draft's time would be a host sync, so "auto" times a draft
    step before the request, for a lone request and for beam search alike, from an empty cache row
    (whatever the draft's length pointer says); the results stay the target's."""
    for module in (policy, beam):
        monkeypatch.setattr(module, "reads_on_host", lambda drafter: False)
    monkeypatch.setattr(policy, "PROFILES", policy.weakref.WeakKeyDictionary())
    target, draft = models[kind]["target"], models[kind]["noisy"]
    greedy = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    draft.ensure_caches(1, 64)
    draft.length = draft.cache_max_seq_len  # left at the end by an earlier call
    out = minispec.generate(target, PROMPT, draft=draft, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert out.tokens == greedy.tokens and policy.PROFILES[target][id(draft), None].t_draft > 0
    plain = beam_search(target, 4)
    spec = beam_search(target, 4, draft=draft, draft_beams=8, gamma="auto")
    assert spec.sequences == plain.sequences and policy.PROFILES[target][id(draft), (4, 8)].t_draft > 0


def test_width_one_is_greedy(models):
    target = models["llama"]["target"]
    greedy = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    out = beam_search(target, 1, draft=models["llama"]["noisy"], draft_beams=3, gamma=4)
    assert out.sequences == [greedy.tokens]


def test_caches_hold_the_beams_and_t5_encodes_once(models):
    target, draft = models["t5_v1_1"]["target"], models["t5_v1_1"]["noisy"]
    beam_search(target, 4)
    assert target.cache_batch_size >= 4  # beams live in the batch dimension (caches never shrink)
    out = beam_search(target, 4, draft=draft, draft_beams=8, gamma=3)
    assert target.cache_batch_size >= 4 + 8 * 3 and draft.cache_batch_size >= 8
    assert out.stats["encoder_calls"] == 1 and out.stats["draft_encoder_calls"] == 1


def test_trie_rows_share_prefixes_and_keep_dropped_hypotheses():
    roots = torch.tensor([[1], [2]])  # the target's beams
    kept = [torch.tensor([[1, 5], [1, 6]]),  # draft step 1 keeps two children of [1]; drops [2]
            torch.tensor([[1, 5, 7], [1, 5, 8]])]  # step 2 extends [1, 5] only; drops [1, 6]
    rows, where = trie_rows(roots, kept, batch_size=6)
    assert rows.tolist() == [[1, 5, 7], [1, 5, 8], [1, 6, 0], [2, 0, 0], [1, 5, 7], [1, 5, 7]]
    assert [w.tolist() for w in where] == [[0, 3], [0, 2], [0, 1]]


def test_command_line(models, tmp_path, capsys):
    target_dir = save_reference(models["gpt2"]["reference"], tmp_path / "target")
    common = ["--target", str(target_dir), "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "12",
              "--ignore-eos", "--device", "cpu", "--json", "--beams", "2"]
    plain = run.main(common)
    plain = json.loads(capsys.readouterr().out)
    assert run.main([*common, "--draft", str(target_dir), "--draft-beams", "4", "--gamma", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    expected = minispec.generate(models["gpt2"]["target"], PROMPT, beams=2, max_new_tokens=12, ignore_eos=True)
    assert plain["sequences"] == spec["sequences"] == expected.sequences
    assert spec["tokens"] == expected.tokens and len(spec["scores"]) == 2
    assert spec["stats"]["beam_steps"] == plain["stats"]["beam_steps"] == 12
    assert spec["stats"]["target_calls"] < plain["stats"]["target_calls"] == 12
    assert run.main([*common, "--draft-beams", "1"]) == 2
    assert "draft_beams" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs, message", [
    ({"beams": 0}, "beams"), ({"beams": -2}, "beams"), ({"beams": 2.5}, "beams"),
    ({"beams": 4, "draft": "noisy", "draft_beams": 3}, "draft_beams"),
    ({"beams": 2, "draft_beams": 4}, "needs a draft model"),
    ({"beams": 2, "temperature": 1.0}, "sampling"), ({"beams": 2, "top_k": 5}, "sampling"),
    ({"beams": 2, "top_p": 0.9}, "sampling"), ({"beams": 2, "draft": "noisy", "lenience": 0.5}, "lenience"),
    ({"beams": 2, "draft": "ngram"}, "draft model"), ({"beams": 2, "draft": "lookup"}, "draft model"),
    ({"beams": 2, "draft": "target"}, "separate model object"),
])
def test_bad_beam_settings_are_named(models, kwargs, message):
    if kwargs.get("draft") in ("noisy", "target"):
        kwargs = {**kwargs, "draft": models["gpt2"][kwargs["draft"]]}
    with pytest.raises(ValueError, match=message):
        minispec.generate(models["gpt2"]["target"], PROMPT, **kwargs)
