"""Standardized sampling and Algorithm 1's accept/resample rule, tested on hand-built distributions."""

import pytest
import torch
from scipy.stats import chisquare

import minispec.decoding.sampling
from minispec.decoding.sampling import Sampling, adjust, sample
from minispec.settings import TEMPERATURE_MIN
from minispec.models.checks import SettingError
from minispec.decoding.speculative import accept_and_resample

VOCAB = 10
DRAWS = 100_000
SETTINGS = {
    "temperature": Sampling(temperature=1.0),
    "top_k": Sampling(temperature=0.8, top_k=4),
    "top_p": Sampling(temperature=1.2, top_p=0.7),
}


def hand_built_logits():
    # p and q disagree a lot, so many drafts are rejected and the residual path is exercised.
    p = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, 0.2, 1.2, -2.0])
    q = torch.tensor([-1.0, 1.0, 2.0, 0.0, 1.5, -0.5, 0.5, -2.0, 1.0, 0.3])
    return p, q


def speculative_first_tokens(p, q, lenience=1.0, draws=DRAWS, seed=0):
    """Token counts of one Algorithm 1 step with γ = 1: draft x ~ q, accept or resample."""
    generator = torch.Generator().manual_seed(seed)
    p_rows = torch.stack([p, p])  # p_1 for the draft position, p_2 for the bonus token
    tokens = []
    for _ in range(draws):
        x = sample(q, generator).view(1)
        n, t = accept_and_resample(p_rows, q.view(1, -1), x, lenience, generator)
        tokens.append(torch.where(n == 1, x[0], t))
    return torch.bincount(torch.cat(tokens), minlength=VOCAB).double()


def assert_distributed_as(counts, p):
    """Chi-square goodness of fit at significance 0.001, and total variation below 0.01."""
    support = p > 0
    assert counts[~support].sum() == 0, "a token outside p's support was produced"
    expected = p[support].double() / p[support].double().sum() * counts.sum()
    result = chisquare(counts[support].numpy(), expected.numpy())
    assert result.pvalue > 0.001, f"chi-square rejects p (p-value {result.pvalue:.2e})"
    tv = 0.5 * (counts / counts.sum() - p.double()).abs().sum()
    assert tv < 0.01, f"total variation {tv:.4f}"


@pytest.mark.parametrize("name", SETTINGS)
def test_speculative_sampling_is_exact(name):
    p_logits, q_logits = hand_built_logits()
    p, q = adjust(p_logits, SETTINGS[name]), adjust(q_logits, SETTINGS[name])
    counts = speculative_first_tokens(p, q)
    assert_distributed_as(counts, p)
    # the test has power: the draft's own distribution is far from p and would fail it
    assert 0.5 * (q - p).abs().sum() > 0.1


def test_sampler_draws_from_p():
    p = adjust(hand_built_logits()[0], SETTINGS["top_p"])
    generator = torch.Generator().manual_seed(1)
    counts = torch.bincount(sample(p.expand(DRAWS, VOCAB).contiguous(), generator), minlength=VOCAB).double()
    assert_distributed_as(counts, p)


def test_lenience_bounds_every_token_by_p_over_l():
    p_logits, q_logits = hand_built_logits()
    p, q = adjust(p_logits, SETTINGS["temperature"]), adjust(q_logits, SETTINGS["temperature"])
    lenience = 0.5
    freq = speculative_first_tokens(p, q, lenience=lenience, draws=50_000) / 50_000
    # 4 standard errors of a binomial frequency above the bound would be a real violation
    slack = 4 * (p / lenience * (1 - p / lenience).clamp(min=0) / 50_000).sqrt() + 1e-3
    assert (freq <= p / lenience + slack).all()
    # and lenience changes the output: the draft's favourite token becomes more likely than under p
    assert freq[2] > p[2] + 0.02


def test_identical_p_and_q_accepts_everything():
    p = adjust(hand_built_logits()[0], SETTINGS["top_k"])
    generator = torch.Generator().manual_seed(0)
    drafts = sample(p.expand(5, VOCAB).contiguous(), generator)
    n, _ = accept_and_resample(p.expand(6, VOCAB), p.expand(5, VOCAB), drafts, 1.0, generator)
    assert int(n) == 5


def test_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    p = adjust(logits, Sampling())
    argmax = logits.argmax(-1)
    drafts = torch.stack([argmax[0], argmax[1], (argmax[2] + 1) % VOCAB])
    q = adjust(torch.nn.functional.one_hot(drafts, VOCAB).float(), Sampling())
    n, t = accept_and_resample(p, q, drafts, 1.0, torch.Generator().manual_seed(0))
    assert int(n) == 2 and int(t) == int(argmax[2])


