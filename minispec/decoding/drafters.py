"""Drafters: whatever proposes the γ guesses of Algorithm 1, through one small interface:

    start(prompt_ids, sampling, row)            a new request, in cache row `row`
    propose(k, sampling, rng, keep_guessing)    <= k guesses and their q [k', vocab] (None: one-hot)
    accept(tokens, tokens_on_device, seen)      the tokens the target kept (seen: its states, if reads_states)
    calls, encoder_calls, name, model, preview  statistics; what drafts; preview(k): free next guesses (or None)
    weights (optional)                          trained weights whose costs gamma="auto" keeps apart

Any q keeps the output exact, as long as each guess is drawn from the q reported.
"""

import sys
import weakref
from itertools import islice
from typing import Callable, NamedTuple, Optional

import torch

from ..models.base import CachedLM, Feed
from ..models.kernels import to_device
from .sampling import Counts, Sampling, adjust, penalize, sample
from .tree import DrawnGrowth, Growth, best_children, children_of, tree_or_chain


class Ask(NamedTuple):
    """What a row asks its drafter for at a step."""
    drafter: object
    k: int  # γ: the most guesses (a tree: its depth)
    sampling: Sampling
    generator: Optional[torch.Generator]
    keep_guessing: Optional[Callable]  # keep_guessing(i, confidence): whether to go on after guess i
    tree: Optional[int] = None  # the most nodes of a token tree (None: a chain)
    counts: Optional[Counts] = None  # a penalized row's (engine.Row), which a draft model's chain q is penalized by
    noise: object = None  # a coupled row's noise.Noise: a draft model guesses under the target's noise
    grammar: Optional[object] = None  # a constrained row's grammar.Matcher, which a draft model's chain q is masked by
    depth: Optional[int] = None  # the deepest path any drafter may add (γ's most, or the tokens left)


class Proposal(NamedTuple):
    """A drafter's guesses: drafts [k] drawn from q [k, vocab] (None: one-hot), a tree's if parents is not None."""
    drafts: torch.Tensor
    q: Optional[torch.Tensor]
    parents: Optional[list] = None


SELF_DRAFT_MODES = ("int8", "int4")  # draft="int8"/"int4": the target's own quantized copy (models.quant's MODES)
SELF_DRAFTS = weakref.WeakKeyDictionary()  # target -> {mode: copy}, made on first use


def make_drafter(draft, target):
    """A drafter for `draft`: a model, a draft head, a text drafter, the target quantized, or a list of two."""
    if isinstance(draft, (list, tuple)):
        from . import mixed  # [model, "suffix"]: both in one tree, an optional drafter read when asked for
        return mixed.MixedDrafter([make_drafter(part, target) for part in draft], target)
    if draft == "suffix":
        from . import suffix  # an optional drafter: the core loads its module only when it is asked for
        return suffix.SuffixDrafter(target)
    if draft in ("ngram", "lookup"):
        from . import lookup  # the drafters that read only the text: their module is read when asked for
        return lookup.DRAFTERS[draft](target.vocab_size, target.device)
    if isinstance(draft, str) and draft in SELF_DRAFT_MODES:
        copies = SELF_DRAFTS.setdefault(target, {})
        if draft not in copies:
            from ..models.quant import quantized_copy  # read only when a self-draft is asked for
            copies[draft] = quantized_copy(target, draft)
            for note in copies[draft].quantization["notes"]:  # layers the int4 kernel cannot take
                print(f"minispec: draft {copies[draft].name}: {note}", file=sys.stderr)
        return ModelDrafter(copies[draft])
    if hasattr(draft, "drafter") and hasattr(draft, "target"):  # a draft head (minispec/heads)
        if draft.target is not target:
            raise ValueError(f"the draft head {draft.name} was loaded for {draft.target.name}, not for the target "
                             f"{target.name}; load it with minispec.load_draft_head(path, target)")
        return draft.drafter()
    if isinstance(draft, str):
        raise ValueError(f"draft={draft!r}: load a draft model once with minispec.load({draft!r}) and pass the "
                         "model (a path here would reload its weights on every call); or use 'ngram', 'lookup', "
                         "'suffix', 'int8' or 'int4'")
    if not isinstance(draft, CachedLM):
        raise ValueError(f"draft must be a minispec model (minispec.load), 'ngram', 'lookup', 'suffix', 'int8' or "
                         f"'int4' (or a list: [model, 'suffix']); got {draft!r}")
    if draft is target:
        raise ValueError("the draft must be a separate model object (each needs its own KV cache); "
                         "load the checkpoint twice to draft with the target's weights")
    if draft.device != target.device:
        raise ValueError(f"the draft {draft.name} is on {draft.device} but the target {target.name} is on "
                         f"{target.device}; load both on the same device")
    check_same_vocabulary(target, draft)
    return ModelDrafter(draft)


