"""draft="suffix": prompt lookup across requests, after SuffixDecoding (Oliaro et al.). Real traffic
repeats itself (agent loops resending their conversation, the same code edited again), which lookup,
seeing only the current request, cannot use. Each target has one Store in the process: the prompt and
output of every request that finished (the server's traffic, a library user's earlier calls), at most
STORE_TOKENS tokens, the oldest request evicted first. At each step the drafter finds where the
context's last two tokens occurred, in the store and in the request itself, measures how long a suffix
of the context each occurrence matches, and counts what followed the longest matches in a trie. A
node's confidence is its share of the occurrences through its parent times the match length over
MATCH_MAX, as lookup's, so gamma="auto" and tree="auto" price it as they price lookup; the chain follows
the surest child from the root, the tree is the trie's likeliest nodes. The guesses are deterministic (q
one-hot, reported as None).
"""

import weakref
from collections import Counter, defaultdict, deque
from itertools import islice
from typing import NamedTuple

from .lookup import TextDrafter, copy_after, trie_of
from .sampling import Sampling
from .tree import children_of, likeliest

# The store's budget. A token costs its int, a list slot and an entry in the pair index, and a pair seen
# for the first time a key and a list: ~250 bytes a token in all (~60 MiB at this budget) on varied text.
STORE_TOKENS = 1 << 18
MATCH_MAX = 16  # suffix tokens compared: a match this long is as sure as a match gets
SCANNED = 64  # the latest occurrences of the context's last pair compared, in the store and in the request
OCCURRENCES = 32  # the continuations counted: the longest matches, the request's own and the latest first

STORES = weakref.WeakKeyDictionary()  # target -> its Store: token ids mean nothing under another vocabulary


def store_for(target):
    return STORES.setdefault(target, Store())


class Place(NamedTuple):
    """An occurrence of the context's last pair: its text, where its second token is, how long a suffix
    of the context ends there."""
    text: list
    end: int
    matched: int


class Texts:
    """Token sequences, and where each pair of consecutive tokens occurs in them, oldest first."""

    def __init__(self):
        self.texts, self.size = deque(), 0
        self.pairs = defaultdict(list)  # (a, b) -> (text, position of b) of each occurrence

    def add(self, tokens):
        text = []
        self.texts.append(text)
        self.extend(text, tokens)
        return text

    def extend(self, text, tokens):
        for token in tokens:
            text.append(token)
            if len(text) > 1:
                self.pairs[text[-2], token].append((text, len(text) - 1))
        self.size += len(tokens)

    def drop_oldest(self):
        text = self.texts.popleft()
        for pair, n in Counter(zip(text, text[1:])).items():
            del self.pairs[pair][:n]  # texts are added whole, so the oldest one's occurrences come first
            if not self.pairs[pair]:
                del self.pairs[pair]
        self.size -= len(text)

    def places(self, context):
        """The latest SCANNED occurrences of the context's last pair that something followed, latest first."""
        latest = reversed(self.pairs.get(tuple(context[-2:]), ()))
        return [Place(text, end, matched(text, end, context))
                for text, end in islice(latest, SCANNED) if end < len(text) - 1]


class Store(Texts):
    """Earlier requests' prompts and outputs, at most `budget` tokens: the oldest go first."""

    def __init__(self, budget=STORE_TOKENS):
        super().__init__()
        self.budget = budget

    def remember(self, tokens):
        self.add(tokens[-self.budget:])
        while self.size > self.budget:
            self.drop_oldest()


def matched(text, end, context):
    """How many of the context's last tokens end at text[end] (at most MATCH_MAX, and the whole context)."""
    n, most = 0, min(MATCH_MAX, len(context))
    while n < most and n <= end and text[end - n] == context[-1 - n]:
        n += 1
    return n


def copy_from(place, context, k):
    """Up to k tokens after a place; in the context itself a copy that runs into its end goes on copying
    its own guesses, as lookup's does."""
    return copy_after(context, place.end, k) if place.text is context else place.text[place.end + 1:place.end + 1 + k]


class SuffixDrafter(TextDrafter):
    """The drafter of one request (LookupDrafter's interface), over its target's store and its own context."""

    name = "suffix"

    def __init__(self, target):
        self.store, self.device = store_for(target), target.device

    def start(self, prompt_ids, sampling=Sampling(), row=0):
        self.own = Texts()
        self.context = self.own.add(prompt_ids.view(-1).tolist())
        self.prompt_length = len(self.context)
        self.counted = self.previewed_tree = None  # this step's trie (counts), and its tree (as lookup's)

    def trie(self, k):
        """The continuations (k deep) of the OCCURRENCES places matching the longest suffixes, as a trie:
        tokens, parents, and each node's confidence. Kept for the step's other calls."""
        if self.counted is not None and self.counted[:2] == (len(self.context), k):
            return self.counted[2]
        # (the suffix itself is no place: nothing follows it yet)
        places = self.own.places(self.context) + self.store.places(self.context)
        places = sorted(places, key=lambda place: -place.matched)[:OCCURRENCES]
        trie = trie_of([(copy_from(place, self.context, k), place.matched) for place in places], MATCH_MAX)
        self.counted = len(self.context), k, trie
        return trie

    def preview(self, k):
        """The chain: from the root, each node's surest child (ties: the one counted first), and the
        confidence in each."""
        tokens, parents, sure = self.trie(k)
        guesses, confidences, at = [], [], -1
        while (children := children_of(parents, at)):
            at = max(children, key=lambda j: (sure[j], -j))
            guesses.append(tokens[at])
            confidences.append(sure[at])
        return guesses, confidences

    def preview_tree(self, k, budget):
        """The trie's `budget` likeliest nodes (tree.likeliest)."""
        return self.previewed(likeliest(*self.trie(k), budget), k, budget)

    def accept(self, tokens, tokens_on_device, seen=None):
        self.own.extend(self.context, tokens)

    def finish(self, output):
        """The request ended with `output`: its prompt and output join the store."""
        self.store.remember(self.context[:self.prompt_length] + list(output))
