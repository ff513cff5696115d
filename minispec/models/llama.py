"""Llama 1/2/3 and its close relatives: Mistral (sliding-window attention), Qwen2 (q/k/v bias), Qwen3
(per-head RMSNorm on q and k), SmolLM.

Pre-norm decoder: RMSNorm -> grouped-query attention with RoPE -> RMSNorm -> SwiGLU MLP. Layout follows
gpt-fast: q/k/v projections (and gate/up) are fused into one matmul each.
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from . import backend
from .base import (Attention, Decoder, DecoderConfig, Family, GatedMLP, RMSNorm, compile_region,
                   convert_decoder_weights, rope_cos_sin)
from .checks import COUNT, FLAG, INDEX, LAYER_TYPES, NUMBER, POSITIVE, TABLE, TEXT, THETA, check

# The RoPE scalings supported, and the parameters each needs from the checkpoint's config.
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              "yarn": ("factor",)}
# Every RoPE parameter the code below reads, and what it must be.
ROPE_VALUES = {
    "factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
    "original_max_position_embeddings": COUNT, "beta_fast": POSITIVE, "beta_slow": POSITIVE,
    "attention_factor": POSITIVE, "mscale": NUMBER, "mscale_all_dim": NUMBER, "truncate": FLAG,
}
# The reference's defaults for keys config.json leaves out, where a null value means something else.
ABSENT = {"mistral": {"num_key_value_heads": 8, "sliding_window": 4096},
          "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096},
          "qwen3": {"num_key_value_heads": 32, "sliding_window": 4096, "head_dim": 128}}
# Keys the reference never reads for a model type (Qwen3's MLP has no bias, whatever mlp_bias says).
UNREAD = {"qwen3": ("mlp_bias",)}


@dataclass
class LlamaConfig(DecoderConfig):
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = field(default_factory=dict)  # rope_type plus its parameters (factor, ...)
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    windows: tuple = ()  # per layer: sliding-window size, or None for full causal attention
    qk_norm: bool = False  # Qwen3: each q and k head RMS-normed (its own weights) before RoPE

    @classmethod
    def from_hf(cls, hf):
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"llama: hidden_act {hf['hidden_act']!r} is not supported (only 'silu')")
        model_type = hf.get("model_type")
        qwen2, mistral = model_type == "qwen2", model_type == "mistral"
        hf = {**ABSENT.get(model_type, {}), **hf}
        hf = {key: value for key, value in hf.items() if key not in UNREAD.get(model_type, ())}
        rope_theta, rope = rope_settings(hf)
        n_layers, n_heads = check(hf, "num_hidden_layers", COUNT), check(hf, "num_attention_heads", COUNT)
        n_kv_heads, dim = check(hf, "num_key_value_heads", COUNT, n_heads), check(hf, "hidden_size", COUNT)
        if n_heads % n_kv_heads:  # each K/V head serves a whole group of query heads
            raise ValueError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
        attention_bias = not (qwen2 or mistral) and check(hf, "attention_bias", FLAG, False)
        return cls(
            vocab_size=check(hf, "vocab_size", COUNT), dim=dim, n_layers=n_layers, n_heads=n_heads,
            n_kv_heads=n_kv_heads, head_dim=check(hf, "head_dim", COUNT, dim // n_heads),
            intermediate_size=check(hf, "intermediate_size", COUNT),
            max_seq_len=check(hf, "max_position_embeddings", COUNT), norm_eps=check(hf, "rms_norm_eps", POSITIVE, 1e-6),
            rope_theta=float(rope_theta), rope_scaling=rope,
            qkv_bias=qwen2 or attention_bias,  # Qwen2's q/k/v always have a bias, its output projection none
            out_bias=attention_bias, mlp_bias=not (qwen2 or mistral) and check(hf, "mlp_bias", FLAG, False),
            tie_word_embeddings=check(hf, "tie_word_embeddings", FLAG, False),
            windows=sliding_windows(hf, model_type, n_layers), qk_norm=model_type == "qwen3")


def sliding_windows(hf, model_type, n_layers):
    """Each layer's sliding window (None: full attention), as the reference reads them: Llama has none; Mistral
    slides every layer, or those layer_types names (read as Ministral's); Qwen2 and Qwen3 only with
    use_sliding_window, in the layers layer_types names or else from max_window_layers on."""
    if model_type not in ("mistral", "qwen2", "qwen3"):
        return (None,) * n_layers
    window = check(hf, "sliding_window", COUNT, None)  # checked even when unused, as the reference checks it
    layer_types = check(hf, "layer_types", LAYER_TYPES, None)
    if model_type in ("qwen2", "qwen3"):
        window = window if check(hf, "use_sliding_window", FLAG, False) else None
        if layer_types is None:
            first = check(hf, "max_window_layers", INDEX, 28)
            return tuple(window if i >= first else None for i in range(n_layers))
    if layer_types is None:
        return (window,) * n_layers
    if len(layer_types) != n_layers:
        raise ValueError(f"layer_types lists {len(layer_types)} layers but num_hidden_layers is {n_layers}")
    if window is None and "sliding_attention" in layer_types:
        raise ValueError("layer_types has sliding_attention layers but no sliding_window is in use "
                         "(use_sliding_window false or sliding_window null)")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def rope_settings(hf):
    """config.json's rope_theta, and its RoPE scaling: {rope_type, the parameters that type needs}."""
    # transformers < 5: rope_theta at top level, scaling in rope_scaling; >= 5: all in rope_parameters,
    # which a rope_scaling replaces whole (as in the reference).
    scaling, parameters = check(hf, "rope_scaling", TABLE, {}), check(hf, "rope_parameters", TABLE, {})
    rope = scaling or parameters
    rope_theta = check(rope, "rope_theta", THETA, None) or check(hf, "rope_theta", THETA, 10000.0)
    rope_type = check(rope, "rope_type", TEXT, None) or check(rope, "type", TEXT, "default", "rope ")
    rope = {key: value for key, value in rope.items() if key not in ("rope_theta", "type")} | {"rope_type": rope_type}
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"llama: rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)})")
    missing = [key for key in ROPE_TYPES[rope_type] if rope.get(key) is None]
    if missing:
        raise ValueError(f"llama: {rope_type} rope scaling needs {', '.join(missing)} in rope_scaling")
    for key, kind in ROPE_VALUES.items():
        check(rope, key, kind, None, "rope ")
    return rope_theta, rope


