"""T5 (Raffel et al. 2020) and T5 v1.1 / Flan-T5: an encoder-decoder with RMS LayerNorm, no 1/sqrt(d)
attention scaling and learned relative position buckets. v1.0: a ReLU feed-forward and a tied head
(decoder output scaled by d_model^-0.5); v1.1: a gated GELU feed-forward and an untied, unscaled head.
`encode` runs the encoder once per request into cross-attention memory padded to a power of two, so that
a compiled decoder sees the same shapes whatever the prompt's length.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .base import CachedLM, Family, Embedding, KVCache, Linear, RMSNorm
from .checks import COUNT, FLAG, INDEX, POSITIVE, TEXT, check
from .kernels import attend, attend_cache, causal_mask, elementwise, padded_rows

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}

# config.json keys taken as they are, and what each must be
SIZE_KEYS = {
    "vocab_size": COUNT, "d_model": COUNT, "d_kv": COUNT, "d_ff": COUNT, "num_layers": COUNT, "num_heads": COUNT,
    "relative_attention_num_buckets": COUNT, "relative_attention_max_distance": COUNT, "layer_norm_epsilon": POSITIVE,
}


@dataclass
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64  # per-head width; n_heads * d_kv need not equal d_model
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int = 6
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    activation: str = "relu"
    gated: bool = False  # v1.1: act(wi_0 x) * (wi_1 x)
    scale_decoder_outputs: bool = True  # multiply by d_model^-0.5 before the head (T5 v1.0's tied head)
    decoder_start_token_id: int = 0

    # config.json's layer counts -> the checkpoint's names for the stacks of layers (checkpoint.check_layer_counts)
    LAYER_STACKS = {"num_layers": "encoder.block", "num_decoder_layers": "decoder.block"}

    @classmethod
    def from_hf(cls, hf):
        proj = check(hf, "feed_forward_proj", TEXT, "relu")
        parts = proj.split("-")
        gated = parts[0] == "gated"
        # "gated-gelu" means the tanh approximation, as in the reference (its backwards-compatibility rule).
        activation = "gelu_new" if proj == "gated-gelu" else parts[-1]
        if activation not in ACTIVATIONS or len(parts) > 2 or (len(parts) == 2 and not gated):
            raise ValueError(f"T5 feed_forward_proj {proj!r} is not supported; use '<act>' or 'gated-<act>' with act "
                             f"one of {', '.join(ACTIVATIONS)}")
        # Configs written by transformers >= 5 say scale_decoder_outputs; older ones imply it by a tied head.
        scale = check(hf, "scale_decoder_outputs", FLAG, check(hf, "tie_word_embeddings", FLAG, True))
        # absent or null keys: the reference's defaults
        sizes = {key: check(hf, key, kind) for key, kind in SIZE_KEYS.items() if hf.get(key) is not None}
        vocab_size = sizes.get("vocab_size", cls.vocab_size)
        buckets = sizes.get("relative_attention_num_buckets", cls.relative_attention_num_buckets)
        distance = sizes.get("relative_attention_max_distance", cls.relative_attention_max_distance)
        if buckets < 4 or distance <= buckets // 2:  # else the log-spaced buckets divide by zero or run backwards
            raise ValueError(f"relative_attention_num_buckets {buckets} and relative_attention_max_distance {distance} "
                             "do not make buckets: they need at least 4 buckets and a distance above half their number")
        # Without decoder_start_token_id the reference starts from bos_token_id, else T5's pad token.
        keys = ("decoder_start_token_id", "bos_token_id", "pad_token_id")
        start = next((check(hf, key, INDEX) for key in keys if hf.get(key) is not None), 0)
        if start >= vocab_size:
            raise ValueError(f"decoder_start_token_id {start} is outside the vocabulary of {vocab_size} tokens")
        layers = check(hf, "num_decoder_layers", COUNT, sizes.get("num_layers", cls.num_layers))
        return cls(**sizes, num_decoder_layers=layers, activation=activation, gated=gated,
                   scale_decoder_outputs=scale, decoder_start_token_id=start)


def relative_position_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Bucket of each (key position - query position): exact for small distances, log-spaced up to
    max_distance, one bucket beyond; the encoder's (bidirectional) spends half the buckets on keys ahead."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    # Clamping to max_exact only avoids log(0); those distances take the exact branch below.
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + log_ratio * (num_buckets - max_exact)).long().clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


class SelfAttention(nn.Module):
    """Multi-head attention without 1/sqrt(d) scaling: the encoder's (no cache) or the decoder's self-attention."""

    def __init__(self, config):
        super().__init__()
        self.n_heads, self.d_kv = config.num_heads, config.d_kv
        inner = config.num_heads * config.d_kv
        self.q, self.k, self.v = (Linear(config.d_model, inner, bias=False) for _ in "qkv")
        self.o = Linear(inner, config.d_model, bias=False)
        self.kv_cache = None  # decoder only: set by T5.setup_caches

    def heads(self, x):
        """[batch, len, n_heads * d_kv] -> [batch, n_heads, len, d_kv]"""
        return x.view(x.shape[0], x.shape[1], self.n_heads, self.d_kv).transpose(1, 2)

    def output(self, y):
        """The heads' outputs y [b, h, t, d] -> [b, t, d_model]."""
        return self.o(y.transpose(1, 2).reshape(y.shape[0], y.shape[2], -1))

    def forward(self, x, mask, input_pos=None, layout=None):
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        if self.kv_cache is None:  # the encoder: q, k and v of the prompt; mask: additive [1, h, t, t]
            return self.output(attend(q, k, v, mask, scale=1.0))
        k, v = self.kv_cache.update(input_pos, k, v)  # the decoder: over its cache, in the cache's order
        return self.output(attend_cache(q, k, v, mask, scale=1.0, layout=layout))


