"""Several drafters in one tree (decoding/mixed.py): a model's or a head's guesses and a cheap drafter's
(lookup, suffix) verified together. Greedy output is plain greedy's, sampled output the target's
distribution (the mixed candidate rule, tree.sample_walk past q's rows, and whole requests), and the
draft model's cache follows the accepted text whichever drafter's guesses were accepted."""

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare
from starlette.testclient import TestClient

import minispec
from conftest import target_and_drafts
from minispec.decoding import drafters, mixed, policy, profiles, speculative, suffix, tree
from minispec.loaders import load_draft
from minispec.serve.app import build_app
from minispec.serve.scheduler import Scheduler
from test_heads import gqa_heads  # noqa: F401 (a fixture)
from test_serve import alone, checkpoints, in_threads, post  # noqa: F401 (fixtures)
from test_speculative import assert_sampled_from, exact_joint, vocab16  # noqa: F401 (a fixture)

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54] * 2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return target_and_drafts("llama_gqa", tmp_path_factory)


def test_a_fixed_candidate_after_a_nodes_draws_keeps_the_targets_distribution():
    """At the root: a draw from q, then a fixed token (where the draw is not it), as mixed.py merges them;
    the token that comes out is p's (chi-square at p > 0.001)."""
    generator = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).repeat(3, 1)  # the root's, then each node's (leaves here)
    q = torch.tensor([[0.6, 0.3, 0.05, 0.05]])
    fixed_token, draws, counts = 2, 20000, Counter()
    for _ in range(draws):
        drawn = int(torch.multinomial(q[0], 1, generator=generator))
        nodes = [drawn] + ([fixed_token] if drawn != fixed_token else [])
        verdict = tree.sample_walk(nodes, [-1] * len(nodes), p, generator, q)  # q: the root's row; node 1 lies past it
        counts[nodes[verdict.path[0]] if verdict.path else verdict.t] += 1
    observed = [counts[t] for t in range(4)]
    assert chisquare(observed, (p[0] * draws).tolist()).pvalue > 0.001, observed


@pytest.mark.parametrize("cheap", ["lookup", "suffix"])
def test_greedy_output_equals_target_greedy(models, cheap):
    """A draft model with each cheap drafter, chains and trees, alone and in a batch (rows of other lengths)."""
    target, draft = models["target"], models["noisy"]
    suffix.STORES.pop(target, None)
    prompts = [PROMPT, PROMPT[:7], PROMPT[3:]]
    baseline = [minispec.generate(target, prompt, max_new_tokens=30, ignore_eos=True).tokens for prompt in prompts]
    for gamma, tree_setting in [(3, "off"), (3, 6), ("auto", "auto")]:
        settings = {"gamma": gamma, "tree": tree_setting, "max_new_tokens": 30, "ignore_eos": True}
        out = minispec.generate(target, PROMPT, draft=[draft, cheap], **settings)
        assert out.tokens == baseline[0], (gamma, tree_setting)
        outs = minispec.generate(target, prompts, draft=[cheap, draft], batch_size=2, **settings)
        assert [out.tokens for out in outs] == baseline, (gamma, tree_setting)


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_with_a_head_and_suffix_is_plain_greedy(gqa_heads, kind):  # noqa: F811 (the fixture)
    target, heads = gqa_heads[torch.float32]
    plain = minispec.generate(target, PROMPT, max_new_tokens=30, ignore_eos=True)
    for gamma, tree_setting in [(3, "off"), (3, 6), ("auto", "auto")]:
        out = minispec.generate(target, PROMPT, draft=[heads[kind], "suffix"], gamma=gamma, tree=tree_setting,
                                max_new_tokens=30, ignore_eos=True)
        assert out.tokens == plain.tokens, (gamma, tree_setting)


def test_the_draft_cache_follows_the_accepted_text_whoever_guessed_it(models, monkeypatch):
    """Each step the draft model guesses what it guesses alone after the text so far (its greedy token),
    also after steps whose accepted path left its chain for the cheap drafter's branch; the same draft
    as the target has all its guesses accepted."""
    guessed, left_chain = [], []
    merge, accept = mixed.MixedDrafter.merge, mixed.MixedDrafter.accept

    def recorded_merge(self, proposal, chain):
        if len(proposal.drafts) and proposal.parents is None:
            guessed.append((list(self.cheap.context), int(proposal.drafts[0])))
        return merge(self, proposal, chain)

    def recorded_accept(self, tokens, tokens_on_device, seen=None):
        if self.chain is not None:
            left_chain.append(tokens[:len(self.chain)] != self.chain[:len(tokens)])
        accept(self, tokens, tokens_on_device, seen)
    monkeypatch.setattr(mixed.MixedDrafter, "merge", recorded_merge)
    monkeypatch.setattr(mixed.MixedDrafter, "accept", recorded_accept)
    target, draft = models["target"], models["independent"]
    plain = minispec.generate(target, PROMPT, max_new_tokens=40, ignore_eos=True)
    out = minispec.generate(target, PROMPT, draft=[draft, "lookup"], gamma=3, tree="off", max_new_tokens=40,
                            ignore_eos=True)
    assert out.tokens == plain.tokens and any(left_chain) and len(guessed) > 5
    for text, first in guessed:
        assert minispec.generate(draft, text, max_new_tokens=1, ignore_eos=True).tokens == [first]
    # the same weights: every step the model drafted accepts its 3 guesses (merged steps included)
    same = minispec.generate(target, PROMPT[:9], draft=[models["same"], "lookup"], gamma=3, tree="off",
                             max_new_tokens=40, ignore_eos=True)
    assert same.tokens == minispec.generate(target, PROMPT[:9], max_new_tokens=40, ignore_eos=True).tokens
    assert same.stats["tokens_per_target_call"] >= 3.5


