"""The suffix drafter (decoding/suffix.py): its store within its budget, its guesses (the most frequent
continuation of the longest match, across requests), greedy output unchanged, sampled output the
target's distribution, and earlier requests' outputs guessed whole."""

import subprocess
import sys
from collections import Counter

import pytest
import torch

import minispec
from conftest import target_and_drafts
from minispec.loaders import load_draft
from minispec.decoding import suffix
from test_speculative import assert_sampled_from, exact_joint, step_outcomes, vocab16  # noqa: F401 (a fixture)

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: target_and_drafts(kind, tmp_path_factory) for kind in ("llama_gqa", "t5_v1_1")}


def drafter_over(texts, prompt, budget=suffix.STORE_TOKENS):
    """A drafter started on `prompt` over a store that remembers `texts`, oldest first."""
    target = torch.nn.Linear(1, 1)  # any object a store can be kept for
    target.device = "cpu"
    suffix.STORES[target] = store = suffix.Store(budget)
    for text in texts:
        store.remember(text)
    drafter = suffix.SuffixDrafter(target)
    drafter.start(torch.tensor(prompt))
    drafter.target = target  # keeps the store alive with the drafter
    return drafter


def test_the_store_stays_within_its_budget_the_oldest_evicted():
    drafter = drafter_over([], [1, 2], budget=100)
    store, generator = drafter.store, torch.Generator().manual_seed(0)
    for length in torch.randint(1, 40, (200,), generator=generator).tolist():
        store.remember(torch.randint(50, (length,), generator=generator).tolist())
        assert store.size == sum(map(len, store.texts)) <= 100
        # the pair index holds exactly the pairs of the texts kept
        assert sum(map(len, store.pairs.values())) == sum(len(text) - 1 for text in store.texts)
    last = list(range(1000))
    store.remember(last)  # a text longer than the budget keeps its end
    assert list(store.texts) == [last[-100:]] and store.size == 100
    assert set(store.pairs) == {(a, a + 1) for a in range(900, 999)}


def test_guesses_are_the_most_frequent_continuation_of_the_longest_match():
    # (2, 3) was followed by 4 twice and by 5 once, the latest: 4, then (after 4) 6 and 5 once each
    # (ties: the latest first); each as sure as its share of its parent's occurrences times match / MATCH_MAX
    drafter = drafter_over([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 2, 3, 5]], [8, 2, 3])
    guesses, sure = drafter.preview(4)
    assert guesses == [4, 6] and sure == pytest.approx([2 / 3 * 2 / 16, 1 / 2 * 2 / 16])
    drafts, q = drafter.propose(4, minispec.Sampling(), None)
    assert drafts.tolist() == [4, 6] and q is None
    # a longer match counts first and is surer: only OCCURRENCES = 1 place is counted here
    drafter = drafter_over([[9, 2, 3, 5], [1, 2, 3, 4], [1, 2, 3, 4]], [9, 2, 3])
    suffix.OCCURRENCES, saved = 1, suffix.OCCURRENCES
    try:
        assert drafter.preview(4) == ([5], [3 / 16])
    finally:
        suffix.OCCURRENCES = saved
    # the tree: both continuations, the likeliest node first
    tokens, parents, _ = drafter.preview_tree(2, 8)
    assert (tokens, parents) == ([4, 5], [-1, -1])


def test_a_prompt_shorter_than_its_match_in_the_store():
    """The whole prompt matches inside an earlier text, tokens before it too: the match is the prompt's
    length, and the guesses what followed."""
    drafter = drafter_over([[1, 2, 3, 4, 5]], [3, 4])
    assert drafter.preview(2) == ([5], [2 / 16])


def test_the_request_itself_is_searched_as_lookup_searches_it():
    drafter = drafter_over([], [1, 2, 3, 1, 2])
    assert drafter.preview(4).guesses == [3, 1, 2, 3]  # the copy runs on into its own guesses
    drafter.accept([3, 1], None)
    assert drafter.preview(2).guesses == [2, 3]
    drafter.finish([3, 1, 7])  # the prompt and the output join the store
    assert list(drafter.store.texts) == [[1, 2, 3, 1, 2, 3, 1, 7]]