def reuse_or_copy(buffer, value, row=None):
    """`value` copied into `buffer` (with `row`: its row 0 into that row) where it fits, so that a compiled graph sees
    the same tensor; else a new buffer holding it, not an inference tensor (refilled outside inference_mode)."""
    if row is not None:
        buffer[row] = value[0]
        return buffer
    if buffer is not None and buffer.shape == value.shape:
        return buffer.copy_(value)
    with torch.inference_mode(False):
        return value.clone(memory_format=torch.contiguous_format)


class CrossAttention(SelfAttention):
    """Decoder attention over the encoder output, whose keys/values `remember` computes once per request."""

    def __init__(self, config):
        super().__init__(config)
        # [encoder batch, heads, capacity, d_kv]: the prompt's positions, then zeros (masked out)
        self.register_buffer("memory_k", None, persistent=False)
        self.register_buffer("memory_v", None, persistent=False)

    first_row = 0  # batched requests: the memory row of the forward's batch row 0 (CachedLM.rows_from)

    def remember(self, encoder_out, row=None):
        """Keys and values of encoder_out [batch, capacity, d_model] (zeros past the prompt); `row`: into that row."""
        k, v = self.heads(self.k(encoder_out)), self.heads(self.v(encoder_out))
        self.memory_k, self.memory_v = reuse_or_copy(self.memory_k, k, row), reuse_or_copy(self.memory_v, v, row)

    def forward(self, x, memory_mask):
        rows = x.shape[0]
        if self.memory_k.shape[0] == 1:  # one prompt serves every row (beam search): broadcast, don't copy
            k, v = (memory.expand(rows, -1, -1, -1) for memory in (self.memory_k, self.memory_v))
        else:  # a prompt per row (a beam per row, or batched requests from `first_row` on)
            k, v, memory_mask = (t[self.first_row:self.first_row + rows]
                                 for t in (self.memory_k, self.memory_v, memory_mask))
        return self.output(attend(self.heads(self.q(x)), k, v, memory_mask, scale=1.0))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.act = ACTIVATIONS[config.activation]
        self.gated = config.gated
        if config.gated:
            self.wi_0, self.wi_1 = (Linear(config.d_model, config.d_ff, bias=False) for _ in range(2))
        else:
            self.wi = Linear(config.d_model, config.d_ff, bias=False)
        self.wo = Linear(config.d_ff, config.d_model, bias=False)

    def forward(self, x):
        if self.gated:
            return self.wo(elementwise(self.act, self.wi_0(x)) * self.wi_1(x))
        return self.wo(elementwise(self.act, self.wi(x)))


class Layer(nn.Module):
    """An encoder layer, or with `cross` a decoder layer (cross-attention between the two halves)."""

    def __init__(self, config, cross=False):
        super().__init__()
        d, eps = config.d_model, config.layer_norm_epsilon
        self.self_attn_norm, self.self_attn = RMSNorm(d, eps), SelfAttention(config)
        if cross:
            self.cross_attn_norm, self.cross_attn = RMSNorm(d, eps), CrossAttention(config)
        self.ffn_norm, self.ffn = RMSNorm(d, eps), FeedForward(config)

    def forward(self, x, mask, input_pos=None, memory_mask=None, layout=None):
        x = x + self.self_attn(self.self_attn_norm(x), mask, input_pos, layout)
        if memory_mask is not None:
            x = x + self.cross_attn(self.cross_attn_norm(x), memory_mask)
        return x + self.ffn(self.ffn_norm(x))


