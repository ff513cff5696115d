"""Token trees: a step's guesses as a tree instead of a chain (SpecInfer; the notes' Appendix A). The
drafter offers several continuations at once, sharing their common prefixes; the target scores every
node in one forward, each node attending to its own path only (models/kernels.py, TreeLayout), and
greedy verification walks down from the root, following the child that equals the target's choice:

    node = root                                  the target's last token, which it scores first
    while some child of node is the target's choice at node:
        node = that child                        an accepted guess
    t = the target's choice at node              its own token, as after a rejection in a chain

Every node's logits are bit for bit those a 1-token forward over its path gives, so the output is
plain greedy decoding's token for token. Sampled verification tries a node's children in turn by
recursive rejection (`sample_walk`: Algorithm 1's test and residual, once per child), which gives
exactly the target's distribution. A chain is the tree whose every node has one child.

A tree is given as its nodes' tokens in topological order and `parents`: node j hangs from node
parents[j] (-1: from the root).

Drafters with a distribution (draft models, EAGLE and Medusa heads) grow their trees as EAGLE-2 does
(`Growth`): depth by depth, expanding the most probable new nodes, then keeping the drafter's own chain
and the most probable other nodes. Greedy, their candidates are each node's most probable children,
verified as fixed candidates; sampled, a draft model's or an EAGLE head's are draws from its q
(`DrawnGrowth`: a chain of draws is accepted far more often than a node's most probable tokens
are). `ngram`, whose successors cost nothing to rank, grows its tree most probable node first
(`best_first`), and `lookup` orders its trie of earlier continuations so (`likeliest`): the first nodes
of either are the likeliest tree of their size, which is what the policy chooses among.
"""

import heapq
import math
from collections import Counter
from itertools import count
from typing import NamedTuple

import torch

from .sampling import adjust, sample, sample_distinct

# tree="auto": the most guesses the policy weighs a step's tree at (policy.py). With the token before
# them, about the widest forward that costs a CPU what a 1-token step does; offered more, the policy
# expects too much of the extra nodes and picks wider trees that accept less than they cost.
TREE_AUTO = 5


def feed_parents(unseen, parents, guesses):
    """The parents of a target feed: `unseen` tokens as a chain, then the tree's nodes (parents None:
    `guesses` tokens as a chain)."""
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
    """A tree's verification: the accepted path (node indices, root first), the target's token after it,
    and the tokens of the path's last node's children, all rejected, in order (none: it was a leaf)."""
    path: list
    t: int
    rejected: list


def children_of(parents, at):
    """The nodes hanging from node `at` (-1: the root), in order."""
    return [j for j, parent in enumerate(parents) if parent == at]


def descend(nodes, parents, choose):
    """Walk down from the root: choose(row, children) returns the child to follow, or (None, the
    target's token there); row indexes the target's scores, 0 at the root, 1 + j at node j. Returns
    the TreeVerdict."""
    path, at = [], -1
    while True:
        children = children_of(parents, at)
        follow, t = choose(1 + at, children)
        if follow is None:
            return TreeVerdict(path, t, [nodes[j] for j in children])
        path.append(follow)
        at = follow


def walk(nodes, parents, choices):
    """Greedy verification of a tree: follow the child equal to the target's choice (choices[0] at the
    root, choices[1 + j] at node j): a TreeVerdict."""
    return descend(nodes, parents, lambda row, children: (
        next((j for j in children if nodes[j] == choices[row]), None), choices[row]))


def sample_walk(nodes, parents, p, generator, q=None):
    """Sampled verification of a tree (SpecInfer's and Sequoia's recursive rejection). p [k + 1, vocab]:
    the target's distribution at the root, then at each node. q: None when each node's children are
    fixed candidates, distinct (lookup's, ngram's, Medusa's most probable); else q [k, vocab], the
    drafter's distribution at the root, then at each node, from which that node's children were drawn
    one after another without replacement, in their order (sample_distinct; DrawnGrowth). At a node, p'
    and q' start as p and q there; each child x in turn is accepted with probability min(1, p'(x) /
    q'(x)), else p' becomes norm(max(p' - q', 0)) (Algorithm 1's residual, which is 0 at x) and x leaves
    q'; when none is accepted, t ~ p'. A fixed candidate is a draw from q' one-hot at it: accepted with
    p'(x), else x leaves p'. Each step is Algorithm 1's, whose residual the next draw targets, so the
    token that comes out has probability p exactly; nodes past q's rows are fixed candidates (mixed.py's).
    Returns a TreeVerdict; draws come from `generator` in a fixed order (a row's as alone in a batch)."""
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
    """Add a continuation below the root to a tree (tokens, parents: lists, changed in place), sharing
    the nodes it has in common with the tree, until the tree has `budget` nodes. Returns the nodes the
    continuation runs through, as far as the tree holds it."""
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
    """A tree below token `root`, of at most `budget` nodes and `depth` deep, for a drafter that ranks
    any token's successors for free: successors(token) lists (token, probability), most probable first.
    The nodes come most probable first, a node's probability being the product along its path, so that
    the first nodes of the tree are the likeliest tree of their size (the policy verifies such a
    prefix); a node's children join in their rank order, the tree in topological order. Returns tokens
    and parents (this module's form), and each node's probability given its parent's (how sure the
    drafter is of it)."""
    tokens, parents, levels, probabilities, shares = [], [], [], [], []  # per node; the root, -1, is at depth 0
    waiting, arrival = [], count()  # candidates: (-probability, arrival, parent, rank)

    def offer(parent, rank):
        """The parent's rank-th successor becomes a candidate, if it has one and room below it."""
        ranked = successors(root if parent < 0 else tokens[parent])
        if rank < len(ranked) and (0 if parent < 0 else levels[parent]) < depth:
            probability = (1.0 if parent < 0 else probabilities[parent]) * ranked[rank][1]
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
    return tokens, parents, shares


