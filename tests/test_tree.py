"""Token trees in the models (kernels.tree_layout, CachedLM.decode_rows(Feed(..., parents=...)), CachedLM.keep):
every node of a tree verified in one forward computes bit for bit what a 1-token forward over its path
computes, in every family and dtype, alone and in a batch; the accepted path kept as a chain continues
as plain decoding would."""

import math
import random
from collections import Counter

import pytest
import torch

import minispec
from minispec.models.base import Feed
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


def mismatched_tree_tokens(model):
    """The tree's tokens whose logits, all verified in one forward, differ from a 1-token forward's over
    their path (tests/test_cuda.py too)."""
    start = model.encode(torch.tensor([PROMPT], device=model.device))
    model.ensure_caches(2, 128)
    expected = along_paths(model, start, TOKENS, PARENTS)
    model.prefill(start)
    logits = model.decode_rows(Feed(torch.tensor([TOKENS], device=model.device), [start.shape[1]], parents=[PARENTS]))[0]
    return [j for j in range(len(TOKENS)) if not torch.equal(logits[j], expected[j])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_every_tree_token_computes_what_its_path_computes(reference_dirs, kind, dtype, attention):
    model = minispec.load(reference_dirs[kind][1], dtype=dtype)
    with torch.inference_mode():
        assert mismatched_tree_tokens(model) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["gpt2", "llama_gqa", "t5_v1_1"])
def test_a_tree_across_a_block_boundary_computes_what_its_paths_compute(reference_dirs, kind, dtype, attention):
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
        logits = model.decode_rows(Feed(torch.tensor([TOKENS]), [start.shape[1]], parents=[PARENTS]))[0]
        assert [j for j in range(len(TOKENS)) if not torch.equal(logits[j], expected[j])] == []


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_tree_fed_over_several_forwards_computes_what_its_paths_compute(reference_dirs, kind, dtype, attention):
    """A draft grows its tree depth by depth: each forward's tokens continue the tree the forwards before
    wrote (parents lists the whole tree; the row's tokens are its last nodes)."""
    model = minispec.load(reference_dirs[kind][1], dtype=dtype)
    with torch.inference_mode():
        start = model.encode(torch.tensor([PROMPT]))
        model.ensure_caches(1, 128)
        expected = along_paths(model, start, TOKENS, PARENTS)
        model.prefill(start)
        logits = []
        for first, end in ((0, 3), (3, 5), (5, 11)):  # nodes of depths 0-1, 2, then 2-5
            logits += model.decode_rows(Feed(torch.tensor([TOKENS[first:end]]), [start.shape[1] + first], parents=[PARENTS[:end]]))[0]
        assert [j for j in range(len(TOKENS)) if not torch.equal(logits[j], expected[j])] == []


def test_trees_in_a_batch_compute_as_they_would_alone(reference_dirs, attention):
    """Two rows at different lengths, trees of different widths (the shorter one padded), and a chain."""
    model = minispec.load(reference_dirs["llama_gqa"][1], dtype=torch.bfloat16)
    with torch.inference_mode():
        model.ensure_caches(2, 128)
        short = torch.tensor([PROMPT[:5]])
        expected = along_paths(model, torch.tensor([PROMPT]), TOKENS, PARENTS)
        expected_short = along_paths(model, short, TOKENS[:6], PARENTS[:6])
        model.prefill(torch.tensor([PROMPT]))
        model.decode_rows(Feed(short, [0]), first_row=1)  # row 1 holds the short prompt
        tokens = torch.tensor([TOKENS, TOKENS[:6] + [TOKENS[5]] * 5])
        logits = model.decode_rows(Feed(tokens, [len(PROMPT), 5], [11, 6], parents=[PARENTS, PARENTS[:6]]))
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
        model.decode_rows(Feed(torch.tensor([TOKENS]), [length], parents=[PARENTS]))
        model.keep(0, [length + node for node in kept], length)
        model.length = length + len(kept)  # decode_rows leaves the length to its caller
        assert torch.equal(model.decode(torch.tensor([[5]]))[0, 0], expected)