class T5(CachedLM):
    is_encoder_decoder = True

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model)  # shared by encoder, decoder (and tied head)
        self.encoder_position_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
        self.encoder = nn.ModuleList(Layer(config) for _ in range(config.num_layers))
        self.encoder_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.decoder_position_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_heads)
        self.decoder = nn.ModuleList(Layer(config, cross=True) for _ in range(config.num_decoder_layers))
        self.decoder_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        # Always its own parameter: convert_hf_weights fills it from the embedding when the checkpoint is tied.
        self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)
        # Boolean [1, 1, 1, capacity]: the memory positions that hold the prompt (an int would specialize graphs).
        self.register_buffer("memory_mask", None, persistent=False)

    context_length = None  # relative positions: no hard limit

    @property
    def head(self):
        return self.lm_head  # a copy of the embedding when the checkpoint ties them

    @property
    def encoder_batch_size(self):
        """Batch of the last encode(); 0 before any."""
        memory = self.decoder[0].cross_attn.memory_k
        return 0 if memory is None else memory.shape[0]

    def setup_caches(self, batch_size, max_seq_len):
        super().setup_caches(batch_size, max_seq_len)
        for layer in self.decoder:
            layer.self_attn.kv_cache = KVCache(batch_size, layer.self_attn.n_heads, self.cache_max_seq_len,
                                               self.config.d_kv, self.dtype, self.device)

    def position_bias(self, table, query_pos, key_pos, bidirectional):
        """Additive bias [1 or rows, heads, n, len(key_pos)] for query_pos [n] or [rows, n], for a stack's layers."""
        c = self.config
        buckets = relative_position_bucket(key_pos - query_pos[..., None], bidirectional,
                                           c.relative_attention_num_buckets, c.relative_attention_max_distance)
        bias = table(buckets).movedim(-1, -3)
        return bias if query_pos.dim() == 2 else bias.unsqueeze(0)

    def run_encoder(self, prompt):
        """The encoder over `prompt` [batch, len] -> its output [batch, len, d_model]."""
        if prompt.dim() != 2 or prompt.shape[1] == 0:
            raise ValueError(f"T5.encode expects token ids of shape [batch, length >= 1], got {tuple(prompt.shape)}")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}) for {self.name}")
        positions = torch.arange(prompt.shape[1], device=prompt.device)
        bias = self.position_bias(self.encoder_position_bias, positions, positions, bidirectional=True)
        x = self.embed(prompt)
        for layer in self.encoder:
            x = layer(x, bias)
        self.encoder_calls += 1
        return self.encoder_norm(x)

    def encode(self, prompt, row=None):
        """Run the encoder once over `prompt` [batch, len] into each decoder layer's cross-attention memory
        (with `row`, into that row of a batch's); return the decoder's start token [batch, 1]."""
        x, n = self.run_encoder(prompt), prompt.shape[1]
        # Padded to a power of two, and never shrunk, so that later prompts reuse the same buffers (and graphs).
        held = 0 if self.memory_mask is None else self.memory_mask.shape[-1]
        capacity = held if row is not None else max(64, 1 << (n - 1).bit_length(), held)
        x = F.pad(x, (0, 0, 0, capacity - n))  # zero rows project to zero keys/values (no biases)
        for layer in self.decoder:
            layer.cross_attn.remember(x, row)
        in_prompt = (torch.arange(capacity, device=prompt.device) < n).view(1, 1, 1, capacity)
        self.memory_mask = reuse_or_copy(self.memory_mask, in_prompt, row)
        return torch.full((prompt.shape[0], 1), self.config.decoder_start_token_id, device=prompt.device)

    def prepare_batch(self, rows, longest_prompt):
        """Cross-attention memory for `rows` prompts of up to `longest_prompt` tokens, each filled by encode_row."""
        capacity = max(64, 1 << (longest_prompt - 1).bit_length())
        held = self.memory_mask
        if held is not None and held.shape[0] >= rows and held.shape[-1] >= capacity:
            return  # the memory already has room: each row is refilled by encode_row, and only those are read
        with torch.inference_mode(False):
            for layer in self.decoder:
                attn = layer.cross_attn
                shape = (rows, attn.n_heads, capacity, self.config.d_kv)  # the layer's heads (fewer when sharded)
                attn.memory_k, attn.memory_v = (torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in "kv")
            self.memory_mask = torch.zeros((rows, 1, 1, capacity), dtype=torch.bool, device=self.device)

    def move_row(self, source, destination, length=None):
        super().move_row(source, destination, length)
        for layer in self.decoder:
            attn = layer.cross_attn
            attn.memory_k[destination], attn.memory_v[destination] = attn.memory_k[source], attn.memory_v[source]
        self.memory_mask[destination] = self.memory_mask[source]

    def features(self, tokens, input_pos, layout=None, keys=None, last=None):
        """The decoder's final states (scaled as the tied head expects them)."""
        if self.encoder_batch_size == 0:
            raise ValueError(f"{self.name}: call encode(prompt) before decoding")
        if self.encoder_batch_size != 1 and self.encoder_batch_size < tokens.shape[0]:
            raise ValueError(f"{self.name}: a decoder batch of {tokens.shape[0]} cannot attend to an encoded batch "
                             f"of {self.encoder_batch_size} (it must be 1, or hold a row for each)")
        key_pos = torch.arange(keys or self.cache_max_seq_len, device=tokens.device)
        positions = input_pos if layout is None else layout.positions
        bias = self.position_bias(self.decoder_position_bias, positions, key_pos, bidirectional=False)
        causal = causal_mask(positions, len(key_pos))  # [n, S], or [rows, n, S] per row
        mask = padded_rows(bias.masked_fill(~(causal if causal.dim() == 2 else causal.unsqueeze(1)), float("-inf")))
        x = self.embed(tokens)
        for layer in self.decoder:
            x = layer(x, mask, input_pos, self.memory_mask, layout)
        x = self.decoder_norm(x if last is None else x[:, x.shape[1] - last:])
        return x * self.config.d_model**-0.5 if self.config.scale_decoder_outputs else x

    def embed_tokens(self, tokens):
        return self.embed(tokens)

    def logits(self, hidden):
        return self.lm_head(hidden).float()

    def reorder_cache(self, beam_idx):
        super().reorder_cache(beam_idx)
        if self.encoder_batch_size > 1:  # one prompt per row: its encoder states follow the row
            for layer in self.decoder:
                for memory in (layer.cross_attn.memory_k, layer.cross_attn.memory_v):
                    memory.copy_(memory.index_select(0, beam_idx))


