"""Token trees (SpecInfer): a tree is its nodes' tokens in topological order and `parents` (-1: the root),
scored in one forward, each node attending to its path, and verified exactly by `walk` (greedy) or
`sample_walk` (recursive rejection). Drafters with a q grow trees as EAGLE-2 does (`Growth`,
`DrawnGrowth`); text drafters order theirs likeliest first (`best_first`, `likeliest`).
"""

import heapq
import math
from collections import Counter
from itertools import count
from typing import NamedTuple

import torch

from .sampling import adjust, sample, sample_distinct

TREE_AUTO = 5  # tree="auto": the most branching nodes the policy weighs (about a CPU's free verify width)


def feed_parents(unseen, parents, guesses):
    """The parents of a target feed: `unseen` tokens as a chain, then the tree's nodes (None: a chain)."""
    if parents is None:
        return list(range(-1, unseen + guesses - 1))
    return list(range(-1, unseen - 1)) + [unseen - 1 if p < 0 else unseen + p for p in parents]


def ancestors(parents, device):
    """[m, m] float: 1 where node j is node i or on its path from the root (penalties' counts)."""
    rows = []
    for j, parent in enumerate(parents):
        row = list(rows[parent]) if parent >= 0 else [0.0] * len(parents)
        row[j] = 1.0
        rows.append(row)
    return torch.tensor(rows, device=device).view(len(parents), len(parents))


class TreeVerdict(NamedTuple):
    """A tree's verification: the accepted path (node indices), the target's token t, the rejected children."""
    path: list
    t: int
    rejected: list


def children_of(parents, at):
    """The nodes hanging from node `at` (-1: the root), in order."""
    return [j for j, parent in enumerate(parents) if parent == at]


def descend(nodes, parents, choose):
    """Walk down from the root: choose(row: 0 at the root, 1 + j at node j, children) returns (the child to
    follow or None, the target's token there). A TreeVerdict."""
    path, at = [], -1
    while True:
        children = children_of(parents, at)
        follow, t = choose(1 + at, children)
        if follow is None:
            return TreeVerdict(path, t, [nodes[j] for j in children])
        path.append(follow)
        at = follow


def walk(nodes, parents, choices):
    """Greedy verification: follow the child equal to the target's choice (choices[1 + j] at node j)."""
    return descend(nodes, parents, lambda row, children: (
        next((j for j in children if nodes[j] == choices[row]), None), choices[row]))


def sample_walk(nodes, parents, p, generator, q=None):
    """Sampled verification (recursive rejection): each child is tried by Algorithm 1's test against the
    residual of those before, so the token out has p's distribution. q: the drafter's at the root and each
    node, or None; a child without q's row is a fixed candidate (accepted with p'(x), else removed from p')."""
    def choose(row, children):
        remaining = p[row] / p[row].sum()  # p'
        drawn_from = None if q is None or row >= len(q) or not children else q[row] / q[row].sum()  # q' (leaf: none)
        for j in children:
            x, drawn = nodes[j], q is not None and j < len(q)
            q_x = drawn_from[x] if drawn else 1.0
            r = torch.rand((), generator=generator, device=remaining.device)
            if r * q_x < remaining[x]:
                return j, None
            if not drawn:
                remaining[x] = 0
            else:
                remaining = (remaining - drawn_from).clamp(min=0)
                drawn_from[x] = 0
                drawn_from /= drawn_from.sum()
            remaining /= remaining.sum()
        return None, int(sample(remaining, generator))
    return descend(nodes, parents, choose)


def add_path(tokens, parents, continuation, budget):
    """Add a continuation below the root to a tree (in place) while it has under `budget` nodes. Its nodes."""
    at, path = -1, []
    for token in continuation:
        child = next((j for j in children_of(parents, at) if tokens[j] == token), None)
        if child is None:
            if len(tokens) >= budget:
                break
            tokens.append(token)
            parents.append(at)
            child = len(tokens) - 1
        path.append(child)
        at = child
    return path