def first_of(previewed, length, depth, budget):
    """The tree of at most `budget` nodes, `depth` deep, that a drafter whose first nodes are its
    likeliest tree of their size (best_first, likeliest) proposes, cut from the tree it previewed at
    this step (the policy previews the largest, then the step proposes a part of it): previewed is
    (context length, depth, budget, (tokens, parents, sure)) as the preview was made, or None. None
    where that preview cannot give it (another context, or a smaller or shallower tree)."""
    if previewed is None:
        return None
    at, deep, size, (tokens, parents, sure) = previewed
    if at != length or deep < depth or size < budget or max(depths(parents[:budget]), default=0) > depth:
        return None
    return tokens[:budget], parents[:budget], sure[:budget]


def likeliest(tokens, parents, sure, budget):
    """A tree's `budget` most probable nodes, most probable first (best_first's order), a node's
    probability being the product of `sure` (each node's given its parent) down its path: a
    topological order, since no node is more probable than its parent (ties: the shallower first).
    Returns tokens, parents and sure of those nodes, in that order."""
    probability, level = [], depths(parents)
    for parent, confidence in zip(parents, sure):
        probability.append((1.0 if parent < 0 else probability[parent]) * confidence)
    order = sorted(range(len(tokens)), key=lambda j: (-probability[j], level[j], j))[:budget]
    place = {j: i for i, j in enumerate(order)}
    return ([tokens[j] for j in order], [-1 if parents[j] < 0 else place[parents[j]] for j in order],
            [sure[j] for j in order])


def depths(parents):
    """Each node's depth, 1 for the root's children."""
    out = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def chain_length(parents):
    """How many of the first nodes form a chain from the root (a tree's first path, when it is first)."""
    return next((j for j, parent in enumerate(parents) if parent != j - 1), len(parents))


def tree_or_chain(parents):
    """`parents`, or None when the tree is a chain (verified as one: cheaper)."""
    return None if parents == list(range(-1, len(parents) - 1)) else parents


def best_children(logits, sampling, width):
    """The `width` most probable next tokens after each row of logits [..., vocab], and their
    log-probabilities ([..., width] each): under the distribution the target's is adjusted to (the
    draft's own when greedy, whose adjusted one is one-hot). Tokens it excludes get -inf."""
    if sampling.greedy:
        scores = logits.float().log_softmax(-1)
    else:
        scores = adjust(logits, sampling).log()
    return scores.topk(min(width, scores.shape[-1]), dim=-1)


class Growth:
    """A tree grown depth by depth (EAGLE-2's dynamic draft tree). A node's score is its path's
    log-probability under the drafter, the sum of its ancestors' and its own. The spine, the drafter's
    own chain (the root's most probable child, that node's, and so on: a greedy chain's guesses), is
    always in the tree, so a greedy tree accepts no less than the chain of the same depth (ties in the
    draft's rounding aside); EAGLE-2's
    rule alone, the best nodes overall, would trade the chain's deep guesses for more probable shallow
    ones and accept less behind a draft that is seldom wrong. The rest of the `budget` goes to the best
    other nodes (`best`). At each depth the newest spine node and the best other new nodes, `width` in
    all, are expanded (their children added by the caller), but only others that can still be among the
    tree's: a node's descendants score no higher than it, so one already outranked by as many others as
    the budget leaves room for can give the tree nothing.

    Nodes rank by score, ties by index: a child never ranks before its parent (its log-probability is at
    most 0, so its score at most its parent's, and its index is larger), so the best nodes include their
    ancestors, and in rank order each follows its parent (a topological order)."""

    def __init__(self, budget, width):
        self.budget, self.width = budget, width
        self.tokens, self.parents, self.scores = [], [], []
        self.spine = []  # the chain of most probable children from the root
        self.newest = []  # the nodes added since the last expansion

    def add(self, parent, tokens, log_probabilities):
        """Children of node `parent` (-1: the root); those of probability zero are left out (never accepted)."""
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
        """Which of the spine's new children continues it: the most probable."""
        return min(children, key=self.rank)

    def rank(self, node):
        return -self.scores[node], node

    def others(self):
        """The best nodes off the spine, as many as the budget leaves room for, in rank order."""
        spine = set(self.spine)
        room = max(self.budget - len(self.spine), 0)
        return sorted((j for j in range(len(self.tokens)) if j not in spine), key=self.rank)[:room]

    def expand(self):
        """The nodes to expand next: the newest spine node, and the newest depth's best others that can
        still be in the tree, `expansions()` in all."""
        hopeful = set(self.others())
        spine = [node for node in self.newest if node in self.spine]
        others = sorted((node for node in self.newest if node in hopeful), key=self.rank)
        self.newest = []
        return (spine + others)[:self.expansions()]

    def expansions(self):
        """How many nodes a depth expands."""
        return self.width

    def chosen(self):
        """The tree's nodes: the spine and the best other nodes, `budget` in all, in rank order."""
        return sorted(self.spine[:self.budget] + self.others(), key=self.rank)

    def best(self, chosen=None):
        """The tree: tokens and parents (tree.py's form) of the chosen nodes (`chosen`, when the caller
        has them already)."""
        chosen = self.chosen() if chosen is None else chosen
        place = {node: i for i, node in enumerate(chosen)}
        return [self.tokens[j] for j in chosen], [-1 if self.parents[j] < 0 else place[self.parents[j]] for j in chosen]


