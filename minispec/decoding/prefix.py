"""Prefix caching: a prompt's stored keys and values, in CPU blocks of BLOCK tokens in a tree per model (LRU
evicted), are copied instead of recomputed: row-invariant forwards make the output a cold run's. A draft head
reads the target's states at every token: they are stored beside the blocks, and fed to it as a cold run's
would be. Rows of one prompt that join together share its forward. Not for encoder-decoders, TP shards or an
on_states caller (who asked for the states of every token)."""

import threading
import weakref
from collections import OrderedDict
from itertools import takewhile

import torch

from ..models.base import Feed

BLOCK = 16  # tokens per stored block: what a prompt shares is reused up to its last whole block


class Node:
    """A stored block: its tokens and their keys and values [layers, 2, heads, BLOCK, head_dim] on the CPU, and
    the target's states there [BLOCK, width] for a draft head that reads `taps` (drafters.py's reads_states)."""
    __slots__ = ("parent", "tokens", "children", "kv", "taps", "states")

    def __init__(self, parent, tokens, kv, taps=None, states=None):
        self.parent, self.tokens, self.children, self.kv = parent, tokens, {}, kv
        self.taps, self.states = taps, states

    @property
    def bytes(self):
        return sum(t.numel() * t.element_size() for t in (self.kv, self.states) if t is not None)


class PrefixCache:
    """Blocks of keys and values of the sequences decoded, within `budget_mb` MiB (least recently used
    evicted). Pass it to generate(..., prefix_cache=) or engine.decode."""

    def __init__(self, budget_mb=512):
        if not isinstance(budget_mb, (int, float)) or budget_mb < 0:
            raise ValueError(f"the prefix cache's budget must be a number of MiB >= 0, got {budget_mb!r}")
        self.budget, self.bytes = int(budget_mb * 2**20), 0
        self.roots = weakref.WeakKeyDictionary()  # model -> (its caches' layout, the root Node)
        self.lru = OrderedDict()  # every stored Node, least recently used first
        self.lock = threading.Lock()  # one cache may serve decoding threads of different models

    def admit(self, row):
        """A joining request's cache rows take its prompt's stored prefix (stats["cached_tokens"]); a draft
        head, the target's states there, fed to it with the target's first states (heads/eagle.py)."""
        request, drafter, cached = row.request, row.drafter, 0
        prompt = request.prompt_ids.view(-1).tolist()[:-1]  # the last token is computed: its logits are needed
        taps = head_taps(request)
        if caching(request):
            cached, states = self.restore(request.target, row.slot, prompt, taps)
            row.length, row.unseen = cached, row.unseen[cached:]
            if taps is not None:  # the row keeps the states at its tokens, for finish() to store
                row.states = [] if states is None else [states]
                drafter.held = None if states is None else (request.prompt_ids.view(-1)[1:cached + 1], states)
            elif drafter is not None and usable(drafter.model):
                drafter.length = self.restore(drafter.model, drafter.row, prompt)[0]
                drafter.unseen = drafter.unseen[drafter.length:]
        row.stats["cached_tokens"] = cached

    def finish(self, row):
        """An ended request's blocks that each cache row holds for sure are stored."""
        request, drafter = row.request, row.drafter
        if not caching(request):
            return
        tokens, taps = request.prompt_ids.view(-1).tolist() + row.tokens[:-1], head_taps(request)
        # a row that stopped holds its last step's rejected guesses past its kept tokens: not stored
        # on the CPU in one copy, where its blocks are stored
        states = torch.cat(row.states).cpu() if taps is not None and row.states else None
        self.store(request.target, row.slot, tokens[:row.length], taps, states)
        if taps is None and drafter is not None and usable(drafter.model):  # tree nodes lie past its length
            self.store(drafter.model, drafter.row, tokens[:drafter.length])

    def restore(self, model, row, tokens, taps=None):
        """Copy the longest stored prefix of `tokens` (with `taps`: whose blocks hold those states) into the
        model's cache row `row`: its length, and the states there (a tensor, or None)."""
        with self.lock:
            chain = self.stored(model, tokens)
            if taps is not None:
                chain = list(takewhile(lambda node: node.taps == taps, chain))
            if not chain:
                return 0, None
            kv = torch.cat([node.kv for node in chain], dim=3).to(model.device)
            states = None if taps is None else torch.cat([node.states for node in chain]).to(model.device)
        length = len(chain) * BLOCK
        for cache, layer in zip(model.kv_caches(), kv):
            cache.k[row, :, :length] = layer[0]
            cache.v[row, :, :length] = layer[1]
        return length, states

    def stored(self, model, tokens):
        """The stored blocks `tokens` begins with, marked as used (parents first: never older than a child)."""
        node, chain = self.root(model), []
        for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
            node = node.children.get(tuple(tokens[start:start + BLOCK]))
            if node is None:
                break
            chain.append(node)
            self.lru.move_to_end(node)
        return chain

    def store(self, model, row, tokens, taps=None, states=None):
        """Store the whole blocks of `tokens` (held in cache row `row`) not stored yet, with the target's
        `states` at them for a head reading `taps`; stored blocks without those states take them."""
        with self.lock:
            chain, blocks = self.stored(model, tokens), len(tokens) // BLOCK
            for i, node in enumerate(chain if states is not None else ()):
                # a block evicted to make room for an earlier one's states ends the chain
                if node not in self.lru or node.taps != taps and not self.give_states(node, taps, block_of(states, i)):
                    return  # what follows a block without the states is of no use to a head
            if len(chain) == blocks:
                return
            node, start, caches = chain[-1] if chain else self.root(model), len(chain) * BLOCK, model.kv_caches()
            kv = torch.stack([torch.stack([c.k[row, :, start:blocks * BLOCK], c.v[row, :, start:blocks * BLOCK]])
                              for c in caches]).cpu()
            for i, part in enumerate(kv.split(BLOCK, dim=3), len(chain)):
                key = tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
                held = block_of(states, i)  # its own storage, freed when it is evicted
                child = Node(node, key, part.clone(), None if held is None else taps, held)
                if not self.make_room(child.bytes, node):
                    return
                node.children[key] = node = child
                self.lru[node] = None
                self.bytes += node.bytes

    def give_states(self, node, taps, states):
        """A stored block takes a head's states (None: none to give); False if they did not fit."""
        if states is None or not self.make_room(states.numel() * states.element_size(), node):
            return False
        self.bytes -= node.bytes
        node.taps, node.states = taps, states
        self.bytes += node.bytes
        return True

    def root(self, model):
        """The model's tree, emptied if its caches' dtype or shape changed since it was filled."""
        caches = model.kv_caches()
        layout = (caches[0].k.dtype, len(caches), tuple(caches[0].k.shape[1::2]))
        known, root = self.roots.get(model, (None, None))  # its layout when filled, and its root
        if known != layout:
            for child in list(root.children.values()) if root is not None else ():
                self.evict(child)
            root = Node(None, None, None)
            self.roots[model] = layout, root
        return root

    def make_room(self, size, keep):
        """Evict the least recently used blocks until `size` more bytes fit; False if `keep`'s path would go."""
        path = set()
        while keep is not None:
            path.add(keep)
            keep = keep.parent
        while self.bytes + size > self.budget:
            victim = next(iter(self.lru), None)
            if victim is None or victim in path:
                return False
            self.evict(victim)
        return True

    def evict(self, node):
        """Drop a block and the blocks after it."""
        del node.parent.children[node.tokens]
        stack = [node]
        while stack:
            node = stack.pop()
            stack += node.children.values()
            self.bytes -= node.bytes
            self.lru.pop(node, None)


