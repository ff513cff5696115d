"""draft="suffix": prompt lookup across requests, after SuffixDecoding (Oliaro et al.): real traffic repeats
itself. Each target has one Store of finished requests' prompts and outputs (at most STORE_TOKENS, oldest
evicted first); a step counts, in a trie, what followed the places in the store and the request that match
the longest suffix of the context, each node as sure as lookup's would be (so the policy prices it alike).

The store is kept beside the profiles (MINISPEC_PROFILES) in a file named by the vocabulary, written whole
when a server stops, the target goes or every SAVE_EVERY seconds: little-endian uint32 ids, never pickle; a
file that is not whole, not this vocabulary's or over the budget is ignored with a note.
"""

import hashlib
import struct
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict, deque
from itertools import accumulate, islice
from pathlib import Path
from typing import NamedTuple

from ..loading.weights import write_whole
from .lookup import Preview, TextDrafter, copy_after, trie_of
from .profiles import folder
from .sampling import Sampling
from .tree import children_of, likeliest

# The store's budget: ~250 bytes a token with the pair index (~60 MiB) on varied text.
STORE_TOKENS = 1 << 18
MATCH_MAX = 16  # suffix tokens compared: a match this long is as sure as a match gets
SCANNED = 64  # the latest occurrences of the context's last pair compared, in the store and in the request
OCCURRENCES = 32  # the continuations counted: the longest matches, the request's own and the latest first
SAVE_EVERY = 60.0  # seconds between saves while requests finish: what a process killed hard can lose
MAGIC = b"minispec suffix store 1\n"
HEADER = len(MAGIC) + 20 + 8  # the magic, the vocabulary's key, the counts of texts and of tokens

STORES = weakref.WeakKeyDictionary()  # target -> its Store: token ids mean nothing under another vocabulary


class StoreFile(NamedTuple):
    """Where a store is kept between processes, and what its vocabulary is: its key and size."""
    path: Path
    key: bytes
    vocab_size: int


def store_for(target):
    """The target's store; a new one starts from its file, if it has one."""
    store = STORES.get(target)
    if store is None:
        store = STORES[target] = Store()
        file = file_of(target)
        if file is not None:
            for text in stored_texts(file, store.budget):
                store.remember(text)
            store.file, store.saved = file, store.changes  # kept from now on
            weakref.finalize(target, store.save)  # when the target goes, or at a library user's exit
    return store


def save_stores():
    """Save every kept store now (a server's shutdown: uvicorn's signal runs no exit hooks)."""
    for store in list(STORES.values()):
        store.save()


def file_of(target):
    """A target's store file, named by its tokenizer's (else its checkpoint's) fingerprint, or None."""
    tokenizer, where = getattr(target, "tokenizer", None), folder()
    vocabulary = tokenizer.fingerprint if tokenizer is not None else getattr(target, "fingerprint", None)
    if where is None or vocabulary is None:
        return None
    key = hashlib.sha256(f"{vocabulary} {target.vocab_size}".encode()).hexdigest()[:20]
    return StoreFile(where / f"suffix-{key}.bin", key.encode(), target.vocab_size)


class Place(NamedTuple):
    """An occurrence of the context's last pair: its text, its second token's place, the suffix matched."""
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
        self.budget, self.file = budget, None  # file: a StoreFile once the store is kept
        self.lock, self.writing = threading.Lock(), threading.Lock()  # the texts; one save at a time
        self.changes, self.saved, self.saved_at = 0, 0, time.monotonic()

    def remember(self, tokens):
        with self.lock:  # a save's snapshot reads the texts on another thread
            self.add(tokens[-self.budget:])
            while self.size > self.budget:
                self.drop_oldest()
            self.changes += 1
        if self.file is not None and time.monotonic() > self.saved_at + SAVE_EVERY:
            self.saved_at = time.monotonic()
            threading.Thread(target=self.save, daemon=True).start()  # the decoding thread goes on meanwhile

    def save(self):
        """Write the texts to the store's file, if they changed since the last save."""
        with self.writing:
            with self.lock:  # texts are never changed once added: a snapshot is the list of them
                if self.file is None or self.changes == self.saved:
                    return
                texts, changes = list(self.texts), self.changes
            lengths, tokens = [len(text) for text in texts], [token for text in texts for token in text]
            counts = struct.pack(f"<II{len(lengths) + len(tokens)}I", len(lengths), len(tokens), *lengths, *tokens)
            try:
                data = MAGIC + self.file.key + counts
                write_whole(self.file.path, lambda file: file.write_bytes(data), sync=True)
            except OSError as error:
                print(f"minispec: cannot keep the suffix store in {self.file.path}: {error.strerror or error}",
                      file=sys.stderr)
                self.file = None  # noted once
            self.saved = changes


