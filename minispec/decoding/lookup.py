"""The drafters that read only the text, on the host: paper 3.6's bigram model (ngram) and prompt lookup
(lookup), which copies what followed the latest earlier occurrence of the context's last tokens."""

from collections import Counter, defaultdict
from itertools import islice
from typing import NamedTuple

import torch

from ..models.kernels import to_device
from .sampling import Sampling, adjust, sample
from .tree import KeptTree, PreviewedTree, best_first, first_of, likeliest, tree_or_chain

TREE_OCCURRENCES = 32  # the most earlier occurrences lookup's tree counts (LookupDrafter.preview_tree)


class Preview(NamedTuple):
    """A text drafter's next guesses and its confidence in each."""
    guesses: list
    confidences: list


class TextDrafter:
    """What the text drafters share (suffix.py's too): no model or cache; a step's tree is its preview's first nodes."""

    model, encoder_calls, reads_states, calls = None, 0, False, 0

    def propose(self, k, sampling, generator, keep_guessing=None):
        return to_device(self.preview(k).guesses if k else [], self.device), None

    def propose_tree(self, k, budget, sampling=None):
        tokens, parents, _ = first_of(self.kept_tree, len(self.context), k, budget) or self.preview_tree(k, budget)
        return to_device(tokens, self.device), None, tree_or_chain(parents)

    def previewed(self, tree, k, budget):
        """Keep a preview_tree's tree for propose_tree, which takes its first nodes."""
        self.kept_tree = KeptTree(len(self.context), k, budget, tree)
        return tree


def trie_of(paths, most):
    """The trie of `paths` ((tokens, match length) each) as a PreviewedTree: a node's confidence is its share
    of its parent's paths times its longest match over `most`."""
    tokens, parents, visits, longest, nodes = [], [], [], [], {}  # nodes: (parent, token) -> node
    for path, matched in paths:
        at = -1
        for token in path:
            if (at, token) not in nodes:
                nodes[at, token] = len(tokens)
                tokens.append(token)
                parents.append(at)
                visits.append(0)
                longest.append(matched)
            at = nodes[at, token]
            visits[at] += 1
    sure = [visits[j] / (len(paths) if parent < 0 else visits[parent]) * longest[j] / most
            for j, parent in enumerate(parents)]
    return PreviewedTree(tokens, parents, sure)


def copy_after(context, end, k):
    """The k tokens after position `end`, continued past the context's end by its own guesses."""
    period = len(context) - 1 - end  # the copy repeats what lies between match and suffix
    return [context[end + 1 + i % period] for i in range(k)]


