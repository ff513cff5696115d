"""Standardized sampling (paper section 2.2): argmax, temperature, top-k and top-p all become
"sample from an adjusted distribution". Speculative decoding applies the same adjustment to the
draft's q and the target's p, and everything downstream only ever sees probabilities.
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy: the adjusted distribution is one-hot at the argmax
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1 keeps every token

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self):
        return self.temperature == 0


def adjust(logits, sampling):
    """float logits [..., vocab] -> the probabilities we actually sample from, [..., vocab] float32."""
    logits = logits.float()
    if sampling.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if sampling.top_p < 1:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (always >= 1 token).
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs, generator=None):
    """One token per row of probs [..., vocab] -> [...] long, without a host sync.

    argmax(p / E) with E ~ Exponential(1) is a draw from p (the exponential race); zero-probability
    tokens can never win, and a one-hot p always returns its argmax.
    """
    # E = -log(U) with U ~ Uniform(0, 1): the same draw as Tensor.exponential_(), several times faster
    # on CPU. U < 1 keeps E > 0, and the clamp keeps log finite.
    uniform = torch.rand(probs.shape, generator=generator, device=probs.device)
    race = uniform.clamp_min_(torch.finfo(uniform.dtype).tiny).log_().neg_()
    return (probs / race).argmax(-1)