def test_the_tree_test_fails_without_the_canonical_key_order(reference_dirs, monkeypatch):
    """Plain SDPA over the cache, keys in their slots: some tree token's numbers differ from its path's."""
    from minispec.models import base, kernels, llama

    def sdpa(q, k, v, mask, scale=None, layout=None, softcap=0.0):
        positions, mask = mask.shape[-1], mask == 0  # additive -> boolean
        if layout is not None:  # the keys read from their slots: each position's mask moved to its slot
            keys = kernels.tree_keys(layout, positions)
            slots = keys.repeat(1, q.shape[2] // keys.shape[1], 1)[:, None]
            mask = torch.zeros(slots.shape, dtype=torch.int).scatter_reduce(-1, slots, mask.view(slots.shape).int(),
                                                                            "amax") > 0
        return kernels.attend(q, k[:, :, :positions], v[:, :, :positions], mask, scale)
    monkeypatch.setattr(base, "attend_cache", sdpa)  # the Attention of Llama's layers
    monkeypatch.setattr(llama.Llama, "fused_layers", lambda self, x: None)  # the modules' attention is planted
    model = minispec.load(reference_dirs["llama_gqa"][1])
    with torch.inference_mode():
        start = torch.tensor([PROMPT])
        model.ensure_caches(1, 128)
        expected = along_paths(model, start, TOKENS, PARENTS)
        model.prefill(start)
        logits = model.decode_rows(Feed(torch.tensor([TOKENS]), [len(PROMPT)], parents=[PARENTS]))[0]
        assert any(not torch.equal(logits[j], expected[j]) for j in range(len(TOKENS)))
        assert all(torch.allclose(logits[j], expected[j], atol=1e-4) for j in range(len(TOKENS)))


# --- decoding with trees (decoding/tree.py, the engine) ---------------------------------------------

from minispec.decoding.lookup import LookupDrafter, NgramDrafter  # noqa: E402
from minispec.decoding.tree import add_path, depths, walk  # noqa: E402

# Prompts whose suffix occurred before with different continuations: lookup's tree has branches.
BRANCHING = [[5, 6, 7, 8, 5, 6, 9, 10, 5, 6, 7, 11, 5, 6], [9, 4, 1, 9, 4, 2, 9, 4, 3, 9, 4],
             [3, 3, 7, 3, 3, 8, 3, 3, 7, 3, 3], [44, 45, 46, 44, 45, 47, 44, 45]]


def test_walk_follows_the_targets_choices_down_the_tree():
    tokens, parents = [], []
    for continuation in ([1, 2, 3], [1, 4], [5, 6]):
        add_path(tokens, parents, continuation, budget=16)
    assert (tokens, parents) == ([1, 2, 3, 4, 5, 6], [-1, 0, 1, 0, -1, 4])
    # choices[0] at the root, choices[1 + j] at node j
    assert walk(tokens, parents, [1, 4, 0, 0, 9, 0, 0]) == ([0, 3], 9, [])  # 1, then 4, then its own 9
    assert walk(tokens, parents, [1, 2, 7, 0, 0, 0, 0]) == ([0, 1], 7, [3])  # 1, 2; 3 rejected for 7
    assert walk(tokens, parents, [8, 0, 0, 0, 0, 0, 0]) == ([], 8, [1, 5])  # both of the root's children rejected
    add_path(tokens, parents, [7, 8, 9], budget=7)  # the budget cuts a new path short
    assert tokens[-1] == 7 and len(tokens) == 7


def test_lookup_offers_every_earlier_continuation_likeliest_first():
    drafter = LookupDrafter(100, "cpu")
    drafter.start(torch.tensor(BRANCHING[0]))
    tokens, _, parents = drafter.propose_tree(3, 16)
    # the latest earlier "5 6" was followed by 7 11, the one before by 9 10, the first by 7 8: 7 follows
    # two of the three, 9 one, then the second tokens (each as likely as 9 below 7's share)
    assert tokens.tolist()[:3] == [7, 9, 11]
    paths = {tuple(tokens[j].item() for j in path(parents, leaf)) for leaf in range(len(parents))
             if leaf not in parents}
    assert paths == {(7, 11, 5), (9, 10, 5), (7, 8, 5)}


def test_lookup_is_as_sure_of_a_node_as_the_share_of_matches_through_it():
    """Three earlier "5 6" (2-token matches of 3 at most): 7 follows two of them, 9 one; below 7, 11
    and 8 one each; a node's confidence is that share times 2/3. The nodes come most probable first
    (the product down the path: 4/9, 2/9, then three at 4/27, in the order the trie met them)."""
    drafter = LookupDrafter(100, "cpu")
    drafter.start(torch.tensor(BRANCHING[0]))
    tokens, parents, sure = drafter.preview_tree(2, 16)
    assert (tokens, parents) == ([7, 9, 11, 10, 8], [-1, -1, 0, 1, 0])
    assert sure == pytest.approx([2 / 3 * 2 / 3, 1 / 3 * 2 / 3, 1 / 2 * 2 / 3, 2 / 3, 1 / 2 * 2 / 3])
    assert drafter.preview(1).confidences == [2 / 3]  # the chain's confidence in a lone match
    assert drafter.preview_tree(2, 3)[:2] == ([7, 9, 11], [-1, -1, 0])  # a smaller budget: the first nodes


def test_ngram_tree_is_its_most_probable_continuations_first():
    """After 7 came 8 twice and 9 once; after 8, 7 twice and 8 once; after 9, 7. Three deep and five
    nodes, most probable first (the product down the path), not depth by depth: 8 (2/3), 8 7 (4/9), 9
    (1/3) and 9 7 (1/3 * 1) outrank greedy's third guess 8 7 8 (8/27), which outranks 8 8 (2/9)."""
    drafter = NgramDrafter(100, "cpu")
    drafter.start(torch.tensor([7, 8, 7, 9, 7, 8, 8, 7]))
    tokens, q, parents = drafter.propose_tree(3, 5)
    assert drafter.greedy_continuation(3)[0] == [8, 7, 8] and q is None
    assert (tokens.tolist(), parents) == ([8, 7, 9, 7, 8], [-1, 0, -1, 2, 1])
    tokens, _, parents = drafter.propose_tree(1, 4)  # one deep: the root's successors, most counted first
    assert (tokens.tolist(), parents) == ([8, 9], [-1, -1])
    tokens, _, parents = drafter.propose_tree(3, 2)  # room for the chain's first two guesses only: a chain
    assert tokens.tolist() == [8, 7] and parents is None


@pytest.mark.parametrize("drafter_class", [LookupDrafter, NgramDrafter])
def test_a_step_cuts_its_tree_from_the_policys_preview(drafter_class, monkeypatch):
    """The policy previews the largest tree (8 deep, 15 nodes) and the step proposes its first n nodes,
    as deep as they go: cut from the preview, not grown again, and the tree grown for that size; any
    other size is grown as before (random contexts)."""
    rng = random.Random(0)
    for _ in range(100):
        vocab = rng.choice([3, 5, 8, 20])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(2, 50))]
        grown, drafter = drafter_class(vocab, "cpu"), drafter_class(vocab, "cpu")
        grown.start(torch.tensor(context))
        drafter.start(torch.tensor(context))
        _, preview_parents, _ = drafter.preview_tree(8, 15)
        for n in range(1, len(preview_parents) + 1):
            depth = max(depths(preview_parents[:n]))
            tokens, parents, _ = grown.preview_tree(depth, n)
            with monkeypatch.context() as patch:
                patch.setattr(drafter, "preview_tree", None)  # growing it again would fail
                proposed, _, proposed_parents = drafter.propose_tree(depth, n)
            assert proposed.tolist() == tokens and (proposed_parents or list(range(-1, n - 1))) == parents
        depth, budget = rng.randrange(1, 9), rng.randrange(1, 16)
        tokens, parents, _ = grown.preview_tree(depth, budget)
        proposed, _, proposed_parents = drafter.propose_tree(depth, budget)
        assert proposed.tolist() == tokens and (proposed_parents or list(range(-1, len(tokens) - 1))) == parents


