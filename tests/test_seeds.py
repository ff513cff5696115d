"""Seeds that speculation does not change (coupling="gumbel", decoding/speculative.py): a seeded request's
sampled output is a function of the seed, the prompt and the sampling settings only, the same with any
drafter, γ, token tree, batch and thread count, and with no draft at all; and it has exactly the
target's distribution."""

from collections import Counter

import pytest
import torch

import minispec
from minispec.decoding.noise import Noise
from minispec.decoding.sampling import sample
from conftest import target_and_drafts
from test_speculative import assert_sampled_from, exact_joint, step_outcomes, vocab16  # noqa: F401 (a fixture)

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]
SAMPLINGS = {
    "top-k": {"temperature": 0.9, "top_k": 20},
    "top-p, min-p, penalties": {"temperature": 1.3, "top_p": 0.9, "min_p": 0.02, "presence_penalty": 0.5,
                                "repetition_penalty": 1.2},
}
# every way of decoding one request: no draft, draft models that agree or not, model-free drafters, chains
# and trees, fixed and chosen γ
WAYS = {
    "no draft": {},
    "model γ=1": {"draft": "noisy", "gamma": 1},
    "model γ=3 chains": {"draft": "noisy", "gamma": 3, "tree": "off"},
    "model auto": {"draft": "noisy", "gamma": "auto"},
    "model tree": {"draft": "noisy", "gamma": 4, "tree": 6},
    "independent model": {"draft": "independent", "gamma": 3},
    "lookup γ=3": {"draft": "lookup", "gamma": 3},
    "lookup tree": {"draft": "lookup", "gamma": 3, "tree": 6},
    "ngram tree": {"draft": "ngram", "gamma": 2, "tree": 5},
    "int8 self-draft": {"draft": "int8", "gamma": 2},
    "medusa heads": {"draft": "medusa", "gamma": 3, "tree": "off"},
    "eagle head tree": {"draft": "eagle", "gamma": 3, "tree": 5},
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """The tiny GQA llama, its drafts (conftest), and random Medusa and EAGLE heads for it (test_heads)."""
    from test_heads import write_eagle, write_medusa

    models = target_and_drafts("llama_gqa", tmp_path_factory)
    target = models["target"]
    medusa, _ = write_medusa(tmp_path_factory.mktemp("medusa"), target.hidden_size, target.vocab_size)
    hf = {"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, "intermediate_size": 96,
          "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-6}
    eagle, _, _ = write_eagle(tmp_path_factory.mktemp("eagle"), hf)
    return {**models, "medusa": minispec.load_draft_head(medusa, target), "eagle": minispec.load_draft_head(eagle, target)}


def decoded(models, prompt, way, **settings):
    draft = way.get("draft")
    return minispec.generate(models["target"], prompt, **{**way, "draft": models.get(draft, draft)}, **settings)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_a_seed_gives_the_same_tokens_whatever_decodes_it(llama, sampling):
    settings = {**SAMPLINGS[sampling], "max_new_tokens": 24, "ignore_eos": True, "seed": 11}
    plain = decoded(llama, PROMPT, {}, **settings).tokens
    assert decoded(llama, PROMPT, {}, **{**settings, "seed": 12}).tokens != plain  # the seed does decide
    for name, way in WAYS.items():
        out = decoded(llama, PROMPT, way, **settings)
        assert out.tokens == plain, name
        if way.get("draft") == "noisy":  # the draft guesses under the target's noise: mostly accepted
            assert out.stats["acceptance_rate"] > 0.5, (name, out.stats["acceptance_rate"])
    # beside other requests in a batch, joining and leaving around it; and on another number of threads
    others = [[1, 2, 3, 4], PROMPT[:5]]
    batch = decoded(llama, [others[0], PROMPT, others[1]], {"draft": "noisy", "gamma": 3}, batch_size=2,
                    **{**settings, "seed": [3, 11, 5], "max_new_tokens": 24})
    assert batch[1].tokens == plain
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert decoded(llama, PROMPT, WAYS["model tree"], **settings).tokens == plain
    finally:
        torch.set_num_threads(threads)


def test_rejection_coupling_is_algorithm_1_and_differs_with_gamma(llama):
    """coupling="rejection" keeps Algorithm 1's draws, which depend on how a step's guesses went."""
    settings = {"temperature": 0.9, "max_new_tokens": 24, "ignore_eos": True, "seed": 11, "coupling": "rejection"}
    outputs = {tuple(decoded(llama, PROMPT, {"draft": "independent", "gamma": gamma}, **settings).tokens)
               for gamma in (1, 2, 3, 5)}
    assert len(outputs) > 1


def test_noise_is_the_seeds_and_the_positions_alone():
    """A position's race does not depend on which positions were drawn before, nor when."""
    one, other = Noise(5, 50, torch.device("cpu")), Noise(5, 50, torch.device("cpu"))
    one.begin(3)
    first = one.races([0, 1, 2])
    other.begin(4)
    assert torch.equal(other.races([1, 0]), first[[2, 1]])
    assert not torch.equal(Noise(6, 50, torch.device("cpu")).races([0]), Noise(5, 50, torch.device("cpu")).races([0]))
    # siblings in a tree share their depth's noise: the draws of one distribution there are equal
    p = torch.softmax(torch.randn(50), -1)
    assert sample(p.expand(3, 50), one, at=[1, 1, 1]).unique().numel() == 1


# id: (draft, settings, prompt, draws), on vocab16 (test_speculative), γ = 2
COUPLED_CASES = {
    "no draft": (None, {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 4000),
    "model top-k": ("noisy", {"temperature": 1.0, "top_k": 3}, [1, 2, 3], 6000),
    "model top-p, penalties": ("noisy", {"temperature": 1.0, "top_p": 0.5, "frequency_penalty": 0.7},
                               [1, 2, 3], 6000),
    "model tree top-k": ("noisy", {"temperature": 1.0, "top_k": 3, "tree": 6}, [1, 2, 3], 6000),
    "lookup tree top-k": ("lookup", {"temperature": 1.0, "top_k": 3, "tree": 8}, [6, 8, 15, 6, 8, 12, 6, 8], 4000),
}


@pytest.mark.parametrize("case", COUPLED_CASES)
def test_coupled_sampling_has_the_targets_joint_distribution(vocab16, case):
    """As test_speculative's test of Algorithm 1: the first three tokens of many seeds against the
    target's exact joint, every verification outcome seen often."""
    draft, settings, prompt, draws = COUPLED_CASES[case]
    target = vocab16["target"]
    draft = vocab16.get(draft, draft)
    sampling = minispec.Sampling(**{k: v for k, v in settings.items() if k != "tree"})
    joint = exact_joint(target, prompt, sampling, length=3) if not sampling.penalized else penalized_joint(
        target, prompt, sampling)
    counts, outcomes = Counter(), Counter()
    for seed in range(draws):
        out = minispec.generate(target, prompt, draft=draft, gamma=2, max_new_tokens=3, seed=seed, ignore_eos=True,
                                **settings)
        counts[tuple(out.tokens)] += 1
        outcomes.update(name for name, seen in step_outcomes(out.trace).items() if seen)
    if draft is not None:
        for outcome in ("first rejected", "all accepted"):
            assert outcomes[outcome] >= draws // 20, f"{outcome}: {outcomes[outcome]} of {draws} requests"
    assert_sampled_from(counts, joint, draws)


def penalized_joint(target, prompt, sampling):
    """exact_joint with the penalties: each factor's logits penalized by the tokens generated before it."""
    from minispec.decoding.sampling import adjust, penalize

    with torch.inference_mode():
        target.ensure_caches(1, len(prompt) + 3)
        start = target.encode(torch.tensor([prompt]))
        seen = torch.zeros(target.vocab_size, dtype=torch.bool)
        seen[prompt] = True
        joint = {(): 1.0}
        for _ in range(3):
            longer = {}
            for tokens, probability in joint.items():
                decoder = torch.cat([start, torch.tensor([tokens], dtype=torch.long).view(1, -1)], dim=1)
                generated = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=target.vocab_size).float()
                logits = penalize(target.prefill(decoder)[0, -1], sampling, generated, seen)
                p = adjust(logits, sampling).double()
                for t in p.nonzero().view(-1).tolist():
                    longer[tokens + (t,)] = probability * p[t].item()
            joint = longer
    return joint
