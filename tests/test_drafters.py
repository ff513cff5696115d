"""Model-free drafters on their own: the lookup index against a brute-force scan, and ngram's q."""

import random

import torch

from minispec.drafters import LookupDrafter, NgramDrafter
from minispec.sampling import Sampling


def scan_continuation(context, k, max_ngram=3):
    """The definition: what followed the most recent earlier occurrence of the longest suffix (<=
    max_ngram tokens), copied one token at a time so that the copy may read its own output."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                copied = list(context)
                for i in range(k):
                    copied.append(copied[start + n + i])
                return copied[len(context):]
    return []


def test_lookup_index_equals_a_scan_of_the_context():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many repeats, overlapping matches
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        drafter = LookupDrafter(vocab, "cpu")
        drafter.start(torch.tensor(tokens[:1]), 0)
        for i in range(1, len(tokens)):
            k = rng.randrange(1, 6)
            assert drafter.continuation(k) == scan_continuation(tokens[:i], k), (tokens[:i], k)
            drafter.accept(tokens[i:i + 1], None)


def test_lookup_copy_continues_a_short_cycle():
    """A pattern repeating with period 3 < k: the copy reaches the context's end and goes on."""
    drafter = LookupDrafter(10, "cpu")
    drafter.start(torch.tensor([9, 1, 2, 3, 1, 2, 3, 1]), 0)
    assert drafter.continuation(7) == [2, 3, 1, 2, 3, 1, 2]
    drafter.start(torch.tensor([4, 5, 4]), 0)  # the match is one token back: period 2
    assert drafter.continuation(3) == [5, 4, 5]


def test_lookup_proposes_a_one_hot_q():
    drafter = LookupDrafter(10, "cpu")
    drafter.start(torch.tensor([1, 2, 3, 4, 1, 2]), 0)
    drafts, q = drafter.propose(3, Sampling(), None)
    assert drafts.tolist() == [3, 4, 1]
    assert torch.equal(q, torch.nn.functional.one_hot(drafts, 10).float())


def test_ngram_q_is_the_normalized_bigram_counts():
    drafter = NgramDrafter(6, "cpu")
    drafter.start(torch.tensor([1, 2, 1, 3, 1, 2, 4, 1]), 0)
    generator = torch.Generator().manual_seed(0)
    drafts, q = drafter.propose(1, Sampling(temperature=1.0), generator)
    # after token 1 came 2, 3, 2: q = (2/3 at 2, 1/3 at 3)
    torch.testing.assert_close(q[0], torch.tensor([0, 0, 2 / 3, 1 / 3, 0, 0]))
    greedy, q = drafter.propose(2, Sampling(), generator)
    assert greedy.tolist() == [2, 1]  # argmax after 1 is 2; after 2 came 1 and 4, first max wins
