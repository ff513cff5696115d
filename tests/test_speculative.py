"""Speculative decoding end to end: greedy equivalence with target-only decoding for every family and
drafter, exact sampling, cache truncation, T5 encoder reuse, statistics, and bad input."""

import itertools
import math
from collections import Counter

import pytest
import torch
import transformers
from scipy.stats import binom, binomtest, chisquare
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import minispec
from minispec.models.base import Feed
from conftest import gemma_init, noisy_copy, save_reference, spread_init, target_and_drafts

TARGETS = ["gpt2", "llama_gqa", "qwen2", "qwen3", "gemma3", "t5_v1_1"]
DRAFTS = ["same", "noisy", "independent", "ngram", "lookup"]
GAMMAS = [1, 2, 3, 5, 8, "auto"]
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
        accepted_at, verified_at = out.stats["accepted_at"], out.stats["verified_at"]
        assert (sum(accepted_at), sum(verified_at)) == (out.stats["accepted"], out.stats["verified"])
        # a guess is verified only after its step's earlier guesses were accepted
        assert all(later <= earlier for later, earlier in zip(verified_at[1:], accepted_at))
        if name not in ("ngram", "lookup"):
            # one draft forward per guess: the prompt's forward yields q_1 of the first step, and each
            # later step feeds the tokens accepted since in the forward that yields its q_1; "auto" adds
            # one catch-up forward at most per step without guesses
            plain_steps = out.stats["guesses_histogram"][0] if gamma == "auto" else 0
            assert out.stats["proposed"] <= out.stats["draft_calls"] <= out.stats["proposed"] + plain_steps
        if name == "same":
            # every guess verified was accepted ("auto" may guess none: a draft this large is a borderline
            # bet, timed on a noisy machine)
            assert out.stats["accepted"] == out.stats["verified"]
        if name == "same" and gamma != "auto":
            # every call yields γ + 1 tokens, the first (the prompt's forward) too
            assert out.stats["target_calls"] == -(-NEW_TOKENS // (gamma + 1))
            assert out.stats["first_call_tokens"] == gamma + 1
        if name == "noisy" and out.stats["proposed"] >= 10:  # "auto" may rightly guess little on a tiny pair
            assert rate > 0.5, f"noisy copy should be mostly accepted, got {rate:.2f}"
        if name == "independent" and out.stats["proposed"] >= 10:
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
                                gamma=4, max_new_tokens=80, temperature=1.0, seed=seed, ignore_eos=True,
                                coupling="rejection")
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
    greedy = minispec.decoding.sampling.Sampling(temperature=0.0)
    seen = set()
    vocab = 5
    for k, matching, _ in itertools.product(range(1, 7), range(7), range(8)):
        matching = min(matching, k)
        logits = torch.randint(0, 3, (k + 1, vocab), generator=generator).float()  # ties in most rows
        p = minispec.decoding.sampling.adjust(logits, greedy)
        drafts = torch.randint(0, vocab, (k,), generator=generator)
        drafts[:matching] = p[:matching].argmax(-1)
        q = torch.nn.functional.one_hot(drafts, vocab).float()
        expected = minispec.decoding.speculative.accept_and_resample(p, q, drafts, 1.0, generator)
        got = minispec.decoding.speculative.accept_greedy(logits, drafts)
        assert [x.tolist() for x in got] == [x.tolist() for x in expected], (logits, drafts)
        seen.add((k, got[0].item()))
    assert seen == {(k, n) for k in range(1, 7) for n in range(k + 1)}  # every outcome was checked


def test_cache_after_many_rejections_equals_fresh_forward(models):
    target = models["gpt2"]["target"]
    out = minispec.generate(target, PROMPT, draft=models["gpt2"]["independent"], gamma=5,
                            max_new_tokens=NEW_TOKENS, temperature=1.0, seed=0, ignore_eos=True)
    assert out.stats["accepted"] < out.stats["proposed"] // 2  # many rejections, many rollbacks
    sequence = torch.tensor([PROMPT + out.tokens])
    with torch.inference_mode():  # cache row 0 holds everything accepted but the last token
        cached = target.decode_rows(Feed(sequence[:, -1:], [sequence.shape[1] - 1]))[0, -1]
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


