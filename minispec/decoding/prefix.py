"""Prefix caching: a prompt's stored keys and values, in CPU blocks of BLOCK tokens in a tree per model (LRU
evicted), are copied instead of recomputed: row-invariant forwards make the output a cold run's. Rows of one
prompt that join together share its forward. Not for encoder-decoders, TP shards or states readers."""

import threading
import weakref
from collections import OrderedDict

import torch

from ..models.base import Feed

BLOCK = 16  # tokens per stored block: what a prompt shares is reused up to its last whole block


class Node:
    """A stored block: its tokens and their keys and values [layers, 2, heads, BLOCK, head_dim] on the CPU."""
    __slots__ = ("parent", "tokens", "children", "kv")

    def __init__(self, parent, tokens, kv):
        self.parent, self.tokens, self.children, self.kv = parent, tokens, {}, kv

    @property
    def bytes(self):
        return self.kv.numel() * self.kv.element_size() if self.kv is not None else 0


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
        """A joining request's cache rows take its prompt's stored prefix (stats["cached_tokens"])."""
        request, drafter, cached = row.request, row.drafter, 0
        prompt = request.prompt_ids.view(-1).tolist()[:-1]  # the last token is computed: its logits are needed
        if not request.reads_states and usable(request.target):
            cached = self.restore(request.target, row.slot, prompt)
            row.length, row.unseen = cached, row.unseen[cached:]
            if drafter is not None and usable(drafter.model):
                drafter.length = self.restore(drafter.model, drafter.row, prompt)
                drafter.unseen = drafter.unseen[drafter.length:]
        row.stats["cached_tokens"] = cached

    def finish(self, row):
        """An ended request's blocks that each cache row holds for sure are stored."""
        request, drafter = row.request, row.drafter
        tokens = request.prompt_ids.view(-1).tolist() + row.tokens[:-1]
        if request.reads_states or not usable(request.target):
            return
        # a row that stopped holds its last step's rejected guesses past its kept tokens: not stored
        self.store(request.target, row.slot, tokens[:row.length])
        if drafter is not None and usable(drafter.model):  # a draft's tree nodes lie past its length
            self.store(drafter.model, drafter.row, tokens[:drafter.length])

    def restore(self, model, row, tokens):
        """Copy the longest stored prefix of `tokens` into the model's cache row `row`; its length."""
        with self.lock:
            chain = self.stored(model, tokens)
            if not chain:
                return 0
            kv = torch.cat([node.kv for node in chain], dim=3).to(model.device)
        length = len(chain) * BLOCK
        for cache, layer in zip(model.kv_caches(), kv):
            cache.k[row, :, :length] = layer[0]
            cache.v[row, :, :length] = layer[1]
        return length

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

    def store(self, model, row, tokens):
        """Store the whole blocks of `tokens` (held in cache row `row`) not stored yet."""
        with self.lock:
            chain, blocks = self.stored(model, tokens), len(tokens) // BLOCK
            if len(chain) == blocks:
                return
            node, start, caches = chain[-1] if chain else self.root(model), len(chain) * BLOCK, model.kv_caches()
            kv = torch.stack([torch.stack([c.k[row, :, start:blocks * BLOCK], c.v[row, :, start:blocks * BLOCK]])
                              for c in caches]).cpu()
            for i, part in enumerate(kv.split(BLOCK, dim=3)):
                part = part.clone()  # its own storage, freed when it is evicted
                if not self.make_room(part.numel() * part.element_size(), node):
                    return
                key = tuple(tokens[start + i * BLOCK:start + (i + 1) * BLOCK])
                node.children[key] = node = Node(node, key, part)
                self.lru[node] = None
                self.bytes += node.bytes

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