def check_same_vocabulary(target, draft):
    """The same tokens under the same ids, scored by logits of one width."""
    if target.tokenizer and draft.tokenizer and target.tokenizer.fingerprint != draft.tokenizer.fingerprint:
        i = target.tokenizer.first_difference(draft.tokenizer)
        raise ValueError(f"target {target.name} and draft {draft.name} use different tokenizers: id {i} is "
                         f"{target.tokenizer.describe(i)} in the target's, {draft.tokenizer.describe(i)} in the draft's")
    if target.vocab_size != draft.vocab_size:
        raise ValueError(f"target {target.name} and draft {draft.name} have different vocabularies "
                         f"({target.vocab_size} vs {draft.vocab_size} tokens): speculative decoding needs the same one")


class ModelDrafter:
    """A smaller model M_q guessing for one request in row `row` of its KV cache (EAGLE heads too)."""

    name, preview = "model", None
    # a draft head's: the target's states it reads (True: the last; a tuple of layers: those entering them)
    reads_states = False

    def __init__(self, model):
        self.model = model
        self.calls = self.encoder_calls = 0

    def start(self, prompt_ids, sampling=Sampling(), row=0):
        before = self.model.encoder_calls
        prefix = self.model.encode_row(row, prompt_ids.to(self.model.device))
        self.encoder_calls = self.model.encoder_calls - before
        self.row, self.length, self.calls = row, 0, 0  # positions its cache row holds
        # the prompt waits like any unseen tokens: its forward runs at the first proposal, if any
        self.unseen = prefix.view(-1)  # accepted tokens the cache has not seen yet, on the device
        self.next_logits = None
        self.unseen_states = self.state = None  # a draft head's: inputs beside `unseen`, and for the next guess
        self.fed_guesses = 0  # guesses of the last proposal that went through the model
        self.tree = None  # the last proposal's tree: tokens, parents, and each node's slot past `length` or None

    def propose(self, k, sampling, generator, keep_guessing=None):
        proposal = propose_together([Ask(self, k, sampling, generator, keep_guessing)])[0]
        return proposal.drafts, proposal.q

    def fed(self, n, logits, state):
        """n tokens went through the draft: the logits and (a head's) state for the next guess."""
        self.next_logits, self.state = logits, state
        self.length += n
        self.calls += 1

    def accept(self, tokens, tokens_on_device, seen=None):
        # the cache keeps the accepted guesses it has seen; the rest is fed at the next proposal
        keep = min(len(tokens) - 1, self.fed_guesses)
        self.length -= self.fed_guesses - keep
        keep += self.keep_path(tokens[:-1])
        new = tokens_on_device[keep:].view(-1)
        self.unseen = new if self.unseen is None else torch.cat([self.unseen, new])
        self.next_logits = None  # known only after the unseen tokens go through the model

    def keep_path(self, accepted):
        """After a tree: the accepted path's fed nodes move into place after the row's length. How many."""
        if self.tree is None:
            return 0
        tokens, parents, slots = self.tree
        self.tree, at, kept = None, -1, []
        for token in accepted:  # a node's children are distinct tokens: the path is found by its tokens
            at = next((j for j in children_of(parents, at) if tokens[j] == token), None)
            if at is None or slots[at] is None:
                break
            kept.append(self.length + slots[at])
        self.model.keep(self.row, kept, self.length)
        self.length += len(kept)
        return len(kept)


# More unseen tokens than this go through a row's own eager forward: no graph per width, no padding.
CATCH_UP_TOGETHER = 2


def forward(model, feeds, lengths, parents=None, inputs=None, hidden=False, **options):
    """One decode_rows over each row's feed (1-D ids or None) at its length: (logits, hidden states or None)."""
    tokens, widths = model.padded(feeds)
    inputs = None if inputs is None else model.padded(inputs)[0]
    out = model.decode_rows(Feed(tokens, lengths, widths, parents, inputs), hidden=hidden, **options)
    return out if hidden else (out, None)


def feed(model, drafters, feeds, inputs=None, first_row=None):
    """One draft forward of feeds[i] (or None) at each row's length; `first_row`: its row alone, eager."""
    alone, heads = first_row is not None, inputs is not None
    last = alone or heads  # only the last position's logits are computed
    logits, states = forward(model, feeds, [d.length for d in drafters], inputs=inputs, hidden=heads,
                             first_row=first_row or 0, logits_for=1 if last else None, eager=alone)
    for i, (drafter, f) in enumerate(zip(drafters, feeds)):
        if f is not None:
            drafter.fed(len(f), logits[i, -1 if last else len(f) - 1], None if states is None else states[i, -1])