def best_first(root, successors, depth, budget):
    """A PreviewedTree below token `root` of at most `budget` nodes, `depth` deep, most probable first, from
    successors(token): ranked (token, probability) pairs."""
    tokens, parents, levels, probabilities, shares = [], [], [], [], []  # per node; the root, -1, is at depth 0
    waiting, arrival = [], count()  # candidates: (-probability, arrival, parent, rank)

    def offer(parent, rank):
        ranked = successors(root if parent < 0 else tokens[parent])
        if rank < len(ranked) and (0 if parent < 0 else levels[parent]) < depth:
            _, share = ranked[rank]
            probability = (1.0 if parent < 0 else probabilities[parent]) * share
            heapq.heappush(waiting, (-probability, next(arrival), parent, rank))

    offer(-1, 0)
    while waiting and len(tokens) < budget:
        minus_probability, _, parent, rank = heapq.heappop(waiting)
        token, share = successors(root if parent < 0 else tokens[parent])[rank]
        tokens.append(token)
        parents.append(parent)
        levels.append(1 + (0 if parent < 0 else levels[parent]))
        probabilities.append(-minus_probability)
        shares.append(share)
        offer(len(tokens) - 1, 0)  # its first child, which a tie puts before its next sibling
        offer(parent, rank + 1)  # its next sibling, ranked after it
    return PreviewedTree(tokens, parents, shares)


class PreviewedTree(NamedTuple):
    """A drafter's tree as preview_tree returns it: its nodes' tokens, parents, and its confidence in each."""
    tokens: list
    parents: list
    confidences: list


class KeptTree(NamedTuple):
    """A text drafter's last preview_tree, at a context length, depth and budget."""
    length: int
    depth: int
    budget: int
    tree: PreviewedTree


def first_of(kept, length, depth, budget):
    """The first `budget` nodes of the KeptTree, or None where it cannot give them."""
    if (kept is None or kept.length != length or kept.depth < depth or kept.budget < budget
            or max(depths(kept.tree.parents[:budget]), default=0) > depth):
        return None
    return PreviewedTree(*(part[:budget] for part in kept.tree))


def likeliest(tokens, parents, sure, budget):
    """A PreviewedTree of the `budget` most probable nodes (the product of `sure` down a path), most first."""
    probability, level = [], depths(parents)
    for parent, confidence in zip(parents, sure):
        probability.append((1.0 if parent < 0 else probability[parent]) * confidence)
    order = sorted(range(len(tokens)), key=lambda j: (-probability[j], level[j], j))[:budget]
    place = {j: i for i, j in enumerate(order)}
    return PreviewedTree([tokens[j] for j in order], [-1 if parents[j] < 0 else place[parents[j]] for j in order],
                         [sure[j] for j in order])


def depths(parents):
    """Each node's depth, 1 for the root's children."""
    out = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def chain_length(parents):
    """How many of the first nodes form a chain from the root."""
    return next((j for j, parent in enumerate(parents) if parent != j - 1), len(parents))


def tree_or_chain(parents):
    """`parents`, or None when the tree is a chain (verified as one: cheaper)."""
    return None if parents == list(range(-1, len(parents) - 1)) else parents


def best_children(logits, sampling, width):
    """The `width` likeliest next tokens after each row of logits and their log-probabilities (greedy: raw)."""
    scores = logits.float().log_softmax(-1) if sampling.greedy else adjust(logits, sampling).log()
    return scores.topk(min(width, scores.shape[-1]), dim=-1)