@pytest.mark.parametrize("draft", ["lookup", "ngram"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_tree_decoding_equals_plain_greedy(reference_dirs, kind, draft):
    """Alone and batched, several budgets: plain greedy's tokens; more tokens per call than the chain."""
    target = minispec.load(reference_dirs[kind][1])
    settings = {"max_new_tokens": 24, "ignore_eos": True}
    plain = [minispec.generate(target, prompt, **settings).tokens for prompt in BRANCHING]
    chain = minispec.generate(target, BRANCHING, draft=draft, gamma=3, **settings)
    for tree in (2, 8, 64):
        alone = [minispec.generate(target, prompt, draft=draft, gamma=3, tree=tree, **settings)
                 for prompt in BRANCHING]
        assert [out.tokens for out in alone] == plain, tree
        together = minispec.generate(target, BRANCHING, draft=draft, gamma=3, tree=tree, batch_size=3, **settings)
        assert [out.tokens for out in together] == plain, tree
        assert [out.stats["target_calls"] for out in together] == [out.stats["target_calls"] for out in alone]
    assert sum(out.stats.get("tree_nodes", 0) for out in alone) > 0  # trees of 64 were verified
    calls = sum(out.stats["target_calls"] for out in alone)
    assert calls <= sum(out.stats["target_calls"] for out in chain)


@pytest.mark.parametrize("draft", ["lookup", "ngram", "model"])
def test_greedy_with_trees_chosen_per_step_is_plain_greedy(reference_dirs, noisy_gqa, known_costs, draft):
    """tree="auto": a tree or a chain each step, as the policy expects faster (costs held fixed, so
    trees pay where they add a fifth more expected tokens); plain greedy's tokens, alone and batched."""
    target = minispec.load(reference_dirs["llama_gqa"][1])
    draft = minispec.load(noisy_gqa) if draft == "model" else draft
    settings = {"max_new_tokens": 32, "ignore_eos": True, "draft": draft, "tree": "auto"}
    plain = [minispec.generate(target, prompt, max_new_tokens=32, ignore_eos=True).tokens for prompt in BRANCHING]
    alone = [minispec.generate(target, prompt, **settings) for prompt in BRANCHING]
    assert [out.tokens for out in alone] == plain
    assert sum(out.stats.get("tree_nodes", 0) for out in alone) > 0
    together = minispec.generate(target, BRANCHING, batch_size=3, **settings)
    assert [out.tokens for out in together] == plain


def test_the_tree_is_verified_in_one_forward_and_counted(reference_dirs):
    target = minispec.load(reference_dirs["llama_gqa"][1])
    out = minispec.generate(target, BRANCHING[0], draft="lookup", gamma=3, tree=8, max_new_tokens=12, ignore_eos=True)
    assert out.stats["tree_nodes"] >= out.stats["proposed"]
    assert out.stats["target_calls"] < 12 or out.stats["accepted"] == 0


@pytest.mark.parametrize("settings, message", [
    ({"tree": 0}, "tree"), ({"tree": 65}, "tree"), ({"tree": "4"}, "tree"),
    ({"tree": 4, "draft": "none"}, "need a drafter"), ({"tree": 4, "temperature": 1.0, "lenience": 0.5}, "exactly"),
    ({"tree": 4, "beams": 2}, "beams"), ({"tree": "always"}, "'auto'"),
])
def test_bad_tree_settings_are_refused(reference_dirs, settings, message):
    target = minispec.load(reference_dirs["gpt2"][1])
    with pytest.raises(ValueError, match=message):
        minispec.generate(target, [1, 2, 3], **{"draft": "lookup", **settings})


@pytest.mark.parametrize("settings", [{"draft": "none"}, {"gamma": 3}, {"temperature": 1.0, "lenience": 0.5},
                                      {"tree": "off"}])
def test_auto_trees_are_chains_where_trees_cannot_be_chosen(reference_dirs, settings):
    """No drafter, a fixed gamma (Algorithm 1 as written), lenience: tree="auto" is no tree."""
    target = minispec.load(reference_dirs["gpt2"][1])
    out = minispec.generate(target, BRANCHING[0], **{"draft": "lookup", "tree": "auto", "max_new_tokens": 8, **settings})
    assert "tree_nodes" not in out.stats


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


# --- trees from draft models (EAGLE-2's dynamic tree: tree.Growth, drafters.draft_trees) --------------

from conftest import noisy_copy, save_reference  # noqa: E402
from test_speculative import assert_sampled_from, exact_joint, step_outcomes  # noqa: E402
from test_speculative import vocab16  # noqa: E402, F401 (a fixture)

from minispec.decoding.drafters import TREE_WIDTH, Ask, make_drafter, propose_all  # noqa: E402
from minispec.decoding.sampling import Sampling, adjust, sample_distinct  # noqa: E402
from minispec.decoding.tree import DrawnGrowth, Growth, best_children, depths, sample_walk, tree_or_chain  # noqa: E402

GREEDY, SAMPLED = Sampling(), Sampling(temperature=0.8, top_k=6)


def test_growth_keeps_the_spine_and_the_best_other_nodes_with_their_ancestors():
    """Scores add down a path; the tree holds the spine (each node's most probable child from the root)
    and the best other nodes, parents first; a node that cannot be among them is not expanded; ties rank
    the older node (so the parent) first."""
    growth = Growth(budget=4, width=2)
    growth.add(-1, [10, 11, 12], [-0.1, -0.5, -3.0])  # nodes 0 (the spine), 1, 2
    assert growth.expand() == [0, 1]  # the spine, then the best other
    growth.add(0, [20, 21], [0.0, -2.0])  # nodes 3 (-0.1: ties its parent; the spine), 4 (-2.1)
    growth.add(1, [22, 23, 24], [-0.2, -0.4, -math.inf])  # nodes 5 (-0.7), 6 (-0.9); 24 has no chance
    assert growth.expand() == [3, 5]  # 4 and 6 are outranked by 1 and 5, which fill the room beside the spine
    growth.add(3, [30], [-0.05])  # node 7 (-0.15: the spine)
    growth.add(5, [31], [-1.0])  # node 8 (-1.7)
    assert growth.expand() == [7]
    assert growth.best() == ([10, 20, 30, 11], [-1, 0, 1, -1])
    growth = Growth(budget=2, width=2)  # the spine stays, though its second node is less probable than
    growth.add(-1, [1, 2], [-0.5, -0.9])  # node 1 (EAGLE-2's rule would keep nodes 0 and 1)
    assert growth.expand() == [0, 1]
    growth.add(0, [3], [-0.6])
    growth.add(1, [4], [-0.1])
    assert growth.best() == ([1, 3], [-1, 0])


def test_drawn_growth_shares_the_budget_before_drawing_and_keeps_a_chain_of_first_draws():
    """Sampled trees (DrawnGrowth): each depth adds at most `width` nodes, leaving one for each depth
    below (so 4 deep in 10 nodes); a node's children are its draws in the order drawn; the spine is each
    node's first draw (a chain of draws), which always gets a child; every node drawn is in the tree."""
    growth = DrawnGrowth(budget=10, width=3, depth=4)
    q = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    generator = torch.Generator().manual_seed(7)
    growth.draw([-1], q[None], generator)
    first = sample_distinct(q, 3, torch.Generator().manual_seed(7)).tolist()
    assert growth.tokens == first and growth.spine == [0]  # 3 = min(width, 10 - 3 kept for depths 2-4)
    for depth in (2, 3, 4):
        nodes = growth.expand()
        assert nodes[0] == growth.spine[-1] and len(nodes) <= 3
        before = len(growth.tokens)
        growth.draw(nodes, q.flip(0).expand(len(nodes), -1), generator)
        assert growth.spine[-1] == before and growth.parents[before] == nodes[0]  # the spine's first draw
        assert len(growth.tokens) <= 10 - (4 - depth)
    tokens, parents = growth.best()
    assert len(tokens) == len(growth.tokens) and max(depths(parents)) == 4
    assert growth.chosen() == list(range(len(tokens)))  # the order drawn


def path_tokens(tokens, parents, j):
    return [tokens[node] for node in path(parents, j)]


def drafted_tree(drafter, k, budget, sampling):
    """The tree the drafter proposes: tokens (a list), q and parents; sampled, its draws from a generator
    seeded 3."""
    tokens, q, parents = propose_all([Ask(drafter, k, sampling, torch.Generator().manual_seed(3), None, budget)])[0][:3]
    return tokens.tolist(), q, parents


def reference_tree(logits_after, k, budget, sampling):
    """EAGLE-2's tree written out: each expanded node's children from the draft's logits after its path,
    logits_after(path tokens), computed without any tree forward; greedy, its best children
    (tree.Growth), sampled, draws from its q (tree.DrawnGrowth, which also gives q's rows) from a
    generator seeded 3, as drafted_tree's. Returns what drafted_tree does."""
    depth, width, generator = min(k, budget), min(TREE_WIDTH, budget), torch.Generator().manual_seed(3)
    growth = Growth(budget, width) if sampling.greedy else DrawnGrowth(budget, width, depth)

    def after(node):
        return logits_after(path_tokens(growth.tokens, growth.parents, node) if node >= 0 else [])

    def add(nodes):
        if not sampling.greedy:
            return growth.draw(nodes, adjust(torch.stack([after(node) for node in nodes]), sampling), generator)
        for node in nodes:
            scores, tokens = best_children(after(node), sampling, growth.width)
            growth.add(node, tokens.tolist(), scores.tolist())
    add([-1])
    for _ in range(1, depth):
        add(growth.expand())
    tokens, parents = growth.best()
    return tokens, None if sampling.greedy else growth.q_rows(growth.chosen()), tree_or_chain(parents)


def assert_same_tree(drafted, reference, sampling):
    """drafted_tree's tree is reference_tree's; greedy, q is None (top-k candidates are not draws);
    sampled, its rows are the q each node's children were drawn from, and the spine reaches 4 deep."""
    (tokens, q, parents), (want_tokens, want_q, want_parents) = drafted, reference
    assert (tokens, parents) == (want_tokens, want_parents)
    if sampling.greedy:
        assert q is None
    else:
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-6)
        assert max(depths(parents)) == 4


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_draft_models_tree_holds_the_children_its_paths_give(reference_dirs, kind, sampling):
    """Every expanded node's children are the draft's best after the node's path (greedy), or draws
    from its q there with the row's generator (sampled), as 1-token forwards over that path give them:
    the tree forwards feed each node at its depth, after its own ancestors. Sampled, q's rows are the
    q each node's children were drawn from."""
    draft = minispec.load(reference_dirs[kind][1])
    draft.ensure_caches(1, 128)
    draft.prepare_batch(1, len(PROMPT))
    drafter = make_drafter(draft, minispec.load(reference_dirs[kind][1]))
    with torch.inference_mode():
        drafter.start(torch.tensor([PROMPT]))
        start = draft.encode_row(0, torch.tensor([PROMPT]))
        drafted = drafted_tree(drafter, 4, 16, sampling)
        assert drafted[2] is not None and len(drafted[0]) == 16
        assert draft.length == 0 and drafter.length == start.shape[1]  # the tree left nothing behind

        def logits_after(path_tokens):
            return draft.prefill(torch.cat([start, torch.tensor([path_tokens], dtype=torch.long)], 1))[0, -1]
        assert_same_tree(drafted, reference_tree(logits_after, 4, 16, sampling), sampling)


@pytest.fixture(scope="module")
def noisy_gqa(reference_dirs, tmp_path_factory):
    """A good draft for the GQA llama: a noisy copy of it (accepted about 0.8 of the time, greedy)."""
    return save_reference(noisy_copy(reference_dirs["llama_gqa"][0], seed=1, scale=0.01),
                          tmp_path_factory.mktemp("noisy_gqa"))


PROMPTS = [PROMPT, PROMPT[:9], [3, 4, 5], BRANCHING[0]]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("draft", ["model", "int8"])
def test_greedy_with_a_draft_models_tree_is_plain_greedy(reference_dirs, noisy_gqa, draft, dtype):
    """Draft-model trees of several budgets, alone and batched: plain greedy's tokens, a batch's rows
    exactly what they are alone."""
    target = minispec.load(reference_dirs["llama_gqa"][1], dtype=dtype)
    draft = minispec.load(noisy_gqa, dtype=dtype) if draft == "model" else draft
    settings = {"max_new_tokens": 24, "ignore_eos": True, "draft": draft, "gamma": 3}
    plain = [minispec.generate(target, prompt, max_new_tokens=24, ignore_eos=True).tokens for prompt in PROMPTS]
    for tree in (2, 16):
        alone = [minispec.generate(target, prompt, tree=tree, **settings) for prompt in PROMPTS]
        assert [out.tokens for out in alone] == plain, tree
        assert sum(out.stats.get("tree_nodes", 0) for out in alone) > 0 or tree == 2  # 2 nodes: often a chain
        together = minispec.generate(target, PROMPTS, tree=tree, batch_size=3, **settings)
        assert [out.tokens for out in together] == plain, tree
        assert [out.stats["target_calls"] for out in together] == [out.stats["target_calls"] for out in alone]


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "t5_v1_1"])
def test_greedy_with_other_families_draft_trees_is_plain_greedy(reference_dirs, kind, tmp_path):
    reference, directory = reference_dirs[kind]
    target = minispec.load(directory)
    draft = minispec.load(save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path))
    plain = minispec.generate(target, PROMPT, max_new_tokens=24, ignore_eos=True)
    out = minispec.generate(target, PROMPT, draft=draft, gamma=3, tree=16, max_new_tokens=24, ignore_eos=True)
    assert out.tokens == plain.tokens and out.stats["tree_nodes"] > 0


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["llama_gqa", "gpt2", "t5_v1_1"])
def test_a_draft_model_keeps_the_accepted_nodes_it_computed(reference_dirs, kind, sampled, tmp_path, monkeypatch):
    """After a tree step the draft's cache row keeps the accepted nodes it fed while growing the tree,
    moved into place (ModelDrafter.keep_path), instead of feeding them again: the same guesses and
    tokens step for step as feeding every accepted token again (their keys and values are a chain's bit
    for bit), alone and in a batch whose rows move, with fewer tokens through the draft."""
    import types

    from minispec.decoding.drafters import ModelDrafter

    reference, directory = reference_dirs[kind]
    target = minispec.load(directory)
    draft = minispec.load(save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path))
    fed, decode_rows = [], draft.decode_rows

    def counted(self, feed, *args, **kwargs):
        fed[-1] += feed.tokens.numel() if feed.widths is None else sum(feed.widths)
        return decode_rows(feed, *args, **kwargs)

    monkeypatch.setattr(draft, "decode_rows", types.MethodType(counted, draft))
    settings = {"draft": draft, "gamma": 4, "tree": 16, "max_new_tokens": 32, "ignore_eos": True,
                **({"temperature": 1.0, "seed": 3} if sampled else {})}
    runs = []
    for keeping in (True, False):
        if not keeping:
            monkeypatch.setattr(ModelDrafter, "keep_path", lambda self, accepted: 0)
        fed.append(0)
        runs.append([(out.tokens, out.trace) for batch_size in (1, 3)
                     for out in minispec.generate(target, PROMPTS, batch_size=batch_size, **settings)])
    print(f"tokens through the draft: {fed[0]} kept, {fed[1]} fed again")
    assert runs[0] == runs[1] and fed[0] < 0.9 * fed[1]