SMALL_VOCAB = 16


@pytest.fixture(scope="module")
def vocab16(tmp_path_factory):
    """Tiny llama target over a 16-token vocabulary; an independently drawn draft (far from it) and a
    noisy copy (scale chosen so that about 0.6 of its guesses are accepted: many acceptances, and many
    rejections after them)."""
    config = transformers.LlamaConfig(vocab_size=SMALL_VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32)
    models = {}
    for name, seed in (("target", 0), ("independent", 5)):
        torch.manual_seed(seed)
        models[name] = spread_init(transformers.LlamaForCausalLM(config).eval(), seed, gain=1.0)
    models["noisy"] = noisy_copy(models["target"], seed=1, scale=0.2)
    return {name: minispec.load(save_reference(model, tmp_path_factory.mktemp(f"v16_{name}")))
            for name, model in models.items()}


@pytest.fixture(scope="module")
def qwen3_vocab16(tmp_path_factory):
    """vocab16's target and noisy copy as a Qwen3 (its q/k norms noised too)."""
    config = transformers.Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=16, intermediate_size=32, head_dim=8,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32)
    torch.manual_seed(0)
    target = spread_init(transformers.Qwen3ForCausalLM(config).eval(), 0, gain=1.0)
    return {name: minispec.load(save_reference(model, tmp_path_factory.mktemp(f"q3v16_{name}")))
            for name, model in (("target", target), ("noisy", noisy_copy(target, seed=1, scale=0.2)))}


