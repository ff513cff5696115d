"""One training step of a draft head on the target's states, with its paper's loss (EAGLE-1's, Medusa-1's
self-distillation): what the offline trainer (tools/train_heads.py) and learn.py share."""

from contextlib import contextmanager

import torch
import torch.nn.functional as F

PAIR_NOISE = 0.2  # EAGLE-1's uniform noise on the input states: (U - 0.5) · 0.2 · 512 / length


class Uncached(torch.nn.Module):
    """A KV cache that keeps nothing: a training forward attends over its own tokens only."""
    first_row = 0

    def update(self, input_pos, k, v):
        return k.contiguous(), v.contiguous()  # as a cache's rows are


@contextmanager
def training(head, length):
    """The head's forwards with gradients, an EAGLE head's over whole sequences of up to `length` tokens."""
    layers = getattr(head, "layers", [])  # Medusa heads have no attention
    if layers:
        head.setup_caches(1, length)  # RoPE tables of `length` positions
    caches = [layer.attention.kv_cache for layer in layers]
    for layer in layers:
        layer.attention.kv_cache = Uncached()
    head.train().requires_grad_(True)
    try:
        yield
    finally:
        for layer, cache in zip(layers, caches):
            layer.attention.kv_cache = cache
        head.eval().requires_grad_(False)


def padded_batch(sequences, records, group):
    """A group's sequences padded to whole key blocks of 32: (tokens, states, answer mask)."""
    width = -(-max(len(sequences[i][0]) for i in group) // 32) * 32
    tokens = torch.zeros(len(group), width, dtype=torch.long)
    feats = torch.zeros(len(group), width, records[group[0]].shape[-1])
    mask = torch.zeros(len(group), width, dtype=torch.bool)
    for row, i in enumerate(group):
        seq, start = sequences[i]
        tokens[row, :len(seq)], feats[row, :len(seq)] = seq, records[i]
        mask[row, start:len(seq)] = True
    return tokens, feats, mask


def output_head(target, x, rows=None):
    """target.logits(x) with gradients (the packed kernel has none); rows: only those tokens'."""
    weight = getattr(target.head, "weight", None)
    if weight is None or not weight.is_floating_point():
        raise ValueError(f"training a head needs {target.name} with float weights (load it without --quantize)")
    return F.linear(x.to(weight.dtype), weight if rows is None else weight[rows]).float()


def target_probabilities(target, states, rows=None):
    """The target's distribution at `states` (on `rows` only), float32 even under autocast."""
    with torch.no_grad(), torch.autocast(states.device.type, enabled=False):
        return output_head(target, states, rows).softmax(-1)


def soft_cross_entropy(logits, p):
    return -(p * logits.log_softmax(-1)).sum(-1)


def predict_pairs(head, tokens, inputs, mask):
    """An EAGLE head's states after the pairs (inputs[:, i], x_{i+1}) at answer positions, the next token
    x_{i+2} of each, whether it has one, and the positions kept."""
    width = inputs.shape[1] + 1  # a whole number of key blocks again: one pad pair at the end
    predicted = head.features(F.pad(tokens[:, 1:], (0, 1)), torch.arange(width), keys=width,
                              inputs=F.pad(inputs, (0, 0, 0, 1)))[:, :-1]
    keep = mask[:, 1:]
    return predicted[keep], F.pad(tokens[:, 2:], (0, 1))[keep], F.pad(mask[:, 2:], (0, 1))[keep], keep


def accuracy_of(head, logits, chosen, scored):
    """How often the head's top token is the answer's next token."""
    said = logits.detach().argmax(-1)
    said = said if head.draft_vocab is None else head.draft_vocab[said]
    return (said == chosen)[scored].float().mean()


def eagle_loss(head, tokens, states, mask, generator, noise=PAIR_NOISE):
    """EAGLE-1's loss on (f_i + noise, x_{i+1}) -> f_{i+1} at answer positions (regression, and the
    target's p over the draft vocabulary), and the head's top-token accuracy."""
    inputs = states[:, :-1]
    if noise:
        uniform = torch.rand(inputs.shape, generator=generator).to(inputs.device)
        inputs = inputs + (uniform - 0.5) * noise * 512 / inputs.shape[1]
    predicted, chosen, scored, keep = predict_pairs(head, tokens, inputs, mask)
    predicted, wanted = predicted.float(), states[:, 1:][keep]
    regression = F.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1)
    vocab = head.draft_vocab
    p = target_probabilities(head.target, wanted, vocab)
    logits = output_head(head.target, predicted, vocab)
    classification = soft_cross_entropy(logits, p)
    return regression.mean() + 0.1 * classification.mean(), accuracy_of(head, logits, chosen, scored)


def medusa_loss(heads, tokens, states, mask, generator, noise=None):
    """Medusa-1's self-distillation loss: head j at position i against the target at i + 1 + j."""
    total, correct = 0.0, []
    for j, module in enumerate(heads.heads):
        shift = j + 1
        keep = mask[:, :-shift] & mask[:, shift:]
        if not keep.any():
            continue
        p = target_probabilities(heads.target, states[:, shift:][keep])
        logits = module(states[:, :-shift][keep].to(heads.target.dtype)).float()
        total = total + soft_cross_entropy(logits, p).mean() * 0.8 ** j  # Medusa's decay
        correct.append((logits.argmax(-1) == p.argmax(-1)).float().mean())
    return total, correct[0] if correct else torch.zeros(())


def bfloat16_products(device):
    """Training's matrix products in bfloat16 where the device computes it natively (weights stay float32)."""
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else \
        device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=native)


def update(head, optimizer, loss_of, batch, generator):
    """One step of `optimizer` on loss_of(head, *batch, generator): (loss, accuracy); a loss that is not
    finite changes nothing."""
    with bfloat16_products(head.target.device):  # one step each: autocast keeps its weight copies till it ends
        loss, accuracy = loss_of(head, *batch, generator)
    if torch.isfinite(loss):
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
    return loss, accuracy