def assert_sampled_trees(target, prompt, tree_settings, other_prompts, draws=4000):
    """Sampled tree decoding (gamma 2, temperature 1, top-k 3) against the target's exact joint of three
    tokens (chi-square at significance 0.001 over seeds 0 to draws - 1, and a total-variation bound);
    first guesses rejected, rejections after acceptances and whole paths accepted each in >= 1/20 of
    the requests, trees in half; batched rows (with other_prompts) draw what they draw alone."""
    sampling = {"temperature": 1.0, "top_k": 3}
    settings = {**tree_settings, "gamma": 2, "max_new_tokens": 3, "ignore_eos": True, **sampling}
    joint = exact_joint(target, prompt, minispec.Sampling(**sampling), length=3)
    counts, outcomes, trees = Counter(), Counter(), 0
    for seed in range(draws):
        out = minispec.generate(target, prompt, seed=seed, **settings)
        counts[tuple(out.tokens)] += 1
        outcomes.update(name for name, seen in step_outcomes(out.trace).items() if seen)
        trees += out.stats.get("tree_nodes", 0) > 0
    print(f"{dict(outcomes)}, {trees} requests verified a tree")
    for outcome in ("first rejected", "rejected after accepted", "all accepted"):
        assert outcomes[outcome] >= draws // 20, f"{outcome}: {outcomes[outcome]} of {draws} requests"
    assert trees >= draws // 2
    assert_sampled_from(counts, joint, draws)
    prompts, longer = [prompt, *other_prompts], {**settings, "max_new_tokens": 12, "seed": 5}
    alone = [minispec.generate(target, p, **longer).tokens for p in prompts]
    assert [out.tokens for out in minispec.generate(target, prompts, **longer)] == alone


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_tree_accepts_more_per_target_call_than_the_chain(reference_dirs, noisy_gqa, sampled):
    """The same depth (gamma 4), a good draft: the tree's other branches catch some of the chain's
    misses. Greedy by 1.1x; sampled (temperature 1, seeded) by 1.05x: the tree's first draws are
    accepted as often as the chain's guesses, the other draws only add (deterministic: fixed models
    and seeds)."""
    target, draft = minispec.load(reference_dirs["llama_gqa"][1]), minispec.load(noisy_gqa)
    settings = {"max_new_tokens": 48, "ignore_eos": True, "draft": draft, "gamma": 4,
                **({"temperature": 1.0, "seed": 0} if sampled else {})}
    chain = minispec.generate(target, PROMPTS, **settings)
    tree = minispec.generate(target, PROMPTS, tree=16, **settings)
    per_call = [sum(len(out.tokens) for out in outs) / sum(out.stats["target_calls"] for out in outs)
                for outs in (chain, tree)]
    print(f"tokens per target call: chain {per_call[0]:.2f}, tree {per_call[1]:.2f}")
    assert per_call[1] > (1.05 if sampled else 1.1) * per_call[0]