class DrawnGrowth(Growth):
    """A tree whose children are draws (sampled decoding), verified by recursive rejection (sample_walk
    with q): each node's children are drawn from the drafter's q after its path without replacement, in
    order. That is exact only if how many a node gets is settled before they are drawn: children kept or
    pruned for what they turned out to be (Growth.best's rule) would bias the verified tokens. So the
    budget is shared out depth by depth, before each depth's draws: at most `width` new nodes a depth,
    one kept for each depth below so that the spine (the chain of each node's first draw) can reach
    `depth`, and the slots go to the expanded nodes by score, a slot's score being its node's plus the
    log of q's i-th largest probability for a node's i-th draw (what a draw there brings, roughly; q is
    known before drawing, the draws are not). Every node drawn is in the tree, in the order drawn
    (chosen). Top-k candidates of a sampled q would be verified as fixed candidates, each accepted with
    p'(x) only: behind a draft that matches the target well, far less than a chain of draws (accepted
    with Σ min(p, q)); a child drawn first is accepted as often as a chain's guess."""

    def __init__(self, budget, width, depth):
        super().__init__(budget, width)
        self.depths_left = self.depth = depth  # depths still to draw, the next one included; all of them
        self.q = {}  # node (-1: the root) -> the q its children were drawn from

    def room(self):
        """How many nodes the next depth may add."""
        return max(min(self.width, self.budget - len(self.tokens) - (self.depths_left - 1)), 0)

    def expansions(self):
        """As many as the next depth has room for (no node is pruned, so every other one is hopeful)."""
        return self.room()

    def draw(self, nodes, qs, generator):
        """The next depth: children for each of `nodes` (expanded, -1: the root), drawn from its q in
        qs [len(nodes), vocab] with `generator` (a coupled row's Noise: the race of the depth's position,
        so that each node's first child is the draw a chain would guess there), in order."""
        room, at = self.room(), self.depth - self.depths_left  # at: the drawn tokens' offset in the step
        self.depths_left -= 1
        if not room:
            return
        largest = qs.topk(min(room, qs.shape[-1]), dim=-1).values.tolist()
        slots = sorted((-self.slot_score(node, value), i, n) for n, (node, values) in enumerate(zip(nodes, largest))
                       for i, value in enumerate(values) if value > 0)
        # the spine's first draw always (the chain of draws goes on), then the best other slots
        first = [slot for slot in slots if nodes[slot[2]] == self.spine_end() and slot[1] == 0]
        counts = Counter(n for _, _, n in (first + [slot for slot in slots if slot not in first])[:room])
        for n, node in enumerate(nodes):
            if counts[n]:
                drawn = sample_distinct(qs[n], counts[n], generator, at)
                self.q[node] = qs[n]
                self.add(node, drawn.tolist(), qs[n][drawn].log().tolist())

    def chosen(self):
        """Every node, in the order drawn: parents before children, each node's children in the order
        they were drawn, which sample_walk tries them in (by score, the most probable draw would go
        first whatever was drawn first, and the verified tokens would be biased toward it)."""
        return list(range(len(self.tokens)))

    def spine_child(self, children):
        """The first drawn: a draw from q, as a chain's guess is, so the spine is a chain of draws and
        the tree accepts at least what that chain would (the most probable draw instead lost a chain's
        tokens wherever an earlier draw was accepted and, off the spine, had no children)."""
        return children[0]

    def slot_score(self, node, value):
        return (0.0 if node < 0 else self.scores[node]) + math.log(value)

    def q_rows(self, chosen):
        """q [len(chosen), vocab] for sample_walk: the root's, then each chosen node's but the last
        (which has no children: they come after it), zeros for a node without children."""
        root = self.q[-1]
        return torch.stack([root] + [self.q.get(node, torch.zeros_like(root)) for node in chosen[:-1]])
