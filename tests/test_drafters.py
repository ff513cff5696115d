"""Drafters on their own: the lookup index against a brute-force scan, ngram's q, and a draft model's q
against fresh forwards."""

import random

import pytest
import torch
from conftest import make_reference, save_reference

import minispec
from minispec.decoding.drafters import ModelDrafter
from minispec.decoding.lookup import LookupDrafter, NgramDrafter
from minispec.decoding.sampling import Sampling, adjust
from minispec.decoding.speculative import one_hot


def scan_continuation(context, k, max_ngram=3):
    """The definition: what followed the most recent earlier occurrence of the longest suffix (<=
    max_ngram tokens), copied one token at a time so that the copy may read its own output; and
    that suffix's length."""
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == context[-n:]:
                copied = list(context)
                for i in range(k):
                    copied.append(copied[start + n + i])
                return copied[len(context):], n
    return [], 0


def test_lookup_index_equals_a_scan_of_the_context():
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice([2, 3, 5, 20])  # small vocabularies: many repeats, overlapping matches
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        drafter = LookupDrafter(vocab, "cpu")
        drafter.start(torch.tensor(tokens[:1]))
        for i in range(1, len(tokens)):
            k = rng.randrange(1, 6)
            assert drafter.continuation(k) == scan_continuation(tokens[:i], k), (tokens[:i], k)
            drafter.accept(tokens[i:i + 1], None)


def test_lookup_copy_continues_a_short_cycle():
    """A pattern repeating with period 3 < k: the copy reaches the context's end and goes on."""
    drafter = LookupDrafter(10, "cpu")
    drafter.start(torch.tensor([9, 1, 2, 3, 1, 2, 3, 1]))
    assert drafter.continuation(7) == ([2, 3, 1, 2, 3, 1, 2], 3)
    drafter.start(torch.tensor([4, 5, 4]))  # the match is one token back: period 2
    assert drafter.continuation(3) == ([5, 4, 5], 1)


def test_lookup_reports_its_deterministic_guesses_with_q_none():
    drafter = LookupDrafter(10, "cpu")
    drafter.start(torch.tensor([1, 2, 3, 4, 1, 2]))
    drafts, q = drafter.propose(3, Sampling(), None)
    assert drafts.tolist() == [3, 4, 1]
    assert q is None  # one-hot at the guesses; speculative.one_hot builds it when needed


def test_lookup_preview_is_its_guesses_as_sure_as_the_match_is_long():
    drafter = LookupDrafter(10, "cpu")
    drafter.start(torch.tensor([1, 2, 3, 4, 1, 2]))
    assert drafter.preview(3) == ([3, 4, 1], [2 / 3] * 3)  # (1, 2) matched: 2 of the 3 tokens it looks for
    drafter.accept([3, 4, 1], None)
    assert drafter.preview(2) == ([2, 3], [1.0] * 2)
    drafter.accept([9], None)
    assert drafter.preview(2) == ([], [])


def test_ngram_q_is_the_normalized_bigram_counts():
    drafter = NgramDrafter(6, "cpu")
    drafter.start(torch.tensor([1, 2, 1, 3, 1, 2, 4, 1]))
    generator = torch.Generator().manual_seed(0)
    drafts, q = drafter.propose(1, Sampling(temperature=1.0), generator)
    # after token 1 came 2, 3, 2: q = (2/3 at 2, 1/3 at 3)
    torch.testing.assert_close(q[0], torch.tensor([0, 0, 2 / 3, 1 / 3, 0, 0]))
    greedy, q = drafter.propose(2, Sampling(), generator)
    assert greedy.tolist() == [2, 1]  # argmax after 1 is 2; after 2 came 1 and 4, first max wins


def test_ngram_greedy_guesses_and_preview_are_the_argmax_walk_over_its_counts():
    """Greedy ngram guesses on the host equal the argmax walk over q's rows (the sampled path at
    temperature 0 with q built), and its preview is what it proposes; sampled ngram has no preview."""
    context = [7, 1, 2, 1, 3, 1, 2, 4, 1, 5, 5, 2, 4, 4]
    drafter = NgramDrafter(8, "cpu")
    drafter.start(torch.tensor(context), Sampling())
    preview, shares = drafter.preview(6)
    drafts, q = drafter.propose(6, Sampling(), torch.Generator())
    assert q is None and drafts.tolist() == preview
    walk, previous = [], context[-1]
    drafter.count(drafter.context)
    for _ in range(6):
        previous = int(drafter.counts_after(previous).argmax())
        walk.append(previous)
    assert preview == walk == [1, 2, 4, 1, 2, 4]  # after 4 came 1 and 4 (a tie: the smaller wins)
    assert shares == pytest.approx([1 / 2, 2 / 4, 2 / 3] * 2)  # after 1: 2, 3, 2, 5; after 2: 1, 4, 4
    drafter.start(torch.tensor(context), Sampling(temperature=1.0))
    assert drafter.preview is None


@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0, top_k=5)])
def test_model_drafter_q_is_the_drafts_own_distribution(tmp_path, sampling):
    """Over proposals, partial acceptances, rollbacks and steps without guesses: q_i is the draft's
    adjusted distribution after the context and the earlier guesses (a fresh forward computes it),
    and guess i is drawn from q_i (the argmax when greedy)."""
    directory = save_reference(make_reference("llama_gqa"), tmp_path)
    drafter, fresh = ModelDrafter(minispec.load(directory)), minispec.load(directory)
    fresh.ensure_caches(1, 64)
    context = [5, 17, 33, 8, 90, 41]
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        drafter.model.ensure_caches(1, 64)
        drafter.start(torch.tensor([context]))
        # k = 0 (a plain decoding step) at the start, between proposals and several times in a row: the
        # tokens accepted meanwhile must all reach the draft's cache before its next guess
        for k, keep in [(0, 0), (4, 2), (3, 3), (0, 0), (5, 0), (0, 0), (0, 0), (2, 1), (0, 0)]:
            drafts, q = drafter.propose(k, sampling, generator)
            if sampling.greedy:
                assert q is None  # deterministic guesses: q is one-hot at them, not built
                q = one_hot(drafts, fresh.vocab_size)
            for i in range(k):
                logits = fresh.prefill(torch.tensor([context + drafts[:i].tolist()]))[0, -1]
                torch.testing.assert_close(q[i], adjust(logits, sampling), atol=1e-4, rtol=0)
                assert q[i, drafts[i]] > 0
                if sampling.greedy:
                    assert drafts[i] == logits.argmax()
            kept = drafts[:keep].tolist() + [7]  # the target keeps `keep` guesses, then its own token
            drafter.accept(kept, torch.tensor(kept))
            context += kept
