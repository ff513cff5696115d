"""Presence, frequency and repetition penalties and min_p (issue 64 item 3): plain decoding as defined by
hand and by transformers, speculative decoding exact with them (greedy: token for token; sampled: the
penalized target's joint distribution), for chains and trees, and their settings checked by name."""

from collections import Counter

import pytest
import torch
from conftest import target_and_drafts
from test_serve import CHAT, alone, checkpoints, client, expected  # noqa: F401 (fixtures)
from test_speculative import HostSyncs, assert_sampled_from, vocab16  # noqa: F401 (a fixture)

import minispec
from minispec.decoding.sampling import Sampling, adjust

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 5, 17, 33, 8]
NEW_TOKENS = 40
# Large enough to change these tiny models' greedy continuations (their logits are ~10 apart).
PENALTIES = {"presence": {"presence_penalty": 1.5}, "frequency": {"frequency_penalty": 0.9},
             "repetition": {"repetition_penalty": 1.8},
             "all": {"presence_penalty": -0.5, "frequency_penalty": 1.2, "repetition_penalty": 1.3}}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_drafts("llama_gqa", tmp_path_factory)


def by_hand(logits, settings, prompt, output):
    """The penalized logits of the definitions (OpenAI's presence and frequency over the output;
    transformers' repetition over prompt and output), written independently of minispec's."""
    logits = logits.double().clone()
    r = settings.get("repetition_penalty", 1.0)
    for token in set(prompt) | set(output):
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token, count in Counter(output).items():
        logits[token] -= settings.get("frequency_penalty", 0.0) * count + settings.get("presence_penalty", 0.0)
    return logits


@pytest.mark.parametrize("name", PENALTIES)
def test_plain_greedy_is_the_penalized_argmax_of_the_reference(models, name):
    settings, reference = PENALTIES[name], models["reference"]
    out = minispec.generate(models["target"], PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings)
    assert out.tokens != minispec.generate(models["target"], PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens
    tokens = []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = reference(torch.tensor([PROMPT + tokens])).logits[0, -1]
            tokens.append(int(by_hand(logits, settings, PROMPT, tokens).argmax()))
    assert out.tokens == tokens


def test_repetition_penalty_is_transformers_generate(models):
    out = minispec.generate(models["target"], PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True,
                            repetition_penalty=1.8)
    hf = models["reference"].generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                      do_sample=False, repetition_penalty=1.8, pad_token_id=0)
    assert out.tokens == hf[0, len(PROMPT):].tolist()


@pytest.mark.parametrize("name", PENALTIES)
def test_greedy_speculative_equals_plain_greedy_with_penalties(models, name):
    settings, target = PENALTIES[name], models["target"]
    baseline = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings)
    for draft, tree in (("lookup", "off"), ("noisy", "off"), ("lookup", 8), ("noisy", 8), ("noisy", "auto")):
        out = minispec.generate(target, PROMPT, draft=models.get(draft, draft), gamma="auto" if tree == "auto" else 3,
                                tree=tree, max_new_tokens=NEW_TOKENS, ignore_eos=True, **settings)
        assert out.tokens == baseline.tokens, f"{draft}, tree={tree}"
        if draft == "noisy" and tree != "auto":  # guesses were verified under the penalties, not given up
            assert out.stats["accepted"] > 0  # (lookup's repeats are penalized; "auto" may not guess at all)
            assert (out.stats.get("tree_nodes", 0) > 0) == (tree == 8)


def test_a_model_draft_is_penalized_alike(models):
    """The draft's q gets the target's penalties, with the step's guesses before each: a draft with the
    target's own weights then has q = p at every guess, all accepted."""
    out = minispec.generate(models["target"], PROMPT, draft=models["same"], gamma=3, max_new_tokens=NEW_TOKENS,
                            ignore_eos=True, temperature=1.0, seed=0, **PENALTIES["all"])
    assert out.stats["accepted"] == out.stats["verified"] > NEW_TOKENS // 2
    assert out.stats["alpha"] == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("draft, settings", [("noisy", {"temperature": 0.8, **PENALTIES["all"]}),
                                             ("lookup", {"tree": 8, **PENALTIES["all"]})])
def test_one_host_sync_per_step_with_penalties(models, draft, settings):
    """Penalties keep test_speculative's lean loop: one read of the device per step, a few per request."""
    counts = []
    for new_tokens in (8, NEW_TOKENS):
        with HostSyncs() as syncs:
            out = minispec.generate(models["target"], PROMPT, draft=models.get(draft, draft), gamma=3,
                                    max_new_tokens=new_tokens, ignore_eos=True, min_p=0.05, **settings)
        counts.append((out.stats["target_calls"], syncs.tolist, syncs.value_reads))
    (short_steps, short_tolist, short_reads), (long_steps, long_tolist, long_reads) = counts
    assert long_steps >= 10 and long_steps > short_steps
    assert long_tolist - short_tolist == long_steps - short_steps
    assert short_reads <= 3 and long_reads <= 3