@pytest.fixture(scope="module")
def gemma3_vocab16(tmp_path_factory):
    """vocab16's target and noisy copy as a Gemma 3 (a sliding layer of window 2 before a global one)."""
    config = transformers.Gemma3TextConfig(vocab_size=SMALL_VOCAB, hidden_size=16, intermediate_size=32, head_dim=8,
                                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                           max_position_embeddings=32, sliding_window=2, tie_word_embeddings=False,
                                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    target = gemma_init(spread_init(transformers.Gemma3ForCausalLM(config).eval(), 0, gain=1.0))
    return {name: minispec.load(save_reference(model, tmp_path_factory.mktemp(f"g3v16_{name}")))
            for name, model in (("target", target), ("noisy", noisy_copy(target, seed=1, scale=0.2)))}


@pytest.fixture(scope="module")
def t5_vocab16(tmp_path_factory):
    """The same for an encoder-decoder: a tiny T5 target and a noisy copy of it as the draft. Gain 2
    (gain 1 makes this T5 nearly deterministic, and a noisy copy of it agrees almost always)."""
    config = transformers.T5Config(vocab_size=SMALL_VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, relative_attention_num_buckets=8,
                                   relative_attention_max_distance=20, feed_forward_proj="gated-gelu",
                                   tie_word_embeddings=False, pad_token_id=0, eos_token_id=1,
                                   decoder_start_token_id=0)
    torch.manual_seed(0)
    target = spread_init(transformers.T5ForConditionalGeneration(config).eval(), 0, gain=2.0)
    return {name: minispec.load(save_reference(model, tmp_path_factory.mktemp(f"t5v16_{name}")))
            for name, model in (("target", target), ("noisy", noisy_copy(target, seed=1, scale=0.2)))}


def exact_joint(target, prompt, sampling, length):
    """{(t_1, ..., t_length): probability} of the target's own sampling: p(t1) p(t2 | t1) ..., each
    factor the adjusted distribution of a teacher-forced forward over the decoder's start and the
    tokens before it."""
    with torch.inference_mode():
        target.ensure_caches(1, len(prompt) + length)
        start = target.encode(torch.tensor([prompt]))  # the prompt itself, or T5's decoder start
        joint = {(): 1.0}
        for _ in range(length):
            longer = {}
            for tokens, probability in joint.items():
                decoder = torch.cat([start, torch.tensor([tokens], dtype=torch.long).view(1, -1)], dim=1)
                p = minispec.decoding.sampling.adjust(target.prefill(decoder)[0, -1], sampling).double()
                for t in p.nonzero().view(-1).tolist():
                    longer[tokens + (t,)] = probability * p[t].item()
            joint = longer
    return joint


def step_outcomes(trace):
    """Which verification outcomes a request's trace shows: its first guess rejected, a guess rejected
    after an accepted one, and every guess of a step accepted (then the target adds its own token)."""
    kinds = [kind for _, kind in trace]
    pairs = set(zip(kinds, kinds[1:]))
    return {"first rejected": kinds[0] == "rejected", "rejected after accepted": ("accepted", "rejected") in pairs,
            "all accepted": ("accepted", "target") in pairs}


def assert_sampled_from(counts, joint, draws):
    """Chi-square goodness of fit at p > 0.001, with cells expected fewer than 5 times merged into one
    (the test's approximation needs about 5 per cell), and a total-variation bound."""
    assert set(counts) <= set(joint), f"outside the target's support: {set(counts) - set(joint)}"
    cells = sorted(joint, key=joint.get, reverse=True)
    probabilities = torch.tensor([joint[cell] for cell in cells], dtype=torch.float64)
    probabilities /= probabilities.sum()  # float32 factors: the product sums to 1 up to rounding
    observed = torch.tensor([counts[cell] for cell in cells], dtype=torch.float64)
    expected = probabilities * draws
    common = int((expected >= 5).sum())
    rare = (expected[common:].sum(), observed[common:].sum())
    expected, observed = expected[:common], observed[:common]
    if rare[0] > 0:  # the rare cells as one (folded into the least likely common cell if even that is rare)
        if rare[0] >= 5:
            expected, observed = torch.cat([expected, rare[0].view(1)]), torch.cat([observed, rare[1].view(1)])
        else:
            expected[-1] += rare[0]
            observed[-1] += rare[1]
    assert len(expected) >= 8, "too few cells for the test to say much"
    pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
    # Total variation over all cells, merged or not. Were the draws the target's: E|c/N - p| <=
    # min(sqrt(p (1 - p) / N), 2 p) per cell (Jensen; and E c/N + p), so E[TV] <= half their sum; and
    # one draw moves TV by at most 1/N, so (McDiarmid) TV exceeds E[TV] + e with probability at most
    # exp(-2 N e^2), 0.001 for e = sqrt(ln(1000) / (2 N)). For ~30 cells and 6000 draws: about 0.03 + 0.024.
    frequencies = torch.tensor([counts[cell] for cell in cells], dtype=torch.float64) / draws
    tv = 0.5 * (frequencies - probabilities).abs().sum().item()
    expected_tv = 0.5 * torch.minimum((probabilities * (1 - probabilities) / draws).sqrt(), 2 * probabilities).sum()
    bound = expected_tv.item() + math.sqrt(math.log(1000) / (2 * draws))
    print(f"chi-square p-value {pvalue:.3g} over {len(expected)} cells; total variation {tv:.4f}, bound {bound:.4f}")
    assert pvalue > 0.001, f"chi-square rejects the target's joint (p-value {pvalue:.2e}, {len(expected)} cells)"
    assert tv < bound, f"total variation {tv:.4f} >= {bound:.4f}"


# id: (models fixture, draft, sampling, prompt, draws). Draws are as few as the checks allow: each costs
# a request (2-7 ms on a CPU), and a planted bug fails each case with these counts (the commit says which).
JOINT_CASES = {
    "model top-k": ("vocab16", "noisy", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 6000),
    # top-p 0.5 keeps 4-5 of these flat distributions' 16 tokens (0.8 keeps 8-10: ~700 cells, too many)
    "model top-p": ("vocab16", "noisy", {"temperature": 1.0, "top_p": 0.5}, [1, 2, 3], 6000),
    "qwen3 model top-k": ("qwen3_vocab16", "noisy", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 6000),
    "gemma3 model top-k": ("gemma3_vocab16", "noisy", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 6000),
    "t5 model top-k": ("t5_vocab16", "noisy", {"temperature": 1.0, "top_k": 3}, [3, 4, 5, 6, 7, 8, 9, 10], 3000),
    "ngram top-k": ("vocab16", "ngram", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 4000),
    # lookup guesses 12, 6: the target gives each ~0.43 (with 3, 1 after [1, 2, 3, 1, 2], 1 is never kept)
    "lookup top-k": ("vocab16", "lookup", {"temperature": 1.0, "top_k": 3}, [6, 8, 12, 6, 8], 4000),
    # a token tree: after 6, 8 came 15 and then 12, so lookup offers 12, then 15, both in the target's
    # top 3 there (decoding/tree.py, sample_walk: the second child is tried after the first's rejection)
    "lookup tree top-k": ("vocab16", "lookup", {"temperature": 1.0, "top_k": 3, "tree": 8},
                          [6, 8, 15, 6, 8, 12, 6, 8], 4000),
    # gamma="auto" (with known_costs): the draft's confidence in its first guess decides whether it makes
    # a second, so how many guesses a step verifies depends on the guesses themselves
    "model top-k, gamma auto": ("vocab16", "noisy", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 6000),
}


@pytest.mark.parametrize("case", JOINT_CASES)
def test_joint_distribution_of_three_tokens_is_the_targets(request, case):
    """End to end: the first three tokens of many requests, each with its own seed, against the target's
    exact joint p(t1) p(t2 | t1) p(t3 | t1, t2). γ = 2, so a request's steps between them see a first
    guess rejected, a rejection after an acceptance (the residual at p_2, caches rolled back mid-step)
    and full acceptance (the bonus token from p_3): each happens in many requests. Model drafts are
    accepted 0.3-0.8 of the time; ngram guesses with its counts' q, lookup deterministically (12, 6 first).
    Algorithm 1's verification (coupling="rejection"); test_seeds.py tests the default coupling so."""
    fixture, draft, settings, prompt, draws = JOINT_CASES[case]
    gamma = "auto" if case.endswith("auto") else 2
    if gamma == "auto":
        request.getfixturevalue("known_costs")
    models = request.getfixturevalue(fixture)
    target, draft = models["target"], models.get(draft, draft)
    joint = exact_joint(target, prompt, minispec.Sampling(**{k: v for k, v in settings.items() if k != "tree"}), length=3)
    counts, outcomes, accepted, verified = Counter(), Counter(), 0, 0
    guesses = Counter()  # steps by their number of guesses (gamma="auto")
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=gamma, max_new_tokens=3, seed=seed,
                                ignore_eos=True, coupling="rejection", **settings)
        counts[tuple(out.tokens)] += 1
        guesses.update(dict(enumerate(out.stats.get("guesses_histogram", []))))
        outcomes.update(name for name, seen in step_outcomes(out.trace).items() if seen)
        accepted, verified = accepted + out.stats["accepted"], verified + out.stats["verified"]
    rate = accepted / verified
    print(f"{case}: acceptance rate {rate:.3f}, {dict(outcomes)}, {len(joint)} cells")
    if isinstance(draft, minispec.models.base.CachedLM):
        assert 0.3 < rate < 0.8
    for outcome in ("first rejected", "rejected after accepted", "all accepted"):
        assert outcomes[outcome] >= draws // 20, f"{outcome}: {outcomes[outcome]} of {draws} requests"
    if gamma == "auto":  # steps of one guess and of two both happened often
        assert guesses[1] >= draws // 20 and guesses[2] >= draws // 20, guesses
    assert_sampled_from(counts, joint, draws)