@pytest.mark.parametrize("coupling, tree_setting", [("rejection", "off"), ("rejection", 8), ("gumbel", 8)])
def test_sampled_output_has_the_targets_distribution(vocab16, coupling, tree_setting, monkeypatch):  # noqa: F811
    """The first three tokens of many requests against the target's exact joint: the noisy draft's draws
    and lookup's copy of what followed "6 8" merged at their nodes (and "6 8 12": lookup's chain alone);
    under the rejection coupling verified by the mixed candidate rule, under the Gumbel one by the walk."""
    target, draws = vocab16["target"], 1200
    sampling = {"temperature": 1.0, "top_k": 3, "coupling": coupling}
    walks = Counter()
    sample_walk = speculative.sample_walk

    def counted(nodes, parents, p, generator, q=None):  # nodes past q's rows: the cheap drafter's
        walks[q is not None and len(nodes) > len(q)] += 1
        return sample_walk(nodes, parents, p, generator, q)
    monkeypatch.setattr(speculative, "sample_walk", counted)
    for prompt in [[6, 8, 12, 6, 8]] + ([[6, 8, 12, 5, 6, 8, 12]] if tree_setting == "off" else []):
        joint = exact_joint(target, prompt, minispec.Sampling(temperature=1.0, top_k=3), length=3)
        counts = Counter()
        for seed in range(draws):
            out = minispec.generate(target, prompt, draft=[vocab16["noisy"], "lookup"], gamma=2, max_new_tokens=3,
                                    seed=seed, ignore_eos=True, tree=tree_setting, **sampling)
            counts[tuple(out.tokens)] += 1
        assert_sampled_from(counts, joint, draws)
    assert walks[True] >= draws // 4 if coupling == "rejection" else not walks  # trees holding both kinds


def test_bad_mixes_are_named(models):
    target, draft = models["target"], models["noisy"]
    bad_mixes = [[draft], [draft, draft], ["lookup", "suffix"], [draft, "lookup", "suffix"], [[draft, "lookup"], "suffix"]]
    for bad in bad_mixes:
        with pytest.raises(ValueError, match="several drafters in one tree: give two") as error:
            minispec.generate(target, PROMPT, draft=bad, max_new_tokens=2)
        assert error.value.field == "draft"
    with pytest.raises(ValueError, match="speculative beam search needs a draft model") as error:
        minispec.generate(target, PROMPT, draft=[draft, "suffix"], beams=2, max_new_tokens=2)
    assert error.value.field == "beams"


def test_the_mix_is_priced_apart_from_its_model(models):
    """gamma="auto"'s profile of the model mixed with a cheap drafter is not the model's own, in this process
    or stored."""
    target, draft = models["target"], models["noisy"]
    own, mix = drafters.make_drafter(draft, target), drafters.make_drafter([draft, "suffix"], target)
    assert policy.profile_for(target, mix, None, 8) is not policy.profile_for(target, own, None, 8)
    assert profiles.pair_key(target, mix, None, 8) != profiles.pair_key(target, own, None, 8)


def test_the_command_lines_take_it(models):
    """--draft D,lookup: both, D loaded as --draft D would be (here the target's int8 copy)."""
    target = models["target"]
    drafted = load_draft("int8,lookup", target)
    assert drafted == ["int8", "lookup"]
    plain = minispec.generate(target, PROMPT, max_new_tokens=12, ignore_eos=True)
    assert minispec.generate(target, PROMPT, draft=drafted, max_new_tokens=12, ignore_eos=True).tokens == plain.tokens


def test_a_server_drafting_with_both_gives_what_generate_gives_alone(checkpoints, alone):  # noqa: F811
    """Concurrent greedy requests on two rows, the draft model and suffix in one tree: plain greedy's text."""
    target, draft = minispec.load(checkpoints[0]), minispec.load(checkpoints[1])
    scheduler = Scheduler(target, [draft, "suffix"], "auto", 2, None, 8, "auto")
    prompts = ["one two three one two four one two five one two", "red blue green red blue black red blue"] * 2
    with TestClient(build_app(scheduler, "tiny", "model,suffix", None, shutdown_timeout=30)) as client:
        calls = [post(client, "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
                 for prompt in prompts]
        replies = [reply.json() for reply in in_threads(calls)]
    for prompt, reply in zip(prompts, replies):
        ids = alone[0].tokenizer.encode(prompt, split_special_tokens=True)
        assert reply["choices"][0]["text"] == minispec.generate(alone[0], ids, max_new_tokens=16).text