def rope_frequencies(config):
    """Inverse frequencies of each rotated pair, with the checkpoint's context-extension scaling."""
    inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
    scaling = config.rope_scaling
    if scaling["rope_type"] == "linear":  # positions divided by `factor`
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        # Llama 3.1: slow the low frequencies by `factor`, keep the high ones, interpolate in between.
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_context = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_context / wavelen - low) / (high - low)).clamp(0, 1)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    if scaling["rope_type"] == "yarn":
        # YaRN: pairs turning fewer than beta_slow times over the old context are slowed by `factor`, more
        # than beta_fast times kept, a linear ramp in the pair index between.
        old_context = scaling.get("original_max_position_embeddings") or config.max_seq_len

        def pair_turning(turns):  # the (fractional) pair index that turns `turns` times over the old context
            return config.head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        fast, slow = pair_turning(scaling.get("beta_fast") or 32), pair_turning(scaling.get("beta_slow") or 1)
        if scaling.get("truncate", True):
            fast, slow = math.floor(fast), math.ceil(slow)
        fast, slow = max(fast, 0), min(slow, config.head_dim - 1)
        kept = 1 - ((torch.arange(len(inv_freq), dtype=torch.float32) - fast) / ((slow - fast) or 0.001)).clamp(0, 1)
        return inv_freq / scaling["factor"] * (1 - kept) + inv_freq * kept
    return inv_freq


def rope_attention_factor(scaling):
    """YaRN scales cos and sin (so every attention logit) to offset the flatter attention that slowed
    frequencies give: 0.1·ln(factor) + 1, or the checkpoint's own attention_factor / mscale ratio."""
    if scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return scaling["attention_factor"]

    def magnitude(factor, mscale=1.0):
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return magnitude(factor, mscale) / magnitude(factor, mscale_all_dim)
    return magnitude(factor)


def rope_tables(config, max_seq_len, device):
    """cos and signed sin [max_seq_len, head_dim] (base.rope_cos_sin) with the checkpoint's scaling."""
    return rope_cos_sin(rope_frequencies(config).to(device), max_seq_len, rope_attention_factor(config.rope_scaling))


class LayerNorms(NamedTuple):
    """A layer's norms (TransformerBlock.norms)."""
    attention: Optional[nn.Module]  # None: the input goes in as it is (EAGLE-1's layer)
    ffn: nn.Module
    hidden: Optional[nn.Module] = None  # EAGLE-3's state's, beside the input's
    before_residual: bool = False  # EAGLE-3: the residual is the normed state, not the state


class TransformerBlock(nn.Module):
    def __init__(self, config, window):
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = Attention(config, window, RMSNorm, config.out_bias)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = GatedMLP(config, F.silu, config.mlp_bias)  # SwiGLU

    # The halves around the cache write are compile regions, compiled once for every layer (the write
    # stays outside: a region would hand the cache back as a copy); a region's outputs must not be views.
    def forward(self, x, input_pos, cos, sin, mask, layout):
        return self.finish(x + self.attention(self.project(x, cos, sin), input_pos, mask, layout))

    @compile_region
    def project(self, x, cos, sin):
        return self.attention.project(self.attention_norm(x), cos, sin)

    @compile_region
    def finish(self, x):
        return x + self.feed_forward(self.ffn_norm(x))

    def norms(self):
        """The layer's norms, as a backend's one call for the whole layer reads them."""
        return LayerNorms(None if isinstance(self.attention_norm, nn.Identity) else self.attention_norm, self.ffn_norm)


class Llama(Decoder):
    def __init__(self, config):
        super().__init__(config, TransformerBlock, RMSNorm)

    def setup_caches(self, batch_size, max_seq_len):
        super().setup_caches(batch_size, max_seq_len)
        cos, sin = rope_tables(self.config, self.cache_max_seq_len, self.device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def rope(self, positions):
        return ((self.rope_cos[positions], self.rope_sin[positions]),) * 2  # one table for every layer

    def fused_layers(self, x):
        return backend.current().fused_llama(self, x)


def convert_hf_weights(weights, config):
    """Hugging Face names -> ours (old checkpoints' saved RoPE frequencies left out: we recompute them)."""
    weights = {name: tensor for name, tensor in weights.items() if not name.endswith("rotary_emb.inv_freq")}
    return convert_decoder_weights(weights, config, {".post_attention_layernorm.": ".ffn_norm."})


FAMILY = Family(LlamaConfig, Llama, convert_hf_weights)