# The sublayers of HF's "{stack}.block.N.layer.{i}", in order, and HF's names of their modules (each with a
# layer_norm); the stacks' tables of relative positions sit in block 0.
SUBLAYERS = {"encoder": ("self_attn", "ffn"), "decoder": ("self_attn", "cross_attn", "ffn")}
HF_MODULES = {"self_attn": "SelfAttention", "cross_attn": "EncDecAttention", "ffn": "DenseReluDense"}
RENAMED = {"shared.weight": "embed.weight", "encoder.final_layer_norm.weight": "encoder_norm.weight",
           "decoder.final_layer_norm.weight": "decoder_norm.weight",
           "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "encoder_position_bias.weight",
           "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight": "decoder_position_bias.weight"}
DROPPED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight",  # copies of shared.weight
           "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight")  # cross-attention has no bias


def layer_key(name):
    """HF's "{stack}.block.N.layer.{i}.{module}..." -> ours, "{stack}.N.{sublayer}..."; others unchanged."""
    stack, _, rest = name.partition(".block.")
    layer, _, rest = rest.partition(".")
    for i, kind in enumerate(SUBLAYERS.get(stack, ())):
        for hf, ours in ((HF_MODULES[kind], kind), ("layer_norm", f"{kind}_norm")):
            prefix = f"layer.{i}.{hf}."
            if rest.startswith(prefix):
                return f"{stack}.{layer}.{ours}.{rest[len(prefix):]}"
    return name


def convert_hf_weights(weights, config):
    """HF T5 keys -> ours. Unknown keys pass through unchanged so the loader names them."""
    out = {RENAMED[name] if name in RENAMED else layer_key(name): tensor for name, tensor in weights.items()
           if name not in DROPPED}
    if "lm_head.weight" not in out and "embed.weight" in out:  # tied checkpoints store the head once
        out["lm_head.weight"] = out["embed.weight"]
    return out


FAMILY = Family(T5Config, T5, convert_hf_weights)
