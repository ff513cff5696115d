"""Token trees in the models (kernels.tree_layout, CachedLM.decode_rows(parents=...), CachedLM.keep):
every node of a tree verified in one forward computes bit for bit what a 1-token forward over its path
computes, in every family and dtype, alone and in a batch; the accepted path kept as a chain continues
as plain decoding would."""

import pytest
import torch

import minispec
from test_rows import DTYPES, FAMILIES, PROMPT

# A tree of 11 tokens: token 0 hangs from the cached prefix; parents index the same list.
TOKENS = [7, 19, 44, 3, 61, 28, 90, 12, 55, 36, 71]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 8, 9]


def path(parents, j):
    """Token j's ancestors and itself, root first."""
    nodes = []
    while j >= 0:
        nodes.append(j)
        j = parents[j]
    return nodes[::-1]


def along_paths(model, start, tokens, parents):
    """Each tree token's logits from 1-token forwards over its path after `start`."""
    expected = []
    for j in range(len(tokens)):
        model.prefill(start)
        for node in path(parents, j):
            logits = model.decode(torch.tensor([[tokens[node]]], device=model.device))
        expected.append(logits[0, 0])
    return expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_tree_token_computes_what_its_path_computes(reference_dirs, kind, dtype):
    model = minispec.load(reference_dirs[kind][1], dtype=dtype)
    with torch.inference_mode():
        start = model.encode(torch.tensor([PROMPT]))
        model.ensure_caches(2, 128)
        expected = along_paths(model, start, TOKENS, PARENTS)
        model.prefill(start)
        logits = model.decode_rows(torch.tensor([TOKENS]), [start.shape[1]], parents=[PARENTS])[0]
        assert [j for j in range(len(TOKENS)) if not torch.equal(logits[j], expected[j])] == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5_v1_1"])
def test_a_tree_across_a_block_boundary_computes_what_its_paths_compute(reference_dirs, kind, dtype):
    """A prefix of 29 tokens: the tree's positions 29..33 cross the first block of keys (KEY_BLOCK = 32),
    so its window is two blocks."""
    model = minispec.load(reference_dirs[kind][1], dtype=dtype)
    with torch.inference_mode():
        start = model.encode(torch.tensor([PROMPT + PROMPT[:5]]))
        if kind.startswith("t5"):  # T5's decoder starts from one token: make its prefix 29 long too
            start = torch.cat([start, torch.tensor([(PROMPT * 2)[:28]])], dim=1)
        assert start.shape[1] == 29
        model.ensure_caches(1, 128)
        expected = along_paths(model, start, TOKENS, PARENTS)
        model.prefill(start)
        logits = model.decode_rows(torch.tensor([TOKENS]), [start.shape[1]], parents=[PARENTS])[0]
        assert [j for j in range(len(TOKENS)) if not torch.equal(logits[j], expected[j])] == []


def test_trees_in_a_batch_compute_as_they_would_alone(reference_dirs):
    """Two rows at different lengths, trees of different widths (the shorter one padded), and a chain."""
    model = minispec.load(reference_dirs["llama_gqa"][1], dtype=torch.bfloat16)
    with torch.inference_mode():
        model.ensure_caches(2, 128)
        short = torch.tensor([PROMPT[:5]])
        expected = along_paths(model, torch.tensor([PROMPT]), TOKENS, PARENTS)
        expected_short = along_paths(model, short, TOKENS[:6], PARENTS[:6])
        model.prefill(torch.tensor([PROMPT]))
        model.decode_rows(short, [0], first_row=1)  # row 1 holds the short prompt
        tokens = torch.tensor([TOKENS, TOKENS[:6] + [TOKENS[5]] * 5])
        logits = model.decode_rows(tokens, [len(PROMPT), 5], [11, 6], parents=[PARENTS, PARENTS[:6]])
        assert all(torch.equal(logits[0, j], expected[j]) for j in range(11))
        assert all(torch.equal(logits[1, j], expected_short[j]) for j in range(6))


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_kept_path_continues_as_plain_decoding(reference_dirs, kind):
    """Verify the tree, keep the path to token 9 (0, 2, 5, 8, 9) as a chain, decode one more token."""
    model = minispec.load(reference_dirs[kind][1])
    with torch.inference_mode():
        start = model.encode(torch.tensor([PROMPT]))
        model.ensure_caches(1, 128)
        kept = path(PARENTS, 9)
        model.prefill(start)
        for node in kept:
            model.decode(torch.tensor([[TOKENS[node]]]))
        expected = model.decode(torch.tensor([[5]]))[0, 0]
        model.prefill(start)
        length = start.shape[1]
        model.decode_rows(torch.tensor([TOKENS]), [length], parents=[PARENTS])
        model.keep(0, [length + node for node in kept], length)
        model.length = length + len(kept)  # decode_rows leaves the length to its caller
        assert torch.equal(model.decode(torch.tensor([[5]]))[0, 0], expected)