def test_lenience_bounds_each_token_by_p_over_l(vocab16):
    """Lenience l < 1 (paper A.5) accepts a guess x with probability min(1, p(x) / (l q(x))): no longer
    exact, but at a guess position no token comes out more often than p / l. (Acceptance gives x at most
    min(q, p / l); a rejection happens with probability at most sum (p - q)+, and its residual
    norm(max(0, p - q)) then adds at most p - q, so p in all, to a token with p > q.) Checked end to end
    at temperature 1 on t1, the first guess's position, and on t2 given t1, a guess position too (the
    second guess, or the first of the next step): each frequency against a one-sided binomial bound, with
    Bonferroni's correction over all those tests, at significance 0.001. The independent draft's q is far
    from p, and several tokens have q > p / l: there the bound is tight, and the output far from p."""
    target, draft = vocab16["target"], vocab16["independent"]
    prompt, lenience, draws = [1, 2, 3], 0.5, 4000
    joint = exact_joint(target, prompt, minispec.Sampling(temperature=1.0), length=2)
    p = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)  # p(t1, t2)
    for (t1, t2), probability in joint.items():
        p[t1, t2] = probability
    p_first = p.sum(1)
    p_second = p / p_first[:, None]  # p(t2 | t1)
    counts = torch.zeros(SMALL_VOCAB, SMALL_VOCAB, dtype=torch.float64)
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=2, max_new_tokens=3, temperature=1.0,
                                lenience=lenience, seed=seed, ignore_eos=True)
        counts[out.tokens[0], out.tokens[1]] += 1
    first = counts.sum(1)
    # (count, trials, bound on the probability): t1's marginal, then t2's distribution after each t1 seen
    tests = [(first[x], draws, p_first[x] / lenience) for x in range(SMALL_VOCAB)]
    tests += [(counts[x, y], first[x], p_second[x, y] / lenience)
              for x in range(SMALL_VOCAB) if first[x] > 0 for y in range(SMALL_VOCAB)]
    alpha = 0.001 / len(tests)
    for count, trials, bound in tests:
        # P(Binomial(trials, bound) >= count): how likely this many, were the true probability the bound
        assert binom.sf(count.item() - 1, int(trials), min(bound.item(), 1.0)) > alpha, (count, trials, bound)
    # Not vacuous: lenience does change the output. Some first tokens are far from p's frequency (a
    # two-sided binomial test at the same corrected significance); lenience = 1 (or ignored) fails here.
    deviations = [binomtest(int(first[x]), draws, p_first[x].item()).pvalue for x in range(SMALL_VOCAB)]
    assert min(deviations) < alpha, min(deviations)


def test_mismatched_vocabularies_fail_before_generating(models, tmp_path):
    other = transformers.GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=1, n_head=4,
                                     bos_token_id=1, eos_token_id=2)
    small = minispec.load(save_reference(transformers.GPT2LMHeadModel(other), tmp_path))
    with pytest.raises(ValueError, match="different vocabularies"):
        minispec.generate(models["gpt2"]["target"], PROMPT, draft=small)


def test_mismatched_tokenizers_fail_before_generating(models):
    target, draft = models["gpt2"]["target"], models["gpt2"]["independent"]
    from minispec.loading.tokenizer import Tokenizer

    target.tokenizer, draft.tokenizer = (Tokenizer({0: token}, [], {}, None) for token in ("a", "b"))
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
    ({"draft": "./no/such/checkpoint"}, r"minispec\.load"), ({"gamma": "fast"}, "gamma"),
])
def test_bad_speculative_settings_are_named(models, kwargs, message):
    kwargs = {"draft": "lookup", **kwargs}
    with pytest.raises(ValueError, match=message):
        minispec.generate(models["gpt2"]["target"], PROMPT, **kwargs)
