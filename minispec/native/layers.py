"""A Llama model's decoder layers as layer.cpp's one call takes them, laid out once (`LayerStack`) and
again only when a layer's weights or cache were replaced. Reads the modules without nn.Module's
__getattr__ (`_modules`, `_parameters`, `__dict__`): the checks run every eager step, where it is felt.
"""

from typing import NamedTuple

import torch

from ..models.base import RMSNorm
from ..models.kernels import packed_weight

LINEAR_TENSORS = ("weight", "scales", "offsets", "steps", "bias")  # a quantized layer's, in layer.cpp's order


def linears_of(layer):
    """A TransformerBlock's four linear layers in layer.cpp's order (wqkv, wo, w13, w2)."""
    attention, feed_forward = layer._modules["attention"]._modules, layer._modules["feed_forward"]._modules
    return attention["wqkv"], attention["wo"], feed_forward["w13"], feed_forward["w2"]


def weight_of(linear):
    """A linear layer's weight: its Parameter (float) or buffer (quantized)."""
    weight = linear._parameters.get("weight")
    return linear._buffers.get("weight") if weight is None else weight


class LayerTensors(NamedTuple):
    """A layer as layer.cpp takes it."""
    norms: tuple  # norm_weights
    tensors: list  # per linear layer its LINEAR_TENSORS (a float one: its packed weight, None, None, None, bias)
    groups: list  # per linear layer its group size (0: float32)
    features: list  # per linear layer its output width


def layer_tensors(layer):
    """The layer's LayerTensors, or None where layer.cpp cannot run it (q and k norms, or a weight we cannot take)."""
    norms = norm_weights(layer.norms())
    if norms is None or layer._modules["attention"]._modules.get("q_norm") is not None:
        return None
    linears, tensors, groups = linears_of(layer), [], []
    for linear in linears:
        if linear.bias is not None and linear.bias.dtype != torch.float32:
            return None
        if getattr(linear, "native", False):  # quantized for minispec's kernel
            tensors += [getattr(linear, name) for name in LINEAR_TENSORS]
            groups.append(linear.group)
        elif getattr(linear, "packed", False) and linear.weight.dtype == torch.float32:
            packed = packed_weight(linear.weight)  # packed again if written since
            if packed is None:
                return None  # converted to what no packed kernel takes
            tensors += [packed, None, None, None, linear.bias]
            groups.append(0)
        else:
            return None
    return LayerTensors(norms, tensors, groups, [linear.out_features for linear in linears])


def norm_weights(norms):
    """A layer's LayerNorms as layer.cpp takes them, or None where it cannot."""
    modules = [norms.attention, norms.ffn, norms.hidden]
    if any(norm is not None and (type(norm) is not RMSNorm or norm.weight.dtype != torch.float32) for norm in modules):
        return None
    return *(None if norm is None else norm.weight for norm in modules), norms.before_residual


class LayerStack:
    """A model's layers as layer.cpp's flat lists (tensors, caches, numbers), and what they were laid out from
    (`sources`: per layer each linear's weight, whether packed, its packed copy, and the cache's k and v)."""

    def __init__(self, model, layers):
        caches = [layer._modules["attention"]._modules["kv_cache"] for layer in model.layers]
        self.windows = list(dict.fromkeys(layer.attention.window for layer in model.layers))
        self.tensors, self.numbers, self.sources = [], [], []
        for layer, cache, ((attention_norm, ffn_norm, hidden_norm, before_residual), linears, groups, features) in \
                zip(model.layers, caches, layers):
            attention = layer.attention
            self.tensors += [attention_norm, ffn_norm, hidden_norm, *linears]
            self.numbers += [int(before_residual), *groups, *features, attention.n_heads, attention.n_kv_heads,
                             self.windows.index(attention.window)]
            weights = [(weight_of(linear), linear.__dict__.get("packed", False),
                        linears[i * len(LINEAR_TENSORS)] if group == 0 else None)
                       for i, (linear, group) in enumerate(zip(linears_of(layer), groups))]
            self.sources.append((weights, cache.k, cache.v))
        self.caches = [t for cache in caches for t in (cache.k, cache.v)]
        self.eps, self.scale, self.first_cache = model.config.norm_eps, model.config.head_dim ** -0.5, caches[0]

    def unchanged(self, model):
        """Whether the layers still hold what the stack was laid out from (a weight written since is repacked)."""
        if len(model.layers) != len(self.sources):
            return False
        for layer, (weights, k, v) in zip(model.layers, self.sources):
            cache = layer._modules["attention"]._modules.get("kv_cache")
            if cache is None or cache._buffers["k"] is not k or cache._buffers["v"] is not v:
                return False
            for linear, (weight, packed, copy) in zip(linears_of(layer), weights):
                if weight_of(linear) is not weight or linear.__dict__.get("packed", False) != packed \
                        or copy is not None and packed_weight(weight) is not copy:
                    return False
        return True


def stack_of(model):
    """The model's LayerStack (laid out again where anything was replaced); None where a layer cannot run."""
    stack = model.__dict__.get("_stack")
    if stack is not None and stack.unchanged(model):
        return stack
    layers = [layer_tensors(layer) for layer in model.layers]
    if any(tensors is None for tensors in layers):
        return None
    stack = model.__dict__["_stack"] = LayerStack(model, layers)
    return stack
