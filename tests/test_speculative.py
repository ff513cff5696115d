"""Speculative decoding end to end: greedy equivalence with target-only decoding for every family and
drafter, exact sampling, cache truncation, T5 encoder reuse, statistics, and bad input."""

import itertools
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import transformers
from scipy.stats import chisquare
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import minispec
from conftest import save_reference, spread_init, target_and_drafts

TARGETS = ["gpt2", "llama_gqa", "qwen2", "t5_v1_1"]
DRAFTS = ["same", "noisy", "independent", "ngram", "lookup"]
GAMMAS = [1, 2, 3, 5, 8]
# 24 tokens: T5's encoder needs a long enough prompt for its tiny decoder's output to vary.
PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54, 29, 88, 16, 70, 45, 9, 31, 66, 24, 81, 50, 38]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {kind: target_and_drafts(kind, tmp_path_factory) for kind in TARGETS}


def draft_for(models, kind, name):
    return name if name in ("ngram", "lookup") else models[kind][name]


@pytest.mark.parametrize("kind", TARGETS)
def test_greedy_output_equals_target_greedy(models, kind):
    target = models[kind]["target"]
    baseline = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert len(set(baseline.tokens)) >= 8  # a varied continuation makes the comparison meaningful
    for name, gamma in itertools.product(DRAFTS, GAMMAS):
        out = minispec.generate(target, PROMPT, draft=draft_for(models, kind, name), gamma=gamma,
                                max_new_tokens=NEW_TOKENS, ignore_eos=True)
        assert out.tokens == baseline.tokens, f"{kind} with {name} draft, gamma={gamma}"
        rate = out.stats["acceptance_rate"]
        assert out.stats["alpha"] == pytest.approx(rate)  # one-hot p and q: Σ min(p, q) is 1 iff accepted
        if name not in ("ngram", "lookup"):
            # one draft forward per guess: the prompt's forward yields q_1 of the first step, and each
            # later step feeds the tokens accepted since in the forward that yields its q_1
            assert out.stats["draft_calls"] == out.stats["proposed"], f"{kind} with {name} draft, gamma={gamma}"
        if name == "same":
            # every call yields γ + 1 tokens, the first (the prompt's forward) too
            assert rate == 1.0 and out.stats["target_calls"] == -(-NEW_TOKENS // (gamma + 1))
            assert out.stats["first_call_tokens"] == gamma + 1
        if name == "noisy":
            assert rate > 0.5, f"noisy copy should be mostly accepted, got {rate:.2f}"
        if name == "independent":
            assert rate < 0.5, f"independent model should be mostly rejected, got {rate:.2f}"


@pytest.mark.parametrize("kind", TARGETS)
def test_eos_inside_a_draft_block_stops_like_the_baseline(models, kind):
    target = models[kind]["target"]
    tokens = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True).tokens
    eos = next(t for i, t in enumerate(tokens) if i >= 6 and t not in tokens[:i])  # first seen mid-way
    saved = target.eos_token_ids
    target.eos_token_ids = (eos,)
    try:
        baseline = minispec.generate(target, PROMPT, max_new_tokens=NEW_TOKENS)
        assert baseline.tokens == tokens[: tokens.index(eos) + 1]
        for name in ("same", "noisy"):
            out = minispec.generate(target, PROMPT, draft=models[kind][name], gamma=8, max_new_tokens=NEW_TOKENS)
            assert out.tokens == baseline.tokens
    finally:
        target.eos_token_ids = saved


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_reached_inside_a_block(models, max_new_tokens):
    target = models["llama_gqa"]["target"]
    baseline = minispec.generate(target, PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    out = minispec.generate(target, PROMPT, draft=models["llama_gqa"]["same"], gamma=5,
                            max_new_tokens=max_new_tokens, ignore_eos=True)
    assert len(out.tokens) == max_new_tokens and out.tokens == baseline.tokens


@pytest.mark.parametrize("settings", [{"temperature": 1.0}, {"temperature": 0.9, "top_k": 5},
                                      {"temperature": 1.1, "top_p": 0.8}, {"temperature": 0.0}])
def test_draft_with_target_weights_is_always_accepted(models, settings):
    out = minispec.generate(models["qwen2"]["target"], PROMPT, draft=models["qwen2"]["same"], gamma=4,
                            max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=3, **settings)
    assert out.stats["accepted"] == out.stats["proposed"] > 0
    assert out.stats["acceptance_rate"] == 1.0


def test_alpha_matches_acceptance_rate(models):
    """Theorem 3.5 in practice: mean Σ min(p, q) predicts the acceptance rate (>= 500 positions)."""
    totals = {"accepted": 0, "verified": 0, "alpha": 0.0}
    for seed in range(12):
        out = minispec.generate(models["llama_gqa"]["target"], PROMPT, draft=models["llama_gqa"]["noisy"],
                                gamma=4, max_new_tokens=80, temperature=1.0, seed=seed, ignore_eos=True)
        totals["accepted"] += out.stats["accepted"]
        totals["verified"] += out.stats["verified"]
        totals["alpha"] += out.stats["alpha"] * out.stats["verified"]
    assert totals["verified"] >= 500
    rate, alpha = totals["accepted"] / totals["verified"], totals["alpha"] / totals["verified"]
    assert abs(rate - alpha) < 0.05, (rate, alpha)


def test_greedy_verification_is_algorithm_1_with_one_hot_p_and_q():
    """accept_greedy (temperature 0, lenience 1) returns what accept_and_resample returns for the
    one-hot p and q of greedy decoding: random logits with many ties, every number of matching guesses."""
    generator = torch.Generator().manual_seed(0)
    greedy = minispec.sampling.Sampling(temperature=0.0)
    seen = set()
    vocab = 5
    for k, matching, _ in itertools.product(range(1, 7), range(7), range(8)):
        matching = min(matching, k)
        logits = torch.randint(0, 3, (k + 1, vocab), generator=generator).float()  # ties in most rows
        p = minispec.sampling.adjust(logits, greedy)
        drafts = torch.randint(0, vocab, (k,), generator=generator)
        drafts[:matching] = p[:matching].argmax(-1)
        q = torch.nn.functional.one_hot(drafts, vocab).float()
        expected = minispec.speculative.accept_and_resample(p, q, drafts, 1.0, generator)
        got = minispec.speculative.accept_greedy(logits, drafts)
        assert [x.tolist() for x in got] == [x.tolist() for x in expected], (logits, drafts)
        seen.add((k, got[0].item()))
    assert seen == {(k, n) for k in range(1, 7) for n in range(k + 1)}  # every outcome was checked


def test_cache_after_many_rejections_equals_fresh_forward(models):
    target = models["gpt2"]["target"]
    out = minispec.generate(target, PROMPT, draft=models["gpt2"]["independent"], gamma=5,
                            max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0, ignore_eos=True)
    assert out.stats["accepted"] < out.stats["proposed"] // 2  # many rejections, many rollbacks
    sequence = torch.tensor([PROMPT + out.tokens])
    assert target.length == sequence.shape[1] - 1  # everything accepted but the last token
    with torch.inference_mode():
        cached = target.decode(sequence[:, -1:])[0, -1]
        fresh = target.prefill(sequence)[0, -1]
    torch.testing.assert_close(cached, fresh, atol=1e-4, rtol=0)


def test_t5_encoders_run_once_per_request(models):
    out = minispec.generate(models["t5_v1_1"]["target"], PROMPT, draft=models["t5_v1_1"]["noisy"], gamma=3,
                            max_new_tokens=NEW_TOKENS, ignore_eos=True)
    assert out.stats["target_calls"] > 5
    assert out.stats["encoder_calls"] == 1 and out.stats["draft_encoder_calls"] == 1


def test_lenience_raises_acceptance(models):
    pair = models["llama_gqa"]
    rates = [minispec.generate(pair["target"], PROMPT, draft=pair["noisy"], gamma=3, max_new_tokens=60,
                               ignore_eos=True, lenience=lenience, **settings).stats["acceptance_rate"]
             for settings in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 0}) for lenience in (1.0, 0.1)]
    assert rates[1] > rates[0] and rates[3] > rates[2]