def test_greedy_lenience_accepts_near_argmax():
    logits = torch.tensor([[2.0, 1.9, -3.0] + [-9.0] * 7, [0.0] * VOCAB])
    p = adjust(logits, Sampling())
    draft = torch.tensor([1])  # not the argmax, but p(1) = 0.905 * max(p)
    q = torch.nn.functional.one_hot(draft, VOCAB).float()
    raw = logits.softmax(-1)
    assert int(accept_and_resample(p, q, draft, 1.0, None)[0]) == 0
    assert int(accept_and_resample(p, q, draft, 0.9, None, greedy_p=raw)[0]) == 1
    assert int(accept_and_resample(p, q, draft, 0.95, None, greedy_p=raw)[0]) == 0


def test_top_k_and_top_p_masks():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert (adjust(logits, Sampling(1.0, top_k=2))[2:] == 0).all()
    probs = logits.softmax(-1)  # [0.644, 0.237, 0.087, 0.032]
    kept = adjust(logits, Sampling(1.0, top_p=0.85)) > 0
    assert kept.tolist() == [True, True, False, False]
    assert torch.allclose(adjust(logits, Sampling(1.0, top_p=0.85))[:2], probs[:2] / probs[:2].sum())
    assert adjust(logits, Sampling(1.0, top_p=0.1)).tolist() == [1.0, 0.0, 0.0, 0.0]  # always >= 1 token
    halves = torch.tensor([2.0, 1.0, 1.0]).log()  # probabilities exactly 0.5, 0.25, 0.25
    assert adjust(halves, Sampling(1.0, top_p=0.5)).tolist() == [1.0, 0.0, 0.0]  # mass 0.5 before: dropped
    # A token tied with the last one kept is kept too, whatever order a sort would put them in.
    assert adjust(halves, Sampling(1.0, top_p=0.6)).tolist() == [0.5, 0.25, 0.25]


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_keeps_what_the_reference_keeps(monkeypatch, top_p):
    """Over a 5000-token vocabulary, with rows whose cutoff lies among their TOP_P_CANDIDATES most
    likely tokens (peaked rows: no sort needed) beside rows where it does not (flat ones: sorted
    whole), alone and after top-k: the kept tokens are the reference implementation's, and the same
    as when every row is sorted."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    spread = torch.tensor([4.0, 4.0, 4.0, 0.3, 0.3, 0.3])[:, None]
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * spread
    suffice = logits.softmax(-1).topk(minispec.decoding.sampling.TOP_P_CANDIDATES).values.sum(-1) >= top_p
    assert suffice.any() and not suffice.all()  # both kinds of row in one call
    for top_k in (0, 1000):
        sampling = Sampling(1.0, top_k=top_k, top_p=top_p)
        reference = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits) if top_k else logits)
        probs = adjust(logits, sampling)
        assert torch.equal(probs > 0, reference > float("-inf"))
        torch.testing.assert_close(probs, reference.softmax(-1))
        assert torch.equal(adjust(logits[0], sampling), probs[0])  # one row, no batch dimension
        monkeypatch.setattr(minispec.decoding.sampling, "TOP_P_CANDIDATES", 0)  # sort every row
        assert torch.equal(adjust(logits, sampling), probs)
        monkeypatch.undo()


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": 1e-300}, "temperature"), ({"temperature": 5e-324}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": True}, "temperature"), ({"top_k": True}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"top_p": float("nan")}, "top_p"), ({"top_p": float("inf")}, "top_p"), ({"top_p": True}, "top_p"),
])
def test_numbers_at_their_edges_are_refused_naming_their_field(kwargs, field):
    with pytest.raises(SettingError, match=f"^{field} must be") as refused:
        Sampling(**kwargs)
    assert refused.value.field == field


def test_the_smallest_temperature_still_gives_a_distribution():
    """At TEMPERATURE_MIN the tempered logits stay finite: a distribution, all but one-hot, not NaN."""
    logits = torch.tensor([[30.0, 29.99999, -3000.0, 0.0]])
    probs = adjust(logits, Sampling(temperature=TEMPERATURE_MIN))
    assert torch.isfinite(probs).all() and probs.sum().item() == pytest.approx(1.0)
    assert probs[0, 0] > probs[0, 1] > 0 and probs[0, 2] == 0