def test_a_sampled_tree_behind_the_target_itself_is_always_accepted(reference_dirs):
    """The target as its own draft, temperature 1: q = p (bit for bit: every node's logits are those of
    its path), so every draw passes min(1, p/q) = 1 and nothing is ever rejected, tree or chain. Fixed
    candidates (the most probable children) would be accepted with p(x) alone."""
    target, draft = minispec.load(reference_dirs["llama_gqa"][1]), minispec.load(reference_dirs["llama_gqa"][1])
    outs = minispec.generate(target, PROMPTS, draft=draft, gamma=4, tree=16, temperature=1.0, seed=0,
                             max_new_tokens=40, ignore_eos=True)
    assert all(out.stats["tree_nodes"] > 0 for out in outs)
    assert [kind for out in outs for _, kind in out.trace if kind in ("rejected", "corrected")] == []


@pytest.mark.parametrize("children", [1, 2, 3, 4])
def test_children_drawn_from_q_are_verified_to_p(children):
    """One node, its children drawn from q without replacement (sample_distinct), verified by recursive
    rejection (sample_walk with q): the token that comes out has distribution p (chi-square at
    significance 0.001, 20000 draws, seeded), for p and q far apart, q covering a token p lacks and
    missing one p has."""
    p = torch.tensor([0.25, 0.2, 0.15, 0.1, 0.1, 0.08, 0.07, 0.05, 0.0])
    q = torch.tensor([0.05, 0.1, 0.3, 0.0, 0.15, 0.05, 0.1, 0.05, 0.2])
    generator, counts, draws = torch.Generator().manual_seed(0), Counter(), 20000
    for _ in range(draws):
        drawn = sample_distinct(q, children, generator).tolist()
        path, t, _ = sample_walk(drawn, [-1] * len(drawn), p.expand(len(drawn) + 1, -1), generator,
                                 q.expand(len(drawn), -1))
        counts[(drawn[path[0]] if path else t,)] += 1
    assert_sampled_from(counts, {(token,): float(p[token]) for token in range(8)}, draws)


