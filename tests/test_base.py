"""The shared model interface (models/base.py), for every family: prefill can skip the output head for
positions whose logits nobody reads, without changing the cache or the logits it does return."""

import pytest
import torch

import minispec
from conftest import TINY_CONFIGS

PROMPT = torch.tensor([[5, 17, 33, 8, 90, 41, 2, 63]])
DECODER = torch.tensor([[0, 5, 17, 33, 8, 90]])  # T5: decoder tokens after the encoded prompt


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_prefill_logits_for_the_last_positions_only(reference_dirs, kind):
    model = minispec.load(reference_dirs[kind][1])
    model.setup_caches(1, 16)
    start = model.encode(PROMPT)
    tokens = DECODER if model.is_encoder_decoder else start
    full = model.prefill(tokens)
    after_full = model.decode(torch.tensor([[7]]))
    for logits_for in (0, 1, 3):
        last = model.prefill(tokens, logits_for=logits_for)
        assert last.shape == (1, logits_for, model.vocab_size)
        torch.testing.assert_close(last, full[:, full.shape[1] - logits_for:], atol=1e-5, rtol=0)
        assert model.length == tokens.shape[1]  # the cache holds every token, whatever was returned
        torch.testing.assert_close(model.decode(torch.tensor([[7]])), after_full, atol=1e-5, rtol=0)
