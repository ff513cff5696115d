"""Memory stays within its budgets over 10,000 requests: the prefix cache's blocks (decoding/prefix.py),
some with a draft head's states, and the suffix drafter's store (decoding/suffix.py), fed the traffic a
server sees (conversations that grow turn by turn, a shared system prompt, one-off prompts), the data
structures alone."""

import random
import tracemalloc
from types import SimpleNamespace

import torch

from minispec.decoding import suffix
from minispec.decoding.prefix import BLOCK, PrefixCache

REQUESTS = 10_000
MAX_LEN = 128  # the fake model's cache row


def traffic(seed=0):
    """REQUESTS token sequences (prompt and output): a turn of one of 30 conversations (its sequence so far
    and new tokens), a shared system prompt and a new question, or a one-off prompt, in turn."""
    rng, system, conversations = random.Random(seed), list(range(1000, 1040)), [[] for _ in range(30)]
    for i in range(REQUESTS):
        new = [rng.randrange(1000) for _ in range(rng.randrange(4, 24))]
        if i % 3 == 0:  # a conversation that has filled the cache row starts again
            c = rng.randrange(len(conversations))
            conversations[c] = conversations[c] + new if len(conversations[c]) + len(new) <= MAX_LEN else new
            yield conversations[c]
        else:
            yield system + new if i % 3 == 1 else new


class FakeModel:
    """What the prefix cache reads of a model: its caches' keys and values per row and position."""
    is_encoder_decoder, tp, device = False, None, "cpu"

    def __init__(self, layers=2, heads=2, head_dim=4):
        self.caches = [SimpleNamespace(k=torch.randn(1, heads, MAX_LEN, head_dim),
                                       v=torch.randn(1, heads, MAX_LEN, head_dim)) for _ in range(layers)]

    def kv_caches(self):
        return self.caches


def reachable(node):
    stack, seen = [node], []
    while stack:
        node = stack.pop()
        seen.append(node)
        stack += node.children.values()
    return seen[1:]  # not the root


def test_the_prefix_cache_keeps_to_its_budget_over_10000_requests():
    models = [FakeModel(), FakeModel(heads=1)]  # two models' trees share one budget
    cache = PrefixCache(budget_mb=60 * 2 * 2 * 2 * BLOCK * 4 * 4 / 2**20)  # 60 blocks of the first model
    hits = 0
    for i, tokens in enumerate(traffic()):
        model = models[i % 2]
        head = i % 5 == 0  # a draft head's request: the target's states stored beside its blocks, and read
        taps, states = (True, torch.randn(len(tokens), 8)) if head else (None, None)
        length, restored = cache.restore(model, 0, tokens[:-1], taps)
        hits += length > 0
        assert (restored is not None and len(restored) == length) if head and length else restored is None
        cache.store(model, 0, tokens, taps, states)
        assert cache.bytes <= cache.budget
    nodes = [node for model in models for node in reachable(cache.root(model))]
    # every block the trees hold is counted, and nothing evicted is still held
    assert set(nodes) == set(cache.lru) and len(nodes) == len(cache.lru)
    assert cache.bytes == sum(node.bytes for node in nodes) > cache.budget / 2  # it was full, and evicted
    assert any(node.states is not None for node in nodes) and any(node.states is None for node in nodes)
    assert hits > REQUESTS / 4  # the traffic repeats itself: the cache was used, not only filled


def test_the_suffix_store_keeps_to_its_budget_over_10000_requests():
    tracemalloc.start()
    try:
        store, held = suffix.Store(budget=4000), []
        for i, tokens in enumerate(traffic(), 1):
            store.remember(tokens)
            assert store.size == sum(map(len, store.texts)) <= store.budget
            if i % 1000 == 0:
                held.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # the pair index holds the texts' pairs and no key whose occurrences were all evicted
    assert sum(map(len, store.pairs.values())) == sum(len(text) - 1 for text in store.texts)
    assert all(store.pairs.values()) and len(store.pairs) <= store.budget
    # what it holds is replaced, not added to: ~250 bytes a token (suffix.STORE_TOKENS's estimate) from the
    # first thousand requests (when it is full) to the last
    assert max(held) < 1.3 * held[0] and max(held) < 400 * store.budget, held