def test_the_tree_test_fails_without_the_canonical_key_order(reference_dirs, monkeypatch):
    """Plain SDPA over the cache, keys in their slots: some tree token's numbers differ from its path's."""
    from minispec.models import kernels, llama

    def sdpa(q, k, v, mask, scale=None, layout=None):
        positions, mask = mask.shape[-1], mask == 0  # additive -> boolean
        if layout is not None:  # the keys read from their slots: each position's mask moved to its slot
            slots = layout.keys[..., :positions].repeat(1, q.shape[2] // layout.keys.shape[1], 1)[:, None]
            mask = torch.zeros(slots.shape, dtype=torch.int).scatter_reduce(-1, slots, mask.view(slots.shape).int(),
                                                                            "amax") > 0
        return kernels.attend(q, k[:, :, :positions], v[:, :, :positions], mask, scale)
    monkeypatch.setattr(llama, "attend_cache", sdpa)
    model = minispec.load(reference_dirs["llama_gqa"][1])
    with torch.inference_mode():
        start = torch.tensor([PROMPT])
        model.ensure_caches(1, 128)
        expected = along_paths(model, start, TOKENS, PARENTS)
        model.prefill(start)
        logits = model.decode_rows(torch.tensor([TOKENS]), [len(PROMPT)], parents=[PARENTS])[0]
        assert any(not torch.equal(logits[j], expected[j]) for j in range(len(TOKENS)))
        assert all(torch.allclose(logits[j], expected[j], atol=1e-4) for j in range(len(TOKENS)))


# --- decoding with trees (decoding/tree.py, the engine) ---------------------------------------------

from minispec.decoding.drafters import LookupDrafter  # noqa: E402
from minispec.decoding.tree import add_path, walk  # noqa: E402

# Prompts whose suffix occurred before with different continuations: lookup's tree has branches.
BRANCHING = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6], [9, 4, 1, 9, 4, 2, 9, 4, 3, 9, 4],
             [3, 3, 7, 3, 3, 8, 3, 3, 7, 3, 3], [44, 45, 46, 44, 45, 47, 44, 45]]


def test_walk_follows_the_targets_choices_down_the_tree():
    tokens, parents = [], []
    for continuation in ([1, 2, 3], [1, 4], [5, 6]):
        add_path(tokens, parents, continuation, budget=16)
    assert (tokens, parents) == ([1, 2, 3, 4, 5, 6], [-1, 0, 1, 0, -1, 4])
    # choices[0] at the root, choices[1 + j] at node j
    assert walk(tokens, parents, [1, 4, 0, 0, 9, 0, 0]) == ([0, 3], 9, None)  # 1, then 4, then its own 9
    assert walk(tokens, parents, [1, 2, 7, 0, 0, 0, 0]) == ([0, 1], 7, 3)  # 1, 2; 3 rejected for 7
    assert walk(tokens, parents, [8, 0, 0, 0, 0, 0, 0]) == ([], 8, 1)
    add_path(tokens, parents, [7, 8, 9], budget=7)  # the budget cuts a new path short
    assert tokens[-1] == 7 and len(tokens) == 7