class Growth:
    """EAGLE-2's dynamic draft tree, a node scored by its path's log-probability: the spine (the greedy chain)
    always stays, so it accepts no less than the chain; the rest of `budget` goes to the best other nodes."""

    def __init__(self, budget, width):
        self.budget, self.width = budget, width
        self.tokens, self.parents, self.scores = [], [], []
        self.spine = []  # the chain of most probable children from the root
        self.newest = []  # the nodes added since the last expansion

    def add(self, parent, tokens, log_probabilities):
        """Children of node `parent` (-1: the root), but those of probability zero (never accepted)."""
        base, first = 0.0 if parent < 0 else self.scores[parent], len(self.tokens)
        for token, score in zip(tokens, log_probabilities):
            if score > -math.inf:
                self.tokens.append(token)
                self.parents.append(parent)
                self.scores.append(base + score)
                self.newest.append(len(self.tokens) - 1)
        if parent == self.spine_end() and len(self.tokens) > first:
            self.spine.append(self.spine_child(range(first, len(self.tokens))))

    def spine_end(self):
        return self.spine[-1] if self.spine else -1

    def spine_child(self, children):
        return min(children, key=self.rank)

    def rank(self, node):
        return -self.scores[node], node

    def others(self):
        """The best nodes off the spine, as many as the budget leaves room for, in rank order."""
        spine = set(self.spine)
        room = max(self.budget - len(self.spine), 0)
        return sorted((j for j in range(len(self.tokens)) if j not in spine), key=self.rank)[:room]

    def expand(self):
        """The newest spine node and the newest depth's best others that can still be in the tree."""
        hopeful = set(self.others())
        spine = [node for node in self.newest if node in self.spine]
        others = sorted((node for node in self.newest if node in hopeful), key=self.rank)
        self.newest = []
        return (spine + others)[:self.room()]

    def room(self):
        """How many nodes the next depth expands (a drawn tree: how many it may add)."""
        return self.width

    def chosen(self):
        """The tree's nodes: the spine and the best other nodes, `budget` in all, in rank order."""
        return sorted(self.spine[:self.budget] + self.others(), key=self.rank)

    def best(self, chosen=None):
        """The tree's tokens and parents."""
        chosen = self.chosen() if chosen is None else chosen
        place = {node: i for i, node in enumerate(chosen)}
        return [self.tokens[j] for j in chosen], [-1 if self.parents[j] < 0 else place[self.parents[j]] for j in chosen]


class DrawnGrowth(Growth):
    """Children drawn from q without replacement: exact only if each node's count is settled before the draws,
    so a depth's slots are shared out first, by score plus the log of q's i-th largest for an i-th draw."""

    def __init__(self, budget, width, depth):
        super().__init__(budget, width)
        self.depths_left = self.depth = depth  # depths still to draw, the next one included; all of them
        self.q = {}  # node (-1: the root) -> the q its children were drawn from

    def room(self):
        return max(min(self.width, self.budget - len(self.tokens) - (self.depths_left - 1)), 0)

    def draw(self, nodes, qs, generator):
        """The next depth: children for each of `nodes` (-1: the root) drawn from its row of qs."""
        room, at = self.room(), self.depth - self.depths_left  # at: the drawn tokens' offset in the step
        self.depths_left -= 1
        if not room:
            return
        largest = qs.topk(min(room, qs.shape[-1]), dim=-1).values.tolist()
        base = [0.0 if node < 0 else self.scores[node] for node in nodes]
        slots = sorted((-(base[n] + math.log(value)), i, n) for n, values in enumerate(largest)
                       for i, value in enumerate(values) if value > 0)
        # the spine's first draw always (the chain of draws goes on), then the best other slots
        first = [(minus_score, i, n) for minus_score, i, n in slots if nodes[n] == self.spine_end() and i == 0]
        counts = Counter(n for _, _, n in (first + [slot for slot in slots if slot not in first])[:room])
        for n, node in enumerate(nodes):
            if counts[n]:
                drawn = sample_distinct(qs[n], counts[n], generator, at)
                self.q[node] = qs[n]
                self.add(node, drawn.tolist(), qs[n][drawn].log().tolist())

    def chosen(self):
        """Every node, in the order drawn, which sample_walk tries them in (any other order would bias it)."""
        return list(range(len(self.tokens)))

    def spine_child(self, children):
        """The first drawn, so that the spine is a chain of draws and accepts what that chain would."""
        return children[0]

    def q_rows(self, chosen):
        """q for sample_walk: the root's, then each chosen node's but the last, zeros where none was drawn."""
        root = self.q[-1]
        return torch.stack([root] + [self.q.get(node, torch.zeros_like(root)) for node in chosen[:-1]])
