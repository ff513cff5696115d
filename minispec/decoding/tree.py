"""Token trees: a step's guesses as a tree instead of a chain (SpecInfer; the notes' Appendix A). The
drafter offers several continuations at once, sharing their common prefixes; the target scores every
node in one forward, each node attending to its own path only (models/kernels.py, TreeLayout), and
greedy verification walks down from the root, following the child that equals the target's choice:

    node = root                                  the target's last token, which it scores first
    while some child of node is the target's choice at node:
        node = that child                        an accepted guess
    t = the target's choice at node              its own token, as after a rejection in a chain

Every node's logits are bit for bit those a 1-token forward over its path gives, so the output is
plain greedy decoding's token for token. Sampled verification tries a node's children in turn, each
accepted with the target's probability of it among the tokens not yet rejected (`sample_walk`), which
gives exactly the target's distribution. A chain is the tree whose every node has one child.

A tree is given as its nodes' tokens in topological order and `parents`: node j hangs from node
parents[j] (-1: from the root).
"""

import torch

from .sampling import sample

TREE_MAX = 64  # the most guesses a step's tree may hold


def feed_parents(unseen, parents, guesses):
    """The parents of a target feed: `unseen` tokens as a chain, then the tree's nodes (parents None:
    `guesses` tokens as a chain)."""
    if parents is None:
        return list(range(-1, unseen + guesses - 1))
    return list(range(-1, unseen - 1)) + [unseen - 1 if p < 0 else unseen + p for p in parents]


def children_of(parents, at):
    """The nodes hanging from node `at` (-1: the root), in order."""
    return [j for j, parent in enumerate(parents) if parent == at]


def descend(nodes, parents, choose):
    """Walk down from the root: choose(row, children) returns the child to follow, or (None, the
    target's token there); row indexes the target's scores, 0 at the root, 1 + j at node j. Returns the
    accepted path (node indices, root first), the target's token after it, and the first child of the
    path's last node, which was rejected (None: it had none)."""
    path, at = [], -1
    while True:
        children = children_of(parents, at)
        follow, t = choose(1 + at, children)
        if follow is None:
            return path, t, nodes[children[0]] if children else None
        path.append(follow)
        at = follow


def walk(nodes, parents, choices):
    """Greedy verification of a tree: follow the child equal to the target's choice (choices[0] at the
    root, choices[1 + j] at node j); descend's result."""
    return descend(nodes, parents, lambda row, children: (
        next((j for j in children if nodes[j] == choices[row]), None), choices[row]))


def sample_walk(nodes, parents, p, generator):
    """Sampled verification of a tree whose children are fixed candidates, distinct at each node (not
    drawn from a q: lookup's). At each node, p' starts as the target's p there (p [k + 1, vocab]: at
    the root, then at each node); each child in turn is accepted with probability p'(child), else its
    token is zeroed in p' (renormalized); when none is, t ~ p'. Each token thus comes out with
    probability p exactly: candidate c_i with (1 - p(c_1) - ... - p(c_{i-1})) * p(c_i) / (1 - p(c_1) -
    ... - p(c_{i-1})), any other with (1 - sum of the candidates' p) * p / (1 - that sum). Returns what
    walk returns; draws come from `generator` in a fixed order (a row's as alone in a batch)."""
    def choose(row, children):
        remaining = p[row].clone()  # p', unnormalized: its sum is the mass left
        for j in children:
            r = torch.rand((), generator=generator, device=remaining.device)
            if r * remaining.sum() < remaining[nodes[j]]:  # r < p'(child), without dividing
                return j, None
            remaining[nodes[j]] = 0
        return None, int(sample(remaining, generator))
    return descend(nodes, parents, choose)


def add_path(tokens, parents, continuation, budget):
    """Add a continuation below the root to a tree (tokens, parents: lists, changed in place), sharing
    the nodes it has in common with the tree, until the tree has `budget` nodes."""
    at = -1
    for token in continuation:
        child = next((j for j in children_of(parents, at) if tokens[j] == token), None)
        if child is None:
            if len(tokens) >= budget:
                return
            tokens.append(token)
            parents.append(at)
            child = len(tokens) - 1
        at = child