class HostSyncs(TorchFunctionMode):
    """Counts what makes the host wait for the device: .tolist() calls, and (through a dispatch mode)
    the ops that read a value on the host (.item(), int(), bool(), indexing with a 0-dim tensor) or
    whose output shape depends on values (nonzero, masked_select, ...)."""

    VALUE_READS = {"item", "_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_consecutive",
                   "unique_dim", "equal", "is_nonzero", "repeat_interleave"}

    def __init__(self):
        super().__init__()
        self.tolist = self.value_reads = 0
        counter = self

        class ValueReads(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter.value_reads += func.overloadpacket.__name__ in HostSyncs.VALUE_READS
                return func(*args, **(kwargs or {}))

        self.dispatch_mode = ValueReads()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.tolist += func is torch.Tensor.tolist
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self.dispatch_mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.dispatch_mode.__exit__(*exc)


@pytest.mark.parametrize("name, settings", [("noisy", {}), ("noisy", {"temperature": 0.8, "top_p": 0.9}),
                                            ("lookup", {})])
def test_one_host_sync_per_step(models, name, settings):
    """The lean loop: each speculative step reads the device once (its .tolist()); besides that, a
    request reads three values however many steps it takes: the prompt's id range, and α at the end.
    (The ngram drafter samples on the host by design, which on a CPU-only machine this cannot tell
    apart from reading the device; tests/test_cuda.py counts real syncs. So does top-p over a vocabulary
    larger than sampling.TOP_P_CANDIDATES on a CPU, and only there: this vocabulary is smaller.)"""
    target, draft = models["llama_gqa"]["target"], draft_for(models, "llama_gqa", name)
    counts = []
    for new_tokens in (8, NEW_TOKENS):
        with HostSyncs() as syncs:
            out = minispec.generate(target, PROMPT, draft=draft, gamma=3, max_new_tokens=new_tokens,
                                    ignore_eos=True, **settings)
        counts.append((out.stats["target_calls"], syncs.tolist, syncs.value_reads))
    (short_steps, short_tolist, short_reads), (long_steps, long_tolist, long_reads) = counts
    assert long_steps >= 10 and long_steps > short_steps
    assert long_tolist - short_tolist == long_steps - short_steps
    assert short_reads <= 3 and long_reads <= 3


@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    """Tiny llama target and independent draft over a 16-token vocabulary."""
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
    pair = []
    for seed in (0, 5):
        torch.manual_seed(seed)
        model = spread_init(transformers.LlamaForCausalLM(config).eval(), seed, gain=1.0)
        pair.append(minispec.load(save_reference(model, tmp_path_factory.mktemp(f"v16_{seed}"))))
    return pair


@pytest.mark.parametrize("drafter, prompt", [("model", [1, 2, 3]), ("lookup", [1, 2, 3, 1, 2])])
def test_joint_distribution_of_two_tokens_is_the_targets(vocab16, drafter, prompt):
    """End to end: 20k speculative samples of (t1, t2) against the exact target joint p(t1) p(t2 | t1),
    with a draft model's q, and with lookup's deterministic guesses (3, 1 here; q one-hot)."""
    target, draft = vocab16
    draft = draft if drafter == "model" else drafter
    settings = {"temperature": 1.0, "top_k": 4}
    sampling = minispec.Sampling(**settings)
    with torch.inference_mode():
        target.ensure_caches(1, 8)
        first = minispec.sampling.adjust(target.prefill(torch.tensor([prompt]))[0, -1], sampling)
        joint = torch.zeros(16, 16)
        for t1 in first.nonzero().view(-1).tolist():
            logits = target.prefill(torch.tensor([prompt + [t1]]))[0, -1]
            joint[t1] = first[t1] * minispec.sampling.adjust(logits, sampling)
    counts = torch.zeros(16, 16)
    draws, accepted = 20_000, Counter()
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=2, max_new_tokens=2, seed=seed,
                                ignore_eos=True, **settings)
        counts[out.tokens[0], out.tokens[1]] += 1
        accepted[out.stats["accepted"]] += 1
    assert accepted[0] > 1000 and accepted[1] > 1000  # both rejections and acceptances were tested
    support = joint > 0
    assert counts[~support].sum() == 0
    expected = joint[support].double() / joint[support].double().sum() * draws
    assert chisquare(counts[support].double().numpy(), expected.numpy()).pvalue > 0.001
    assert 0.5 * (counts / draws - joint).abs().sum() < 0.02  # 16 cells, 20k draws: ~0.008 expected


