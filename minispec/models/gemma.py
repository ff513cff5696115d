"""Gemma 2 and Gemma 3 text models (also the text half of Gemma 3's image-text checkpoints): a Llama-like
decoder whose RMSNorms scale by (1 + weight) in float32, with norms after attention and the MLP too,
sliding-window layers among global ones, embeddings scaled by sqrt(hidden), a gated tanh-GELU MLP,
scores scaled by query_pre_attn_scalar^-0.5 and a tied head. Gemma 3 adds q/k norms and a RoPE base per
kind of layer; Gemma 2 soft-caps scores and logits (cap * tanh(x / cap)).
"""

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .base import (Attention, Decoder, DecoderConfig, Family, GatedMLP, compile_region, convert_decoder_weights,
                   rope_cos_sin)
from .checks import COUNT, FLAG, LAYER_TYPES, POSITIVE, TABLE, TEXT, THETA, check

# The reference's defaults (Gemma3TextConfig, Gemma2Config) for the keys a config.json may leave out.
GEMMA3 = {"num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 131072, "tie_word_embeddings": True}
ABSENT = {"gemma3": GEMMA3, "gemma2": {**GEMMA3, "max_position_embeddings": 8192, "rope_theta": 10000.0,
                                      "sliding_window_pattern": 2, "attn_logit_softcapping": 50.0,
                                      "final_logit_softcapping": 30.0}}
SOFTCAPS = ("attn_logit_softcapping", "final_logit_softcapping")  # null: no capping, not the default
# Hugging Face names -> ours, beside base.DECODER_RENAMES; an image-text checkpoint's vision half left out.
RENAMES = {".post_attention_layernorm.": ".post_attention_norm.", ".pre_feedforward_layernorm.": ".ffn_norm.",
           ".post_feedforward_layernorm.": ".post_ffn_norm."}
VISION = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


@dataclass
class GemmaConfig(DecoderConfig):
    norm_eps: float
    rope_theta: float  # global layers'
    rope_factor: float  # global layers' linear RoPE scaling: positions divided by it
    local_rope_theta: float  # sliding layers'
    query_scale: float  # query_pre_attn_scalar^-0.5
    windows: tuple  # per layer: sliding-window size, or None for global attention
    qkv_bias: bool = False
    logit_softcap: float = 0.0  # final_logit_softcapping (0: none): logits = cap * tanh(logits / cap)
    attention_softcap: float = 0.0  # attn_logit_softcapping (0: none): the same on attention scores
    qk_norm: bool = True  # Gemma 3's per-head q and k RMSNorm (Gemma 2 has none)
    tie_word_embeddings: bool = True

    @classmethod
    def from_hf(cls, hf):
        if hf.get("model_type") == "gemma3":  # an image-text checkpoint: its text model's config
            hf = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **check(hf, "text_config", TABLE)}
        gemma2 = hf.get("model_type") == "gemma2"
        hf = {**ABSENT["gemma2" if gemma2 else "gemma3"],
              **{key: value for key, value in hf.items() if value is not None or key in SOFTCAPS}}
        activation = check(hf, "hidden_activation", TEXT, "gelu_pytorch_tanh")
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"gemma: hidden_activation {activation!r} is not supported (only 'gelu_pytorch_tanh')")
        if check(hf, "use_bidirectional_attention", FLAG, False):
            raise ValueError("gemma: use_bidirectional_attention is not supported (a decoder attends causally)")
        n_layers, n_heads = check(hf, "num_hidden_layers", COUNT), check(hf, "num_attention_heads", COUNT)
        n_kv_heads = check(hf, "num_key_value_heads", COUNT)
        if n_heads % n_kv_heads:
            raise ValueError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
        (theta, factor), local_theta = rope_settings(hf)
        if gemma2 and factor != 1.0:
            raise ValueError("gemma: Gemma 2 with rope scaling is not supported (only default RoPE)")
        return cls(
            vocab_size=check(hf, "vocab_size", COUNT), dim=check(hf, "hidden_size", COUNT), n_layers=n_layers,
            n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=check(hf, "head_dim", COUNT),
            intermediate_size=check(hf, "intermediate_size", COUNT),
            max_seq_len=check(hf, "max_position_embeddings", COUNT), norm_eps=check(hf, "rms_norm_eps", POSITIVE),
            rope_theta=float(theta), rope_factor=float(factor),
            local_rope_theta=float(theta if gemma2 else local_theta),  # Gemma 2: one RoPE base
            query_scale=check(hf, "query_pre_attn_scalar", POSITIVE) ** -0.5, windows=sliding_windows(hf, n_layers),
            qkv_bias=check(hf, "attention_bias", FLAG, False),
            logit_softcap=float(check(hf, "final_logit_softcapping", POSITIVE, 0.0)),
            attention_softcap=float(check(hf, "attn_logit_softcapping", POSITIVE, 0.0)),
            qk_norm=not gemma2, tie_word_embeddings=check(hf, "tie_word_embeddings", FLAG))