def propose_together(asks):
    """Each row's Proposal (one Ask per cache row) from shared draft forwards, each row drawing as it would alone."""
    drafters = [ask.drafter for ask in asks]
    model, heads = drafters[0].model, bool(drafters[0].reads_states)  # a head's own forwards return its states
    for drafter in drafters:
        drafter.fed_guesses, drafter.tree = 0, None
    going = [ask for ask in asks if ask.k > 0]  # k = 0: the tokens accepted meanwhile wait in `unseen`
    catch_up_all(model, drafters, [ask.drafter for ask in going], heads)
    going = [ask for ask in going if ask.drafter.next_logits is not None]  # a head before the target's first states
    proposals = draft_chains(model, drafters, [ask for ask in going if not ask.tree], heads)
    proposals.update(draft_trees(model, drafters, [ask for ask in going if ask.tree], heads))
    empty = Proposal(torch.zeros(0, dtype=torch.long, device=model.device), None)
    return [proposals.get(id(d), empty) for d in drafters]


def catch_up_all(model, drafters, waiting, heads):
    """The `waiting` rows' unseen tokens through the draft: a few in one shared forward, more alone."""
    waiting = [d for d in waiting if d.unseen is not None]
    for drafter in [d for d in waiting if len(d.unseen) > CATCH_UP_TOGETHER]:
        feed(model, [drafter], [drafter.unseen], [drafter.unseen_states] if heads else None, drafter.row)
        drafter.unseen = drafter.unseen_states = None
    if any(d.unseen is not None for d in waiting):
        feed(model, drafters, [d.unseen if d in waiting else None for d in drafters],
             [d.unseen_states if d in waiting else None for d in drafters] if heads else None)
        for drafter in waiting:
            drafter.unseen = drafter.unseen_states = None


def draft_chains(model, drafters, going, heads):
    """Algorithm 1's chains for the Asks `going`: {id(drafter): Proposal}, each guess drawn from q."""
    drafts, qs = {id(ask.drafter): [] for ask in going}, {id(ask.drafter): [] for ask in going}
    while going:
        still = []
        for ask in going:
            drafter, sampling = ask.drafter, ask.sampling
            logits, guesses, q = drafter.next_logits, drafts[id(drafter)], qs[id(drafter)]
            if ask.counts is not None:  # the target's penalties, so that its p and this q agree as often
                logits = penalized(logits, sampling, ask.counts, guesses)
            if ask.grammar is not None:  # the target's grammar, so that every guess is one it can accept
                logits = ask.grammar.mask_after(logits, guesses)
            if sampling.greedy:  # q is one-hot at the argmax, and so is every sample from it
                guesses.append(logits.argmax(-1))
            else:
                q.append(adjust(logits, sampling))
                guesses.append(sample(q[-1], ask.noise or ask.generator, at=len(guesses)))
            if ask.keep_guessing:  # the draft's probability of its guess (a host read: for CPUs, where it is free)
                sure = float(logits.float().softmax(-1).max()) if sampling.greedy else float(q[-1][guesses[-1]])
                if not ask.keep_guessing(len(guesses), sure):
                    continue
            if len(guesses) < ask.k:  # the last guess is never fed: the target decides what follows it
                still.append(ask)
        going = still
        if going:
            fed = {id(ask.drafter) for ask in going}
            feed(model, drafters, [drafts[id(d)][-1].view(1) if id(d) in fed else None for d in drafters],
                 [d.state.view(1, -1) if id(d) in fed else None for d in drafters] if heads else None)
            for ask in going:
                ask.drafter.fed_guesses += 1
    return {key: Proposal(torch.stack(guesses), torch.stack(qs[key]) if qs[key] else None)
            for key, guesses in drafts.items()}


def penalized(logits, sampling, counts, guesses):
    """A draft's logits penalized as the target's are, its guesses so far counted (where vocabularies match)."""
    if logits.shape[-1] != counts.generated.shape[-1]:
        return logits
    generated = counts.generated
    if guesses:
        generated = generated.index_put((torch.stack(guesses),), generated.new_ones(()), accumulate=True)
    return penalize(logits, sampling, generated, counts.prompt)


TREE_WIDTH = 4  # children per node and nodes expanded per depth: wider trees stop paying for their forwards


class DraftTree:
    """One row's growing tree: its fed nodes in cache-slot order past the row's length, their parents, states."""

    def __init__(self, ask):
        self.drafter, self.sampling, self.generator = ask.drafter, ask.sampling, ask.noise or ask.generator
        self.depth = min(ask.k, ask.tree)  # a node deeper than the budget would need more ancestors than it allows
        width = min(TREE_WIDTH, ask.tree)
        self.growth = Growth(ask.tree, width) if ask.sampling.greedy else DrawnGrowth(ask.tree, width, self.depth)
        self.fed, self.fed_parents, self.states = [], [], {}
        # the expanded nodes' slots, past the row's length: its cache row's room (the budget is the target's)
        self.room = ask.drafter.model.cache_max_seq_len - ask.drafter.length


