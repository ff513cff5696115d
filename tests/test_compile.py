"""torch.compile'd decoding: identical tokens to eager, and no recompilation after warm-up."""

import pytest
import torch
from torch._dynamo.utils import counters

import minispec
from conftest import make_reference, save_reference

PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_reference(make_reference("llama_gqa"), tmp_path_factory.mktemp("llama_gqa"))


def test_compiled_decoding_matches_eager_and_never_recompiles(checkpoint):
    eager_target, eager_draft = minispec.load(checkpoint), minispec.load(checkpoint)
    target, draft = minispec.load(checkpoint, compile=True), minispec.load(checkpoint, compile=True)
    settings = {"gamma": 3, "max_new_tokens": 24, "ignore_eos": True}

    # Warm-up compiles one graph per token width: verify (γ+1), draft steps (1, and 2 after a fully
    # accepted block), and the narrower verifies at the end of a request.
    warm = minispec.generate(target, PROMPT, draft=draft, **settings)
    assert warm.tokens == minispec.generate(eager_target, PROMPT, draft=eager_draft, **settings).tokens
    assert warm.stats["acceptance_rate"] == 1.0
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2

    # A new request with another prompt length and a sampled autoregressive run: same graphs only.
    with torch._dynamo.config.patch(error_on_recompile=True):
        longer = PROMPT + [3, 4, 30]
        out = minispec.generate(target, longer, draft=draft, **settings)
        plain = minispec.generate(target, longer, max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=1)
    assert counters["stats"]["unique_graphs"] == graphs
    assert out.tokens == minispec.generate(eager_target, longer, draft=eager_draft, **settings).tokens
    assert plain.tokens == minispec.generate(eager_target, longer, max_new_tokens=24, ignore_eos=True,
                                             temperature=1.0, seed=1).tokens