def usable(model):
    """Whether there is a model whose cache holds plain keys and values per position of its tokens."""
    return model is not None and not model.is_encoder_decoder and model.tp is None


def caching(request):
    """Whether a request takes and gives stored blocks: its target's cache holds them, and no on_states caller
    wants states at every prompt token (a draft head gets them from the blocks; a learner, at what it computes)."""
    head = request.drafter is not None and bool(request.drafter.reads_states)
    return usable(request.target) and (request.on_states is None or head)


def head_taps(request):
    """The states a request's draft head reads at every token (drafters.py's reads_states), else None."""
    drafter = request.drafter
    return drafter.reads_states if drafter is not None and drafter.reads_states and drafter.model is not None else None


def block_of(states, i):
    """Block i's rows of `states` [tokens, width] (on the CPU) as a tensor of its own; None where they do not reach."""
    if states is None or len(states) < (i + 1) * BLOCK:
        return None
    return states[i * BLOCK:(i + 1) * BLOCK].clone()


def share_prompt(target, batch):
    """The newest row copies an unstepped row's keys and values of the same prompt (n answers), fed once."""
    row = batch[-1]
    if row.request.reads_states or len(row.unseen) < 2:  # states of every prompt token wanted; T5's one token
        return
    prompt = row.request.prompt_ids
    first = next((other for other in batch[:-1] if not other.stats["target_calls"] and other.length >= row.length
                  and other.length + len(other.unseen) == row.length + len(row.unseen)
                  and torch.equal(other.request.prompt_ids, prompt)), None)
    if first is None:
        return
    if len(first.unseen) > 1:
        shared = first.unseen[:-1]
        target.decode_rows(Feed(shared.view(1, -1), [first.length]), first_row=first.slot, logits_for=1, eager=True)
        first.length, first.unseen = first.length + len(shared), first.unseen[-1:]
    target.move_row(first.slot, row.slot, first.length)  # the positions it holds, not the whole row
    row.length, row.unseen = first.length, first.unseen
    row.stats["shared_tokens"] = first.length