def test_greedy_logprobs_are_the_penalized_ones(models):
    target, settings = models["target"], PENALTIES["all"]
    plain = minispec.generate(target, PROMPT, max_new_tokens=8, ignore_eos=True, logprobs=2, **settings)
    spec = minispec.generate(target, PROMPT, draft="lookup", gamma=3, max_new_tokens=8, ignore_eos=True, logprobs=2,
                             **settings)
    with torch.no_grad():
        logits = models["reference"](torch.tensor([PROMPT + plain.tokens[:5]])).logits[0, -1]
    want = by_hand(logits, settings, PROMPT, plain.tokens[:5]).log_softmax(-1)[plain.tokens[5]].item()
    assert plain.logprobs[5].logprob == pytest.approx(want, abs=1e-4)
    assert [x.logprob for x in spec.logprobs] == pytest.approx([x.logprob for x in plain.logprobs], abs=1e-5)


def test_min_p_masks_tokens_below_its_share_of_the_top():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs = logits.softmax(-1)[0]
    kept = adjust(logits, Sampling(temperature=1.0, min_p=0.3))[0] > 0
    assert kept.tolist() == (probs >= 0.3 * probs[0]).tolist() == [True, True, False, False]
    assert (adjust(logits, Sampling(temperature=1.0, min_p=1.0))[0] > 0).tolist() == [True, False, False, False]
    p = adjust(logits, Sampling(temperature=1.0, min_p=0.3))[0]
    assert p[:2].tolist() == pytest.approx((probs[:2] / probs[:2].sum()).tolist())


def penalized_joint(target, prompt, settings, length):
    """{(t_1, ..., t_length): probability} of plain sampling with penalties, by hand: each factor the
    adjusted distribution of a teacher-forced forward's logits penalized by the tokens before it."""
    sampling = Sampling(**{k: v for k, v in settings.items() if k not in ("presence_penalty", "frequency_penalty",
                                                                          "repetition_penalty")})
    joint = {(): 1.0}
    with torch.inference_mode():
        target.ensure_caches(1, len(prompt) + length)
        for _ in range(length):
            longer = {}
            for tokens, probability in joint.items():
                logits = target.prefill(torch.tensor([prompt + list(tokens)]))[0, -1]
                p = adjust(by_hand(logits, settings, prompt, list(tokens)).float(), sampling).double()
                for t in p.nonzero().view(-1).tolist():
                    longer[tokens + (t,)] = probability * p[t].item()
            joint = longer
    return joint


# id: (draft, settings, draws). The penalties are large for a 16-token vocabulary (logits ~1 apart), so
# that the joint differs clearly from the unpenalized one; min_p with top-k keeps a few cells each.
SAMPLED = {
    "model chain": ("noisy", {"temperature": 1.0, "top_k": 3, "presence_penalty": 1.0, "frequency_penalty": 0.5,
                              "repetition_penalty": 1.5}, {}, 4000),
    "lookup tree": ("lookup", {"temperature": 1.0, "top_k": 3, "min_p": 0.2, "frequency_penalty": 1.0,
                               "repetition_penalty": 1.5}, {"tree": 8}, 3000),
}


@pytest.mark.parametrize("case", SAMPLED)
def test_sampled_speculative_output_is_the_penalized_targets(vocab16, case):  # noqa: F811
    """χ² (p > 0.001, assert_sampled_from) of the first three tokens of many seeded requests against the
    penalized target's exact joint, which must differ from the unpenalized one."""
    draft, settings, options, draws = SAMPLED[case]
    target, draft = vocab16["target"], vocab16.get(draft, draft)
    prompt = [6, 8, 15, 6, 8, 12, 6, 8]
    joint = penalized_joint(target, prompt, settings, 3)
    plain = penalized_joint(target, prompt, {"temperature": 1.0, "top_k": 3}, 3)
    assert sum(abs(joint.get(c, 0) - plain.get(c, 0)) for c in set(joint) | set(plain)) > 0.3
    counts, accepted = Counter(), 0
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=2, max_new_tokens=3, seed=seed, ignore_eos=True,
                                **settings, **options)
        counts[tuple(out.tokens)] += 1
        accepted += out.stats["accepted"]
    assert accepted > draws // 4
    assert_sampled_from(counts, joint, draws)


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "in [-2, 2]"), ("frequency_penalty", float("nan"), "in [-2, 2]"),
    ("repetition_penalty", 0, "in [0.01, 100]"), ("repetition_penalty", "2", "in [0.01, 100]"),
    ("repetition_penalty", 2**64, "in [0.01, 100]"), ("repetition_penalty", 5e-324, "in [0.01, 100]"),
    ("min_p", 1.5, "in [0, 1]"),
])
def test_bad_values_are_named(models, field, value, message):
    with pytest.raises(minispec.SettingError) as error:
        minispec.generate(models["target"], PROMPT, max_new_tokens=2, **{field: value})
    assert error.value.field == field and message in str(error.value)


def test_penalties_with_beams_are_refused(models):
    with pytest.raises(minispec.SettingError, match="repetition_penalty"):
        minispec.generate(models["target"], PROMPT, max_new_tokens=2, beams=2, repetition_penalty=1.2)


def test_the_server_takes_the_fields(client, alone):  # noqa: F811
    fields = {"presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 3.0, "min_p": 0.1}
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 24, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.json()
    text = expected(alone, CHAT, max_new_tokens=24, **fields).text
    assert reply.json()["choices"][0]["message"]["content"] == text
    assert text != expected(alone, CHAT, max_new_tokens=24).text
