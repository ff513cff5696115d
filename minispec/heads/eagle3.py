"""EAGLE-3 (Li, Wei, Zhang & Zhang, 2025): EAGLE's one-layer draft, reading the residual states entering
three of the target's layers (2, L/2 and L-3 by default) and guessing through an output head of its own
over a reduced draft vocabulary:

    g_i = fc([h_i^low, h_i^mid, h_i^high]),  g'_{i+1} = g_i + Attn([norm(embed(x_{i+1})), norm(g_i)]) (+ MLP)
    q_{i+2} = softmax(lm_head(norm(g'_{i+1})))     draft token d is the target's d + d2t[d]

Checkpoints as their authors publish them (vLLM and SGLang read the same): fc, midlayer.* (q/k/v twice
as wide, hidden_norm beside input_layernorm), norm, lm_head, d2t, t2d, and a narrower head's embed_tokens.
"""

import torch
from torch import nn

from ..models.base import CachedLM, Embedding, Linear, RMSNorm, compile_region
from ..models.checks import COUNT, FLAG, TABLE, Check, check, integer
from ..models.llama import Llama, TransformerBlock, convert_hf_weights
from . import eagle
from .eagle import EagleDrafter, EagleHead


class Eagle3Block(TransformerBlock):
    """EAGLE-3's layer: attention reads [embedding, state], each normed on its own; the residual is the state."""

    def __init__(self, config, norm_before_residual):
        super().__init__(config, None)
        self.hidden_norm = RMSNorm(config.dim, config.norm_eps)
        attention = self.attention
        attention.wqkv = Linear(2 * config.dim, (attention.n_heads + 2 * attention.n_kv_heads) * attention.head_dim,
                                bias=config.qkv_bias)
        # some trainers (NVIDIA's) add the normed state back, not the state: their config says so
        self.norm_before_residual = norm_before_residual

    def forward(self, x, input_pos, cos, sin, mask, layout):
        state = x[..., x.shape[-1] // 2:]
        if self.norm_before_residual:
            state = self.hidden_norm(state)
        x = state + self.attention(self.project(x, cos, sin), input_pos, mask, layout)
        return self.finish(x)

    def norms(self):
        return super().norms()._replace(hidden=self.hidden_norm, before_residual=self.norm_before_residual)

    @compile_region
    def project(self, x, cos, sin):
        embedded, state = x.chunk(2, dim=-1)
        both = torch.cat([self.attention_norm(embedded), self.hidden_norm(state)], dim=-1)
        return self.attention.project(both, cos, sin)


class Eagle3Head(EagleHead):
    """An EAGLE-3 draft: fc over the target's tapped states, an Eagle3Block, its own norm and output head."""

    kind = "eagle3"

    def __init__(self, config, target, taps, draft_vocab_size, norm_before_residual):
        CachedLM.__init__(self)
        self.config, self.taps = config, taps
        self.fc = Linear(len(taps) * target.hidden_size, config.dim, bias=False)
        self.layers = nn.ModuleList([Eagle3Block(config, norm_before_residual)])
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.lm_head = Linear(config.dim, draft_vocab_size, bias=False)
        # a head as wide as its target embeds with the target's table; a narrower one brings its own
        self.embedding = Embedding(config.vocab_size, config.dim) if config.dim != target.hidden_size else None
        self.__dict__["target"] = target
        self.register_buffer("draft_vocab", None if draft_vocab_size == target.vocab_size else
                             torch.zeros(draft_vocab_size, dtype=torch.long))

    def embed_tokens(self, tokens):
        return self.target.embed_tokens(tokens) if self.embedding is None else self.embedding(tokens)

    def logits(self, hidden):
        drafted = self.lm_head(self.norm(hidden)).float()
        return drafted if self.draft_vocab is None else self.spread(drafted)

    def layer_input(self, embedded, states):
        """[embedding, state] side by side (Eagle3Block norms each)."""
        return torch.cat([embedded, states], dim=-1)

    def fuse(self, states):
        """The target's tapped states -> the head's input."""
        return self.fc(states.to(self.dtype))

    def drafter(self):
        return Eagle3Drafter(self)


class Eagle3Drafter(EagleDrafter):
    """EagleDrafter's loop on the states entering the tapped layers, fused as they arrive."""

    name = "eagle3"

    def __init__(self, head):
        super().__init__(head)
        self.reads_states = head.taps  # what the target's forwards return beside their logits

    def inputs(self, states):
        return self.model.fuse(states)


def default_taps(n_layers):
    """EAGLE-3's default layers, 2, L/2 and L-3; None where those are not three layers of L."""
    taps = tuple(sorted({2, n_layers // 2, n_layers - 3}))
    return taps if len(taps) == 3 and taps[0] >= 0 and taps[-1] < n_layers else None


def training_taps(n_layers):
    """The layers a head trained here reads: the default, or on shallow targets the nearest that exist."""
    return default_taps(n_layers) or tuple(sorted({min(2, n_layers - 1), n_layers // 2, max(n_layers - 3, 0)}))


def taps_from_hf(hf, target):
    """The target layers the head reads, in order; a ValueError where the target cannot give them."""
    n_layers = len(target.layers)
    nested = check(hf, "eagle_config", TABLE, {})
    ids = hf.get("eagle_aux_hidden_state_layer_ids", nested.get("eagle_aux_hidden_state_layer_ids"))
    if ids is None:
        taps = default_taps(n_layers)
        if taps is None:
            raise ValueError(f"EAGLE-3 reads the states entering layers 2, L/2 and L-3, which are not three "
                             f"layers of {target.name}'s {n_layers}: name them in eagle_aux_hidden_state_layer_ids")
        return taps
    layers = Check(lambda v: isinstance(v, list) and v and all(map(integer(0, n_layers - 1), v))
                   and len(set(v)) == len(v), f"must be distinct layer indices of {target.name} (0..{n_layers - 1})")
    return tuple(sorted(layers("eagle_aux_hidden_state_layer_ids", ids)))


def check_target(target):
    if not isinstance(target, Llama):
        raise ValueError(f"an EAGLE-3 head reads states inside a Llama-family target; {target.name} is not one")


def build(hf, target):
    """The head for config.json `hf`; a ValueError where it cannot draft for `target`."""
    check_target(target)
    config = eagle.llama_config(hf, target)
    wide = check(hf, "target_hidden_size", COUNT, config.dim)
    if wide != target.hidden_size:
        raise ValueError(f"an EAGLE-3 head for hidden states of {wide} cannot draft for {target.name}, whose "
                         f"hidden states have {target.hidden_size}")
    size = check(hf, "draft_vocab_size", COUNT, target.vocab_size)
    if size > target.vocab_size:
        raise ValueError(f"draft_vocab_size {size} is more than the target's {target.vocab_size} tokens")
    return Eagle3Head(config, target, taps_from_hf(hf, target), size, check(hf, "norm_before_residual", FLAG, False))


def convert_weights(weights, head):
    """Published names -> ours: midlayer.* as Llama layer 0, d2t's offsets as target ids, t2d dropped."""
    config = head.config
    weights = {name.removeprefix("model."): tensor for name, tensor in weights.items() if name != "t2d"}
    layer = {name.replace("midlayer.", "layers.0.", 1): weights.pop(name) for name in list(weights)
             if name.startswith("midlayer.")}
    out = {**convert_hf_weights(layer, config), **weights}
    embedding = out.pop("embed_tokens.weight", None)
    if head.embedding is not None and embedding is not None:
        out["embedding.weight"] = embedding
    offsets = out.pop("d2t", None)
    if offsets is not None and len(offsets) != config.vocab_size:  # the whole vocabulary: no mapping (EAGLE's own)
        out["draft_vocab"] = torch.arange(len(offsets)) + offsets.long()
    return out


def published(head):
    """Our tensors under the published names (convert_weights' inverse)."""
    out = {}
    for name, tensor in eagle.published(head).items():
        if name == "draft_vocab":
            out["d2t"] = tensor - torch.arange(len(tensor), device=tensor.device)
            out["t2d"] = torch.zeros(head.vocab_size, dtype=torch.bool).index_fill_(0, tensor.cpu(), True)
        elif name != "embedding.weight":
            out[name.replace("layers.0.", "midlayer.", 1)] = tensor
    return out