def sliding_windows(hf, n_layers):
    """Each layer's window (None: global), from layer_types or else sliding_window_pattern (every pattern-th global)."""
    layer_types = check(hf, "layer_types", LAYER_TYPES, None)
    if layer_types is None:
        pattern = check(hf, "sliding_window_pattern", COUNT, 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {n_layers}")
    window = check(hf, "sliding_window", COUNT)
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types)


def rope_settings(hf):
    """((theta, linear factor) of the global layers, theta of the sliding ones): from rope_parameters by layer type
    (transformers >= 5; Gemma 2: one for all) and rope_scaling, or rope_theta and rope_local_base_freq."""
    parameters = check(hf, "rope_parameters", TABLE, {})
    if "full_attention" not in parameters and "sliding_attention" not in parameters:  # Gemma 2's: every layer's
        parameters = {"full_attention": parameters, "sliding_attention": parameters}
    full = {**check(parameters, "full_attention", TABLE, {}, "rope_parameters."),
            **check(hf, "rope_scaling", TABLE, {})}
    local = check(parameters, "sliding_attention", TABLE, {}, "rope_parameters.")
    for kind, rope in (("full_attention", full), ("sliding_attention", local)):
        rope_type = check(rope, "rope_type", TEXT, None) or check(rope, "type", TEXT, "default")
        if rope_type not in ("default", "linear") or rope_type == "linear" and kind == "sliding_attention":
            raise ValueError(f"gemma: {kind} rope_type {rope_type!r} is not supported (default; linear on global "
                             "layers)")
    factor = check(full, "factor", POSITIVE, 1.0) if (full.get("rope_type") or full.get("type")) == "linear" else 1.0
    theta = check(full, "rope_theta", THETA, None) or check(hf, "rope_theta", THETA, 1_000_000.0)
    local_theta = check(local, "rope_theta", THETA, None) or check(hf, "rope_local_base_freq", THETA, 10_000.0)
    return (theta, factor), local_theta


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by (1 + weight), the product in float32 before the cast back."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        wide = x.float()
        normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class TransformerBlock(nn.Module):
    def __init__(self, config, window):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, window, RMSNorm, config.qkv_bias, config.query_scale,
                                   config.attention_softcap)
        self.post_attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = GatedMLP(config, partial(F.gelu, approximate="tanh"))
        self.post_ffn_norm = RMSNorm(config.dim, config.norm_eps)

    # compile regions around the cache write, as llama.py's TransformerBlock has them
    def forward(self, x, input_pos, cos, sin, mask, layout):
        return self.finish(x, self.attention(self.project(x, cos, sin), input_pos, mask, layout))

    @compile_region
    def project(self, x, cos, sin):
        return self.attention.project(self.attention_norm(x), cos, sin)

    @compile_region
    def finish(self, x, attended):
        x = x + self.post_attention_norm(attended)
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))


class Gemma(Decoder):
    def __init__(self, config):
        super().__init__(config, TransformerBlock, RMSNorm)

    def setup_caches(self, batch_size, max_seq_len):
        super().setup_caches(batch_size, max_seq_len)
        c = self.config
        for name, theta, factor in (("rope", c.rope_theta, c.rope_factor), ("local_rope", c.local_rope_theta, 1.0)):
            pairs = torch.arange(0, c.head_dim, 2, dtype=torch.float32, device=self.device)
            cos, sin = rope_cos_sin(1.0 / theta ** (pairs / c.head_dim) / factor, self.cache_max_seq_len)
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    def rope(self, positions):
        return ((self.rope_cos[positions], self.rope_sin[positions]),
                (self.local_rope_cos[positions], self.local_rope_sin[positions]))

    def embed_tokens(self, tokens):
        x = self.tok_embeddings(tokens)
        return x * torch.tensor(self.config.dim ** 0.5, dtype=x.dtype)  # rounded to the dtype, as the reference

    def logits(self, hidden):
        logits = super().logits(hidden)
        cap = self.config.logit_softcap
        return logits if not cap else torch.tanh(logits / cap) * cap


def convert_hf_weights(weights, config):
    """Hugging Face names -> ours: an image-text checkpoint's text model, without its vision tower and projector."""
    renamed = ((name.replace("model.language_model.", "model.").replace("language_model.", ""), tensor)
               for name, tensor in weights.items())
    return convert_decoder_weights({name: tensor for name, tensor in renamed if not name.startswith(VISION)}, config,
                                   RENAMES)


FAMILY = Family(GemmaConfig, Gemma, convert_hf_weights)
