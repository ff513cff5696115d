"""Medusa (Cai et al. 2024): K heads on the target's last hidden state f_i, head j guessing the token
j + 1 places past the target's own, each guess drawn independently from its own q_j:

    q_j = softmax(W_j · ResBlock_j(f_i)),  ResBlock(x) = x + SiLU(linear(x))

Checkpoints: Medusa-1 heads as published (medusa_num_heads, medusa_num_layers; `{head}.{layer}.linear.*`
and `{head}.{medusa_num_layers}.weight`, or under `medusa_head.` in a Medusa-2 model's files).
"""

import torch
import torch.nn.functional as F
from torch import nn

from ..decoding.sampling import Sampling, adjust, sample
from ..decoding.tree import Growth, best_children, tree_or_chain
from ..models.base import Linear
from ..models.kernels import elementwise, to_device
from ..models.checks import COUNT, check


class ResBlock(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = Linear(dim, dim)

    def forward(self, x):
        return x + elementwise(F.silu, self.linear(x))


class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, dim, vocab_size, n_heads, n_layers, target):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(*[ResBlock(dim) for _ in range(n_layers)],
                                                 Linear(dim, vocab_size, bias=False)) for _ in range(n_heads))
        self.__dict__["target"] = target  # not a submodule: its weights are the target's
        self.fingerprint = None  # set by the loader

    def forward(self, state, k):
        """float32 logits [k, vocab] of heads 0..k-1 at one state [dim]."""
        x = state.to(self.heads[0][-1].weight.dtype)
        return torch.stack([head(x) for head in self.heads[:k]]).float()

    def drafter(self):
        return MedusaDrafter(self)


# Candidates per head in a tree, and nodes expanded per depth, as Medusa's own top 10: expanding costs no
# forward here, only host work.
MEDUSA_TREE_WIDTH = 10


class MedusaDrafter:
    """Guesses for one request from the target's state at the last token it has seen."""

    name, model, preview = "medusa", None, None
    reads_states = True
    encoder_calls = 0
    positional = True  # its guesses are draws at the step's first positions, one per head (drafters.generator_of)

    def __init__(self, heads):
        self.heads = self.weights = heads  # weights: what gamma="auto" keeps its costs under (policy.py)
        self.calls = 0

    def start(self, prompt_ids, sampling=Sampling(), row=0):
        self.state, self.calls = None, 0  # None until the target's first forward

    def propose(self, k, sampling, generator, keep_guessing=None):
        k = min(k, len(self.heads.heads))
        if self.state is None or k == 0:
            return torch.zeros(0, dtype=torch.long, device=self.heads.target.device), None
        logits = self.heads(self.state, k)
        self.calls += 1
        if sampling.greedy:
            return logits.argmax(-1), None
        q = adjust(logits, sampling)
        return sample(q, generator), q

    def propose_tree(self, k, budget, sampling):
        """A tree of <= `budget` fixed candidates (q None), k deep: depth j + 1 holds head j's best (tree.Growth)."""
        k = min(k, len(self.heads.heads), budget)
        if self.state is None or k == 0:
            return torch.zeros(0, dtype=torch.long, device=self.heads.target.device), None, None
        self.calls += 1
        growth = Growth(budget, min(MEDUSA_TREE_WIDTH, budget))
        scores, tokens = (part.tolist() for part in best_children(self.heads(self.state, k), sampling, growth.width))
        growth.add(-1, tokens[0], scores[0])
        for depth in range(1, k):
            for node in growth.expand():  # every node of a depth has the same candidates: the head's
                growth.add(node, tokens[depth], scores[depth])
        tokens, parents = growth.best()
        return to_device(tokens, self.heads.target.device), None, tree_or_chain(parents)

    def accept(self, tokens, tokens_on_device, seen=None):
        self.state = seen.states[-1]


def config_from_hf(hf):
    """(heads, layers per head) from config.json."""
    return check(hf, "medusa_num_heads", COUNT), check(hf, "medusa_num_layers", COUNT, 1)


def build(hf, target):
    return MedusaHeads(target.hidden_size, target.vocab_size, *config_from_hf(hf), target)


def convert_weights(weights, heads):
    """Published names -> ours: `{head}.*` or `medusa_head.{head}.*` -> `heads.{head}.*`."""
    names = {name.removeprefix("medusa_head."): tensor for name, tensor in weights.items()}
    return {f"heads.{name}": tensor for name, tensor in names.items() if name.split(".", 1)[0].isdigit()}


def published(heads):
    """Our tensors under Medusa-1's names (convert_weights' inverse)."""
    return {name.removeprefix("heads."): tensor for name, tensor in heads.state_dict().items()}
