"""Standardized sampling (paper section 2.2): every setting becomes "sample from an adjusted distribution",
alike for q and p. Penalties count the guesses on each position's path (`path_counts`): exact.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..settings import MIN_P, PENALTY, REPETITION_PENALTY, TEMPERATURE, TOP_K, TOP_P


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy: the adjusted distribution is one-hot at the argmax
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # most likely first, keep tokens while the mass before them is < top_p; 1 keeps all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 keeps all
    presence_penalty: float = 0.0  # subtracted from the logit of each token generated before
    frequency_penalty: float = 0.0  # subtracted from a token's logit once per time it was generated
    repetition_penalty: float = 1.0  # divides a seen token's (prompt too) positive logit, multiplies a negative one

    def __post_init__(self):
        TEMPERATURE("temperature", self.temperature)
        TOP_K("top_k", self.top_k)
        TOP_P("top_p", self.top_p)
        MIN_P("min_p", self.min_p)
        PENALTY("presence_penalty", self.presence_penalty)
        PENALTY("frequency_penalty", self.frequency_penalty)
        REPETITION_PENALTY("repetition_penalty", self.repetition_penalty)

    @property
    def greedy(self):
        return self.temperature == 0

    @property
    def penalized(self):
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Counts(NamedTuple):
    """A penalized row's counts of each generated token ([vocab] float) and its prompt's tokens ([vocab] bool)."""
    generated: torch.Tensor
    prompt: torch.Tensor


def penalize(logits, sampling, generated, prompt):
    """logits penalized as vLLM does (repetition, then frequency and presence)."""
    logits = logits.float()
    if sampling.repetition_penalty != 1:
        r = sampling.repetition_penalty
        logits = torch.where((generated > 0) | prompt, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - sampling.frequency_penalty * generated - sampling.presence_penalty * (generated > 0).float()


def path_counts(generated, tokens, ancestors):
    """[m + 1, vocab]: `generated` at a step's root and after each guess on its path (ancestors [m, m])."""
    one_hot = torch.zeros(len(tokens), generated.shape[-1], device=generated.device)
    one_hot.scatter_(1, tokens.view(-1, 1), 1.0)
    return generated + torch.cat([one_hot.new_zeros(1, one_hot.shape[1]), ancestors @ one_hot])


def adjust(logits, sampling):
    """float logits [..., vocab] -> the probabilities we actually sample from, [..., vocab] float32."""
    logits = processed(logits, sampling)
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return logits.softmax(-1)


def log_probs(logits, sampling):
    """The log-probabilities reported: of the distribution drawn from (greedy: the logits' own)."""
    return processed(logits, sampling).log_softmax(-1)


def processed(logits, sampling):
    """float32 logits divided by the temperature, -inf where top-k, top-p or min-p drop a token."""
    logits = logits.float()
    if sampling.greedy:
        return logits
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < top_p_cutoff(probs, sampling.top_p), float("-inf"))
    if sampling.min_p > 0:  # the top token's probability is one at its logit: the ratio is exp(difference)
        floor = logits.amax(-1, keepdim=True) + math.log(sampling.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    return logits


# torch.sort is slow on a CPU and top-p seldom keeps more than a few hundred tokens: a CPU looks among the
# likeliest first, sorting only rows that fall short (a host read, so GPUs sort).
TOP_P_CANDIDATES = 256


def top_p_cutoff(probs, top_p):
    """[..., 1]: the smallest probability top-p keeps (ties with it kept too)."""
    rows = probs.reshape(-1, probs.shape[-1])
    if probs.device.type == "cpu" and TOP_P_CANDIDATES and TOP_P_CANDIDATES < probs.shape[-1]:
        top = rows.topk(TOP_P_CANDIDATES, dim=-1).values
        mass = top.cumsum(-1)
        cutoff = kept_minimum(top, mass, top_p)
        short = mass[:, -1] < top_p  # rows whose cutoff lies beyond their candidates
        if short.any():
            cutoff[short] = sorted_cutoff(rows[short], top_p)
    else:
        cutoff = sorted_cutoff(rows, top_p)
    return cutoff.view(*probs.shape[:-1], 1)


def sorted_cutoff(rows, top_p):
    ordered = rows.sort(dim=-1, descending=True).values
    return kept_minimum(ordered, ordered.cumsum(-1), top_p)


def kept_minimum(ordered, mass, top_p):
    """The smallest kept probability of rows sorted in descending order, with their running mass."""
    return ordered.masked_fill(mass - ordered >= top_p, float("inf")).amin(-1, keepdim=True)


def sample(probs, generator=None, at=0):
    """One token per row of probs [..., vocab], without a host sync: argmax(p / E), E ~ Exponential(1).
    generator: a torch.Generator, or a Noise (races at the step's positions `at`: an offset or a list)."""
    return (probs / race(probs, generator, at)).argmax(-1)


def sample_distinct(probs, m, generator=None, at=0):
    """m tokens drawn from probs [vocab] without replacement, in order: the race's first m finishers."""
    keys = probs / race(probs, generator, at)
    drawn = keys.topk(min(m, probs.shape[-1])).indices
    return drawn[probs[drawn] > 0]


def race(probs, generator, at=0):
    """E ~ Exponential(1) for each entry of probs (from a Noise: its races at `at`, as sample's)."""
    if hasattr(generator, "races"):
        rows = probs[..., 0].numel()
        return generator.races(range(at, at + rows) if isinstance(at, int) else at).view(probs.shape)
    return exponential(torch.rand(probs.shape, generator=generator, device=probs.device))


def exponential(uniform):
    """-log(U): Tensor.exponential_()'s draw, several times faster on a CPU; clamped to stay finite."""
    return uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