def draft_trees(model, drafters, asks, heads):
    """EAGLE-2's dynamic draft tree for each Ask, one shared draft forward a depth: {id(drafter): Proposal}."""
    trees = {id(ask.drafter): DraftTree(ask) for ask in asks}
    add_children([(tree, -1, tree.drafter.next_logits) for tree in trees.values()])
    for depth in range(1, max((tree.depth for tree in trees.values()), default=0)):
        expanding = {key: tree.growth.expand()[:max(tree.room - len(tree.fed), 0)] for key, tree in trees.items()
                     if depth < tree.depth}
        expanding = {key: nodes for key, nodes in expanding.items() if nodes}
        if not expanding:
            break
        feeds, parents, inputs = [None] * len(drafters), [[]] * len(drafters), [None] * len(drafters)
        lengths = [d.length for d in drafters]
        growing = [(i, trees[id(d)], expanding[id(d)]) for i, d in enumerate(drafters) if id(d) in expanding]
        for i, tree, nodes in growing:
            up = [tree.growth.parents[j] for j in nodes]
            lengths[i] += len(tree.fed)
            feeds[i] = to_device([tree.growth.tokens[j] for j in nodes], model.device)
            tree.fed_parents += [-1 if parent < 0 else tree.fed.index(parent) for parent in up]
            tree.fed += nodes
            parents[i] = tree.fed_parents
            if heads:  # a node reads its parent's predicted state (the root: the drafter's)
                inputs[i] = torch.stack([tree.drafter.state if parent < 0 else tree.states[parent] for parent in up])
        logits, states = forward(model, feeds, lengths, parents, inputs if heads else None, heads)
        scored = []
        for i, tree, nodes in growing:
            tree.drafter.calls += 1
            scored += [(tree, node, logits[i, j]) for j, node in enumerate(nodes)]
            if heads:
                tree.states.update((node, states[i, j]) for j, node in enumerate(nodes))
        add_children(scored)
    out = {}
    for key, tree in trees.items():
        chosen, slots = tree.growth.chosen(), {node: slot for slot, node in enumerate(tree.fed)}
        tokens, parents = tree.growth.best(chosen)
        q = None if tree.sampling.greedy else tree.growth.q_rows(chosen)
        out[key] = Proposal(to_device(tokens, model.device), q, tree_or_chain(parents))
        if not heads:  # a head's nodes read predicted states: accepted ones go through it again with real ones
            tree.drafter.tree = tokens, parents, [slots.get(node) for node in chosen]
    return out


def add_children(scored):
    """Children for scored (tree, node, logits after it): the best (greedy, one host transfer), else draws."""
    drawing = {}  # tree -> (an expanded node, the logits after it) for each
    for tree, node, logits in scored:
        if not tree.sampling.greedy:
            drawing.setdefault(tree, []).append((node, logits))
    for tree, pairs in drawing.items():
        nodes, rows = zip(*pairs)
        tree.growth.draw(nodes, adjust(torch.stack(rows), tree.sampling), tree.generator)
    scored = [(tree, node, logits) for tree, node, logits in scored if tree.sampling.greedy]
    best = [best_children(logits, tree.sampling, tree.growth.width) for tree, _, logits in scored]
    if not best:
        return
    host = iter(torch.cat([torch.cat([values.double(), indices.double()]) for values, indices in best]).tolist())
    for (tree, node, _), (values, _) in zip(scored, best):
        scores = list(islice(host, len(values)))
        tree.growth.add(node, [int(t) for t in islice(host, len(values))], scores)


def propose_all(asks):
    """Every row's Proposal (one Ask per cache row, all of one kind of drafter)."""
    if isinstance(asks[0].drafter, ModelDrafter):
        return propose_together(asks)
    if hasattr(asks[0].drafter, "propose_rows"):  # several drafters' guesses in one tree (mixed.py; no cycle)
        return asks[0].drafter.propose_rows(asks, propose_all)
    return [Proposal(*ask.drafter.propose_tree(ask.k, ask.tree, ask.sampling)) if ask.tree and ask.k
            else Proposal(*ask.drafter.propose(ask.k, ask.sampling, generator_of(ask), ask.keep_guessing))
            for ask in asks]


def generator_of(ask):
    """A coupled row's Noise for a `positional` drafter (Medusa's heads), else the row's generator."""
    return ask.noise if ask.noise is not None and getattr(ask.drafter, "positional", False) else ask.generator


MODEL_FREE_NAMES = ("ngram", "lookup", "suffix")  # decoding/lookup.py's and decoding/suffix.py's