def stored_texts(file, budget):
    """The texts in a store's file, oldest first; none if there is no file or it cannot be used (noted)."""
    try:
        with open(file.path, "rb") as f:
            data = f.read(HEADER + 8 * budget + 1)  # no more than a store of `budget` tokens takes
        if len(data) > HEADER + 8 * budget:
            raise ValueError(f"larger than a store of {budget} tokens")
        if not data.startswith(MAGIC):
            raise ValueError("not a suffix store")
        if data[len(MAGIC):HEADER - 8] != file.key:
            raise ValueError("another vocabulary's")
        texts, count = struct.unpack_from("<II", data, HEADER - 8)
        if count > budget:
            raise ValueError(f"{count} tokens, more than a store keeps ({budget})")
        if len(data) != HEADER + 4 * (texts + count):
            raise ValueError("truncated, or longer than it says")
        numbers = struct.unpack_from(f"<{texts + count}I", data, HEADER)
        lengths, tokens = numbers[:texts], numbers[texts:]
        if sum(lengths) != count:
            raise ValueError("its texts' lengths are not its token count")
        if tokens and max(tokens) >= file.vocab_size:
            raise ValueError(f"token id {max(tokens)} is outside the vocabulary ({file.vocab_size} tokens)")
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as error:
        print(f"minispec: ignoring the suffix store {file.path}: {error}", file=sys.stderr)
        return []
    return [list(tokens[end - n:end]) for n, end in zip(lengths, accumulate(lengths))]


def matched(text, end, context):
    """How many of the context's last tokens end at text[end] (at most MATCH_MAX, and the whole context)."""
    n, most = 0, min(MATCH_MAX, len(context))
    while n < most and n <= end and text[end - n] == context[-1 - n]:
        n += 1
    return n


def copy_from(place, context, k):
    """Up to k tokens after a place (in the context itself, copied on as lookup's)."""
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
        self.tries, self.kept_tree = {}, None  # {(context length, depth): this step's trie}; kept_tree: as lookup's

    def trie(self, k):
        """The trie of what follows the OCCURRENCES best-matching places, k deep (kept for the step)."""
        if (key := (len(self.context), k)) in self.tries:
            return self.tries[key]
        # (the suffix itself is no place: nothing follows it yet)
        places = self.own.places(self.context) + self.store.places(self.context)
        places = sorted(places, key=lambda place: -place.matched)[:OCCURRENCES]
        trie = trie_of([(copy_from(place, self.context, k), place.matched) for place in places], MATCH_MAX)
        self.tries = {key: trie}
        return trie

    def preview(self, k):
        """The chain of each node's surest child (ties: the first counted) from the root."""
        tokens, parents, sure = self.trie(k)
        guesses, confidences, at = [], [], -1
        while (children := children_of(parents, at)):
            at = max(children, key=lambda j: (sure[j], -j))
            guesses.append(tokens[at])
            confidences.append(sure[at])
        return Preview(guesses, confidences)

    def preview_tree(self, k, budget):
        """The trie's `budget` likeliest nodes (tree.likeliest)."""
        return self.previewed(likeliest(*self.trie(k), budget), k, budget)

    def accept(self, tokens, tokens_on_device, seen=None):
        self.own.extend(self.context, tokens)

    def finish(self, output):
        """The request ended with `output`: its prompt and output join the store."""
        self.store.remember(self.context[:self.prompt_length] + list(output))