def test_mismatched_vocabularies_fail_before_generating(models, tmp_path):
    other = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=1, n_head=4)
    small = minispec.load(save_reference(transformers.GPT2LMHeadModel(other), tmp_path))
    with pytest.raises(ValueError, match="different vocabularies"):
        minispec.generate(models["gpt2"]["target"], PROMPT, draft=small)


def test_mismatched_tokenizers_fail_before_generating(models):
    target, draft = models["gpt2"]["target"], models["gpt2"]["independent"]
    target.tokenizer, draft.tokenizer = SimpleNamespace(fingerprint="a1"), SimpleNamespace(fingerprint="b2")
    try:
        with pytest.raises(ValueError, match="different tokenizers"):
            minispec.generate(target, PROMPT, draft=draft)
    finally:
        target.tokenizer = draft.tokenizer = None


def test_target_object_as_its_own_draft_is_refused(models):
    with pytest.raises(ValueError, match="separate model object"):
        minispec.generate(models["gpt2"]["target"], PROMPT, draft=models["gpt2"]["target"])


@pytest.mark.parametrize("kwargs, message", [
    ({"gamma": 0}, "gamma"), ({"lenience": 0.0}, "lenience"), ({"lenience": 1.5}, "lenience"),
    ({"draft": "./no/such/checkpoint"}, "does not exist"),
])
def test_bad_speculative_settings_are_named(models, kwargs, message):
    kwargs = {"draft": "lookup", **kwargs}
    with pytest.raises(ValueError, match=message):
        minispec.generate(models["gpt2"]["target"], PROMPT, **kwargs)