def test_greedy_output_equals_target_greedy(models):
    """With guesses from earlier requests (the store warm) and from none, in chains and trees, alone and
    in a batch."""
    for kind, model in models.items():
        target = model["target"]
        suffix.STORES.pop(target, None)
        prompts = [PROMPT, PROMPT[::-1], PROMPT[:6] * 2]
        baseline = [minispec.generate(target, prompt, max_new_tokens=30, ignore_eos=True).tokens for prompt in prompts]
        for gamma, tree in [(3, "off"), (3, 6), ("auto", "auto"), (8, "off")]:
            for prompt, tokens in zip(prompts, baseline):
                out = minispec.generate(target, prompt, draft="suffix", gamma=gamma, tree=tree, max_new_tokens=30,
                                        ignore_eos=True)
                assert out.tokens == tokens, (kind, gamma, tree)
            outs = minispec.generate(target, prompts, draft="suffix", gamma=gamma, tree=tree, max_new_tokens=30,
                                     ignore_eos=True)
            assert [out.tokens for out in outs] == baseline, (kind, gamma, tree)
        assert len(suffix.store_for(target).texts) == 4 * 2 * len(prompts)


def test_a_repeated_request_is_guessed_whole(models):
    """An agent resending its conversation: the second time, the first request's output is in the store,
    and nearly every step accepts all its guesses (lookup, seeing one request, gets few)."""
    target = models["llama_gqa"]["target"]
    suffix.STORES.pop(target, None)
    settings = {"gamma": 4, "max_new_tokens": 40, "ignore_eos": True}
    first = minispec.generate(target, PROMPT, draft="suffix", **settings)
    again = minispec.generate(target, PROMPT, draft="suffix", **settings)
    lookup = minispec.generate(target, PROMPT, draft="lookup", **settings)
    assert again.tokens == first.tokens
    full = again.stats["accepted_lengths"][4]  # steps that accepted all 4 guesses
    assert full >= again.stats["target_calls"] - 1 and again.stats["tokens_per_target_call"] >= 4.5
    assert first.stats["accepted"] <= 10 and lookup.stats["accepted"] <= 10


@pytest.mark.parametrize("tree", [None, 8])
def test_sampled_output_has_the_targets_distribution(vocab16, tree):  # noqa: F811 (the fixture)
    """As lookup's case in test_speculative.py: the first three tokens of many requests, each with its own
    seed, against the target's exact joint. The guesses are deterministic, here what most often followed
    the prompt in the requests before."""
    target, prompt, draws = vocab16["target"], [6, 8, 12, 6, 8], 4000
    suffix.STORES.pop(target, None)
    settings = {"temperature": 1.0, "top_k": 3, "tree": tree or "off"}
    joint = exact_joint(target, prompt, minispec.Sampling(temperature=1.0, top_k=3), length=3)
    counts, outcomes = Counter(), Counter()
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft="suffix", gamma=2, max_new_tokens=3, seed=seed,
                                ignore_eos=True, **settings)
        counts[tuple(out.tokens)] += 1
        outcomes.update(name for name, seen in step_outcomes(out.trace).items() if seen)
    # a tree's root soon offers all three tokens top-k keeps: its first guesses are rarely all rejected
    for outcome in ("rejected after accepted", "all accepted") + (() if tree else ("first rejected",)):
        assert outcomes[outcome] >= draws // 20, f"{outcome}: {outcomes[outcome]} of {draws} requests"
    assert_sampled_from(counts, joint, draws)


def test_the_command_lines_take_it_and_the_core_does_not_load_it(models):
    assert load_draft("suffix", models["llama_gqa"]["target"]) == "suffix"
    loaded = subprocess.run([sys.executable, "-c", "import sys, minispec; print('minispec.decoding.suffix' in "
                             "sys.modules)"], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "False"
