"""GPT-2 (Radford et al. 2019): learned absolute positions, pre-LayerNorm blocks, GELU MLP, head tied to wte."""

from dataclasses import dataclass
from functools import partial

import torch.nn.functional as F
from torch import nn

from .base import CachedLM, Family, Embedding, KVCache, Linear, compile_region
from .checks import COUNT, FLAG, POSITIVE, TEXT, check
from .kernels import additive, attend_cache, causal_mask, elementwise, rows_as_read

# HF activation names -> F.gelu's `approximate`; "gelu_new" (the original GPT-2) is the tanh approximation.
GELU_APPROXIMATION = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh", "gelu": "none"}


@dataclass
class GPT2Config:
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_positions: int = 1024
    vocab_size: int = 50257
    layer_norm_epsilon: float = 1e-5
    activation_function: str = "gelu_new"
    n_inner: int = 3072  # MLP width; HF stores null for the default 4 * n_embd

    # config.json's layer count -> the checkpoint's name for the stack of layers (checkpoint.check_layer_counts)
    LAYER_STACKS = {"n_layer": "h"}

    @classmethod
    def from_hf(cls, hf):
        activation = check(hf, "activation_function", TEXT, "gelu_new")
        if activation not in GELU_APPROXIMATION:
            raise ValueError(f"GPT-2 activation_function {activation!r} is not supported; "
                             f"minispec supports {', '.join(GELU_APPROXIMATION)}")
        # These variants change the attention math; refuse them rather than compute something else.
        if check(hf, "scale_attn_by_inverse_layer_idx", FLAG, False) or not check(hf, "scale_attn_weights", FLAG, True):
            raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx or without scale_attn_weights "
                             "are not supported")
        if not check(hf, "tie_word_embeddings", FLAG, True):
            raise ValueError("GPT-2 with an untied lm_head (tie_word_embeddings=false) is not supported")
        n_embd, n_head = check(hf, "n_embd", COUNT), check(hf, "n_head", COUNT)
        if n_embd % n_head:  # heads split the width evenly
            raise ValueError(f"n_embd {n_embd} is not a multiple of n_head {n_head}")
        return cls(n_embd=n_embd, n_layer=check(hf, "n_layer", COUNT), n_head=n_head,
                   n_positions=check(hf, "n_positions", COUNT), vocab_size=check(hf, "vocab_size", COUNT),
                   layer_norm_epsilon=check(hf, "layer_norm_epsilon", POSITIVE, 1e-5),
                   activation_function=activation, n_inner=check(hf, "n_inner", COUNT, 4 * n_embd))


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd)  # q, k, v in one matmul
        self.c_proj = Linear(config.n_embd, config.n_embd)
        self.kv_cache = None  # set by GPT2.setup_caches

    def forward(self, qkv, input_pos, mask, layout):
        """The attention of c_attn's output qkv [batch, seq_len, 3 * dim] (keys and values written to the cache)."""
        batch, seq_len, _ = qkv.shape
        q, k, v = qkv.split(self.n_head * self.head_dim, dim=-1)  # fewer heads when sharded (tp.py)
        q, k, v = (t.view(batch, seq_len, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        k, v = self.kv_cache.update(input_pos, k, v)
        y = attend_cache(q, k, v, mask, layout=layout)
        return self.c_proj(y.transpose(1, 2).reshape(batch, seq_len, -1))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = Linear(config.n_embd, config.n_inner)
        self.c_proj = Linear(config.n_inner, config.n_embd)
        self.approximate = GELU_APPROXIMATION[config.activation_function]

    def forward(self, x):
        return self.c_proj(elementwise(partial(F.gelu, approximate=self.approximate), self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    # compile regions around the cache write, as llama.py's TransformerBlock has them
    def forward(self, x, input_pos, mask, layout):
        return self.finish(x + self.attn(self.project(x), input_pos, mask, layout))

    @compile_region
    def project(self, x):
        return self.attn.c_attn(self.ln_1(x))

    @compile_region
    def finish(self, x):
        return x + self.mlp(self.ln_2(x))


class GPT2(CachedLM):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    @property
    def context_length(self):
        return self.config.n_positions

    @property
    def head(self):
        return self.wte  # GPT-2's head is tied to the token embedding

    def setup_caches(self, batch_size, max_seq_len):
        super().setup_caches(batch_size, max_seq_len)
        for block in self.h:  # the block's own head count: fewer than the config's when sharded (models/tp.py)
            block.attn.kv_cache = KVCache(batch_size, block.attn.n_head, self.cache_max_seq_len, block.attn.head_dim,
                                          self.dtype, self.device)

    def features(self, tokens, input_pos, layout=None, keys=None, last=None):
        positions = input_pos if layout is None else layout.positions  # a tree's tokens: their depths
        mask = rows_as_read(additive(causal_mask(positions, keys or self.cache_max_seq_len)))
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.h:
            x = block(x, input_pos, mask, layout)
        return self.ln_f(x if last is None else x[:, x.shape[1] - last:])

    def embed_tokens(self, tokens):
        return self.wte(tokens)

    def logits(self, hidden):
        return self.wte.unembed(hidden).float()


CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def convert_hf_weights(weights, config):
    """HF GPT-2 keys -> ours: no `transformer.` prefix, mask buffers or tied lm_head; Conv1D's [in, out] turned."""
    out = {}
    for name, tensor in weights.items():
        name = name.removeprefix("transformer.")
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue
        if name.endswith(CONV1D_WEIGHTS):
            tensor = tensor.t().contiguous()
        out[name] = tensor
    return out


FAMILY = Family(GPT2Config, GPT2, convert_hf_weights)