def test_lookup_offers_every_earlier_continuation_its_chain_first():
    drafter = LookupDrafter(100, "cpu")
    drafter.start(torch.tensor(BRANCHING[0]))
    chain, _ = drafter.continuation(3)
    tokens, _, parents = drafter.propose_tree(3, 16)
    # the latest earlier "5 6" was followed by 7 11, the one before by 9 10, the first by 7 8
    assert chain == [7, 11, 5] and tokens.tolist()[:3] == chain
    paths = {tuple(tokens[j].item() for j in path(parents, leaf)) for leaf in range(len(parents))
             if leaf not in parents}
    assert paths == {(7, 11, 5), (9, 10, 5), (7, 8, 5)}


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tree_decoding_equals_plain_greedy(reference_dirs, kind):
    """Alone and batched, several budgets: plain greedy's tokens; more tokens per call than the chain."""
    target = minispec.load(reference_dirs[kind][1])
    settings = {"max_new_tokens": 24, "ignore_eos": True}
    plain = [minispec.generate(target, prompt, **settings).tokens for prompt in BRANCHING]
    chain = minispec.generate(target, BRANCHING, draft="lookup", gamma=3, **settings)
    for tree in (2, 8, 64):
        alone = [minispec.generate(target, prompt, draft="lookup", gamma=3, tree=tree, **settings)
                 for prompt in BRANCHING]
        assert [out.tokens for out in alone] == plain, tree
        together = minispec.generate(target, BRANCHING, draft="lookup", gamma=3, tree=tree, batch_size=3, **settings)
        assert [out.tokens for out in together] == plain, tree
        assert [out.stats["target_calls"] for out in together] == [out.stats["target_calls"] for out in alone]
    calls = sum(out.stats["target_calls"] for out in alone)
    assert calls <= sum(out.stats["target_calls"] for out in chain)


def test_the_tree_is_verified_in_one_forward_and_counted(reference_dirs):
    target = minispec.load(reference_dirs["llama_gqa"][1])
    out = minispec.generate(target, BRANCHING[0], draft="lookup", gamma=3, tree=8, max_new_tokens=12, ignore_eos=True)
    assert out.stats["tree_nodes"] >= out.stats["proposed"]
    assert out.stats["target_calls"] < 12 or out.stats["accepted"] == 0


@pytest.mark.parametrize("settings, message", [
    ({"tree": 0}, "tree"), ({"tree": 65}, "tree"), ({"tree": "4"}, "tree"),
    ({"tree": 4, "draft": "ngram"}, "lookup"), ({"tree": 4, "temperature": 1.0, "lenience": 0.5}, "exactly"),
    ({"tree": 4, "beams": 2}, "beams"),
])
def test_bad_tree_settings_are_refused(reference_dirs, settings, message):
    target = minispec.load(reference_dirs["gpt2"][1])
    with pytest.raises(ValueError, match=message):
        minispec.generate(target, [1, 2, 3], **{"draft": "lookup", **settings})


def test_sampled_trees_in_a_batch_give_what_they_give_alone(reference_dirs):
    """Each row walks its tree with its own generator, in the order it would alone."""
    target = minispec.load(reference_dirs["llama_gqa"][1])
    settings = {"max_new_tokens": 16, "ignore_eos": True, "draft": "lookup", "gamma": 3, "tree": 8,
                "temperature": 1.0, "seed": 3}
    alone = [minispec.generate(target, prompt, **settings) for prompt in BRANCHING]
    together = minispec.generate(target, BRANCHING, batch_size=3, **settings)
    assert [out.tokens for out in together] == [out.tokens for out in alone]
    assert sum(out.stats["accepted"] for out in alone) > 0


def test_trees_near_the_end_of_the_context_shrink_to_fit(reference_dirs):
    """gpt2's context is 128: a request ending at its last position still gets plain greedy's tokens."""
    target = minispec.load(reference_dirs["gpt2"][1])
    prompt = (BRANCHING[0] * 10)[:100]
    plain = minispec.generate(target, prompt, max_new_tokens=28, ignore_eos=True)
    out = minispec.generate(target, prompt, draft="lookup", gamma=3, tree=64, max_new_tokens=28, ignore_eos=True)
    assert out.tokens == plain.tokens and out.stats["tree_nodes"] > 0