def test_sampled_draft_trees_have_the_targets_joint_distribution(vocab16):  # noqa: F811 (the fixture)
    """Three tokens of many requests against the target's exact joint (chi-square at p > 0.001 and a
    total-variation bound, test_speculative.assert_sampled_from): a noisy draft's trees of 5 nodes, 2
    deep, top-3 sampling, so that a step's tree holds some of the target's 3 tokens at a node and not
    others: its first guesses rejected, rejections after acceptances and whole paths accepted all
    happen often (fewer nodes: the root's 3 children, seldom a second depth). Batched rows draw what
    they draw alone."""
    assert_sampled_trees(vocab16["target"], [1, 2, 3], {"draft": vocab16["noisy"], "tree": 3}, [[4, 5], [6, 7, 8, 9]])


@pytest.mark.parametrize("draft", ["ngram", "lookup"])
def test_sampled_ngram_and_lookup_trees_have_the_targets_joint_distribution(vocab16, draft):  # noqa: F811
    """ngram's and lookup's trees (fixed candidates, tree.sample_walk) against the target's exact joint of
    three tokens, as the draft models' test above (chi-square at significance 0.001, seeds 0-3999, and
    a total-variation bound): after 6 8 came 15 and then 12, so the tree offers both at the root (ngram:
    the counts tie, the smaller id first; lookup: both earlier matches' continuations), both in the
    target's top 3 there, and a node below each; first guesses rejected, rejections after acceptances
    and whole paths accepted all happen often. Batched rows draw what they draw alone."""
    assert_sampled_trees(vocab16["target"], [6, 8, 15, 6, 8, 12, 6, 8], {"draft": draft, "tree": 4},
                         [[4, 5, 4, 6, 4], [6, 7, 8, 9]])


@pytest.mark.parametrize("draft", ["model", "int8", "ngram"])
def test_run_py_verifies_draft_model_trees(reference_dirs, noisy_gqa, draft):
    """run.py --tree N with --draft DIR or int8: plain greedy's tokens, trees verified."""
    import contextlib
    import io
    import json

    import run

    ids = ",".join(map(str, PROMPT))
    outputs = []
    for args in (["--draft", str(noisy_gqa) if draft == "model" else draft, "--tree", "8"], ["--draft", "none"]):
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            assert run.main(["--target", str(reference_dirs["llama_gqa"][1]), "--prompt-ids", ids, "--max-new-tokens",
                             "16", "--ignore-eos", "--gamma", "3", "--json", *args]) == 0
        outputs.append(json.loads(buffer.getvalue()))
    assert outputs[0]["tokens"] == outputs[1]["tokens"] and outputs[0]["stats"]["tree_nodes"] > 0
