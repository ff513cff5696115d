"""Randomness by position (coupling="gumbel", decoding/speculative.py): a seeded row's draws at each
output position come from the seed and the position alone, so its output does not depend on how many
draws came before it: not on the drafter, γ, a tree or the batch."""

import torch

from .sampling import exponential


class Noise:
    """A seeded row's races: the one at output position t from (seed, t) alone, kept until verified."""

    def __init__(self, seed, vocab_size, device):
        self.seed, self.vocab_size, self.device = seed, vocab_size, device
        self.start, self.kept = 0, {}

    def begin(self, start):
        """A new step, whose first token is output position `start`."""
        self.start, self.kept = start, {t: race for t, race in self.kept.items() if t >= start}

    def races(self, offsets):
        """[len(offsets), vocab]: the races at positions start + offset."""
        for t in (self.start + i for i in offsets):
            if t not in self.kept:
                generator = torch.Generator(self.device).manual_seed(mix(self.seed, t))
                self.kept[t] = exponential(torch.rand(self.vocab_size, generator=generator, device=self.device))
        return torch.stack([self.kept[self.start + i] for i in offsets])


def mix(seed, t):
    """A generator's seed for position t of `seed` (splitmix64's constants)."""
    return ((seed + 1) * 0x9E3779B97F4A7C15 ^ (t + 1) * 0xBF58476D1CE4E5B9) % 2**64
