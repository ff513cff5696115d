"""Prefix caching (minispec.decoding.prefix): a prompt that begins with tokens an earlier request
computed reuses their keys and values, and its output is a cold run's, token for token, in every
dtype, plainly and speculatively, batched; the cache keeps to its budget (least recently used
evicted), counts its hits, and saves the prefill it claims to."""

from types import SimpleNamespace

import pytest
import torch
from conftest import make_reference, noisy_copy, save_reference
from test_serve import alone, checkpoints, expected, serving  # noqa: F401 (fixtures)

import minispec
from minispec.decoding.prefix import BLOCK, Node, PrefixCache

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GREEDY = {"max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{dtype: (target, draft)}: a tiny llama and a noisy copy of it as a draft model."""
    reference = make_reference("llama_gqa")
    target_dir = save_reference(reference, tmp_path_factory.mktemp("target"))
    draft_dir = save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path_factory.mktemp("draft"))
    return {dtype: (minispec.load(target_dir, dtype=dtype), minispec.load(draft_dir, dtype=dtype)) for dtype in DTYPES}


def base_prompt(n=50, seed=0):
    return torch.randint(2, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("draft", [None, "lookup", "model"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_output_equals_a_cold_run(models, dtype, draft):
    """Prompts that share a stored sequence up to its end (a conversation's next turn), the whole of a
    stored prompt, a block edge, one token before it and one past it, and part of a block."""
    target, draft_model = models[dtype]
    settings = {**GREEDY, "draft": draft_model if draft == "model" else draft}
    cache, base = PrefixCache(), base_prompt(4 * BLOCK - GREEDY["max_new_tokens"])  # its last token ends a block
    first = minispec.generate(target, base, prefix_cache=cache, **settings)
    assert first.stats["cached_tokens"] == 0 and cache.bytes > 0
    edge = 2 * BLOCK
    prompts = [base + first.tokens + [5, 6, 7], base, base[:edge], base[:edge - 1], base[:edge + 1],
               base[:edge + 1] + [7, 7], base[:BLOCK + 3] + [9, 9]]
    cold = [minispec.generate(target, prompt, **settings).tokens for prompt in prompts]
    warm = minispec.generate(target, prompts, prefix_cache=cache, batch_size=3, **settings)
    assert [out.tokens for out in warm] == cold
    # all but the prompt's last token, in whole blocks; a batch's rows also reuse what ended before them
    assert warm[0].stats["cached_tokens"] == (len(base) + len(first.tokens) - 1) // BLOCK * BLOCK
    assert warm[1].stats["cached_tokens"] == (len(base) - 1) // BLOCK * BLOCK
    assert [out.stats["cached_tokens"] for out in warm[2:]] == [BLOCK, BLOCK, edge, edge, BLOCK]


@pytest.mark.parametrize("draft", ["lookup", "model"])
def test_a_request_that_stopped_stores_only_what_it_kept(models, draft):
    """A stop among a step's guesses leaves the rejected ones after it in the cache rows: not stored."""
    target, draft_model = models[torch.float32]
    settings = {"max_new_tokens": 24, "draft": draft_model if draft == "model" else draft}
    base = base_prompt(3 * BLOCK - 3)
    stop = minispec.generate(target, base, ignore_eos=True, **settings).tokens[6]
    for gamma in (2, 5, "auto"):
        cache = PrefixCache()
        first = minispec.generate(target, base, prefix_cache=cache, stop_token_ids=[stop], gamma=gamma, **settings)
        prompt = base + first.tokens + [4]
        warm = minispec.generate(target, prompt, prefix_cache=cache, ignore_eos=True, gamma=gamma, **settings)
        assert warm.stats["cached_tokens"] == (len(prompt) - 1) // BLOCK * BLOCK
        assert warm.tokens == minispec.generate(target, prompt, ignore_eos=True, gamma=gamma, **settings).tokens


def test_sampled_output_equals_a_cold_run(models):
    target, draft = models[torch.float32]
    settings = {"max_new_tokens": 10, "ignore_eos": True, "temperature": 1.0, "seed": 5, "draft": draft,
                "gamma": 3}  # "auto" may choose other lengths, which draw otherwise
    cache, base = PrefixCache(), base_prompt()
    minispec.generate(target, base, prefix_cache=cache, **settings)
    warm = minispec.generate(target, base + [3], prefix_cache=cache, **settings)
    assert warm.stats["cached_tokens"] > 0
    assert warm.tokens == minispec.generate(target, base + [3], **settings).tokens


def test_the_budget_holds_and_the_least_recently_used_go(models):
    target = models[torch.float32][0]
    block_bytes = target.kv_bytes_per_position() * BLOCK
    cache = PrefixCache(budget_mb=10 * block_bytes / 2**20)  # room for 9 or 10 blocks
    prompts = [base_prompt(3 * BLOCK + 1, seed) for seed in range(8)]  # 3 blocks each, with their outputs too
    for prompt in prompts:
        minispec.generate(target, prompt, prefix_cache=cache, **GREEDY)
        assert 0 < cache.bytes <= cache.budget
        # the first prompt, used after each other one, is never the least recently used
        assert minispec.generate(target, prompts[0], prefix_cache=cache, **GREEDY).stats["cached_tokens"] == 3 * BLOCK
    assert cache.bytes == sum(node.bytes for node in cache.lru) == len(cache.lru) * block_bytes
    assert minispec.generate(target, prompts[-1], prefix_cache=cache, **GREEDY).stats["cached_tokens"] == 3 * BLOCK
    assert minispec.generate(target, prompts[1], prefix_cache=cache, **GREEDY).stats["cached_tokens"] == 0


@pytest.mark.parametrize("counted", ["target", "draft"])
def test_a_hit_computes_only_the_rest_of_the_prompt(models, monkeypatch, counted):
    """The target's positions computed, and a draft model's (its guesses are the same, so only its
    prompt's forward shrinks)."""
    target, draft = models[torch.float32]
    model, computed = target if counted == "target" else draft, []
    forward = model.forward

    def counting(tokens, *args, **kwargs):
        computed.append(tokens.shape[1])
        return forward(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counting)
    settings = {"max_new_tokens": 4, "draft": draft, "gamma": 3}
    cache, prompt = PrefixCache(), base_prompt(4 * BLOCK + 5)
    minispec.generate(target, prompt[:3 * BLOCK], prefix_cache=cache, max_new_tokens=1)
    minispec.generate(target, prompt[:3 * BLOCK], prefix_cache=cache, **settings)  # the draft's blocks
    computed.clear()
    cold = minispec.generate(target, prompt, **settings)
    cold_positions, computed[:] = sum(computed), []
    warm = minispec.generate(target, prompt, prefix_cache=cache, **settings)
    assert warm.tokens == cold.tokens and warm.stats["cached_tokens"] == 3 * BLOCK
    assert sum(computed) == cold_positions - 3 * BLOCK


def test_t5_computes_its_prompt(tmp_path):
    target = minispec.load(save_reference(make_reference("t5_v1_1"), tmp_path))
    cache, prompt = PrefixCache(), base_prompt(40)
    first = minispec.generate(target, prompt, prefix_cache=cache, **GREEDY)
    again = minispec.generate(target, prompt, prefix_cache=cache, **GREEDY)
    assert again.tokens == first.tokens and again.stats["cached_tokens"] == 0 and cache.bytes == 0


@pytest.mark.parametrize("call", [lambda t: minispec.generate(t, [5, 6], prefix_cache="yes"),
                                  lambda t: PrefixCache(budget_mb=-1)])
def test_bad_input_is_named(models, call):
    with pytest.raises(ValueError, match="prefix cache|prefix_cache"):
        call(models[torch.float32][0])


def test_the_server_reuses_a_conversation_and_reports_it(checkpoints, alone):  # noqa: F811
    chat = [{"role": "system", "content": "Be brief. You are a helpful AI assistant. " * 3},
            {"role": "user", "content": "the cat sat on the mat?"}]
    greedy = {"max_tokens": 12, "temperature": 0}
    with serving(checkpoints) as client:
        first = client.post("/v1/chat/completions", json={"messages": chat, **greedy}).json()
        chat += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "and the dog?"}]
        second = client.post("/v1/chat/completions", json={"messages": chat, **greedy}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= BLOCK
    assert second["choices"][0]["message"]["content"] == expected(alone, chat, max_new_tokens=12).text


def test_a_models_tree_is_emptied_when_its_caches_change_dtype():
    class Model:  # what root() reads: its caches' dtype and shapes
        dtype = torch.float32

        def kv_caches(self):
            return [SimpleNamespace(k=torch.zeros(1, 2, 4, 8, dtype=self.dtype))]

    model, cache = Model(), PrefixCache()
    root = cache.root(model)
    block = root.children[(1,)] = Node(root, (1,), torch.zeros(3))
    cache.lru[block], cache.bytes = None, block.bytes
    assert cache.root(model) is root
    model.dtype = torch.bfloat16
    assert cache.root(model) is not root and cache.bytes == 0 and not cache.lru and not root.children