class NgramDrafter(TextDrafter):
    """Paper 3.6's simplest M_q: the context's bigram counts (unigrams after an unseen token), normalized."""

    name = "ngram"

    def __init__(self, vocab_size, device):
        self.vocab_size, self.device = vocab_size, device

    def start(self, prompt_ids, sampling=Sampling(), row=0):
        self.context = prompt_ids.view(-1).tolist()
        self.kept_tree = None  # the last preview_tree's KeptTree
        self.unigrams, self.bigrams = Counter(), defaultdict(Counter)
        self.counted = 0  # context tokens already counted
        self.ranked = {}  # token (None: the unigrams) -> ranked_successors, until its counts change
        self.generator = None
        # greedy guesses are free to preview; a sample's preview would not show how often it survives
        self.preview = self.greedy_continuation if sampling.greedy else None

    def count(self, context):
        for i in range(self.counted, len(context)):
            self.unigrams[context[i]] += 1
            self.ranked.pop(None, None)
            if i > 0:
                self.bigrams[context[i - 1]][context[i]] += 1
                self.ranked.pop(context[i - 1], None)
        self.counted = len(context)

    def counts_after(self, token):
        counts = self.bigrams.get(token) or self.unigrams
        row = torch.zeros(self.vocab_size)
        row[list(counts)] = torch.tensor(list(counts.values()), dtype=row.dtype)
        return row

    def greedy_continuation(self, k):
        """Greedy's k guesses, each the most counted successor (ties: the smallest id, as argmax), and its share."""
        self.count(self.context)
        guesses, shares, previous = [], [], self.context[-1]
        for _ in range(k):
            counts = self.bigrams.get(previous) or self.unigrams
            previous = min(counts, key=lambda token: (-counts[token], token))
            guesses.append(previous)
            shares.append(counts[previous] / counts.total())
        return Preview(guesses, shares)

    def ranked_successors(self, token):
        """The tokens counted after `token` and their shares, most counted first; kept until the counts change."""
        key = token if token in self.bigrams else None
        ranked = self.ranked.get(key)
        if ranked is None:
            counts = self.bigrams[token] if key is not None else self.unigrams
            total = counts.total()
            ranked = self.ranked[key] = [(t, counts[t] / total) for t in sorted(counts, key=lambda t: (-counts[t], t))]
        return ranked

    def preview_tree(self, k, budget):
        """A tree of at most `budget` guesses, k deep, most probable under the counts first (tree.best_first)."""
        self.count(self.context)
        return self.previewed(best_first(self.context[-1], self.ranked_successors, k, budget), k, budget)

    def propose(self, k, sampling, generator, keep_guessing=None):
        if sampling.greedy:
            return to_device(self.greedy_continuation(k).guesses, self.device), None
        if self.generator is None:
            seed = torch.randint(2**62, (1,), generator=generator, device=generator.device)
            self.generator = torch.Generator().manual_seed(int(seed))
        self.count(self.context)
        drafts, qs, previous = [], [], self.context[-1]
        for _ in range(k):
            q = adjust(self.counts_after(previous).log(), sampling)  # same standardization as p
            previous = int(sample(q, self.generator))
            drafts.append(previous)
            qs.append(q)
        return to_device(drafts, self.device), torch.stack(qs).to(self.device) if qs else None

    def accept(self, tokens, tokens_on_device, seen=None):
        self.context += tokens


class LookupDrafter(TextDrafter):
    """Prompt lookup: what followed the latest earlier occurrence of the context's longest suffix (up to
    `max_ngram` tokens), copied on past the context's end as LZ77 does."""

    name = "lookup"

    def __init__(self, vocab_size, device, max_ngram=3):  # NgramDrafter's signature; no q, so no vocab_size
        self.device, self.max_ngram = device, max_ngram

    def start(self, prompt_ids, sampling=Sampling(), row=0):
        self.context, self.kept_tree = [], None  # kept_tree: as NgramDrafter's
        self.ends = defaultdict(list)  # n-gram -> end positions of its occurrences, oldest first
        self.extend(prompt_ids.view(-1).tolist())

    def extend(self, tokens):
        for token in tokens:
            self.context.append(token)
            end = len(self.context) - 1
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self.ends[tuple(self.context[end + 1 - n:])].append(end)

    def continuation(self, k):
        """The k guesses, and the length of the match they copy (0: none)."""
        for n in range(min(self.max_ngram, len(self.context) - 1), 0, -1):
            ends = self.ends.get(tuple(self.context[-n:]), ())
            if len(ends) > 1:
                return copy_after(self.context, ends[-2], k), n  # ends[-1] is the suffix itself
        return [], 0

    def preview_tree(self, k, budget):
        """The likeliest `budget` nodes, k deep, of the trie of what followed the suffix's latest occurrences."""
        paths = {}  # end -> (what followed, n): a longer suffix's occurrence ends where a shorter one's does
        earlier = ((n, end) for n in range(min(self.max_ngram, len(self.context) - 1), 0, -1)
                   for end in islice(reversed(self.ends.get(tuple(self.context[-n:]), ())), 1, None))
        for n, end in earlier:  # the latest end of the suffix is the suffix itself: skipped
            paths.setdefault(end, (copy_after(self.context, end, k), n))
            if len(paths) == TREE_OCCURRENCES:
                break
        return self.previewed(likeliest(*trie_of(list(paths.values()), self.max_ngram), budget), k, budget)

    def preview(self, k):
        """The guesses, the surer the longer the match they copy."""
        guesses, matched = self.continuation(k)
        return Preview(guesses, [matched / self.max_ngram] * len(guesses))

    def accept(self, tokens, tokens_on_device, seen=None):
        self.extend(tokens)


DRAFTERS = {"ngram": NgramDrafter, "lookup": LookupDrafter}
