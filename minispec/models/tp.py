"""Tensor parallelism (Megatron-LM's, as gpt-fast's tp.py does it): a model built and loaded whole is
sharded in place over the ranks of a torch.distributed process group. Attention by heads, with the KV
cache; MLPs by width. A projection that keeps input columns computes a partial sum, which the module
it ends sums over the ranks (a hook on that module, which quantizing after sharding keeps); its bias
stays on rank 0. Everything else is replicated, so every rank holds the same logits, bit for bit.
Each element's sum depends on its partials only, never on the forward's rows (row invariance).
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn


ALL_REDUCE_MAX_RANKS = 2  # beyond, an all-reduce's order of adding depends on the tensor's size


class TensorParallel:
    """A model's place in its tensor-parallel group, and a group for values on the host (no device sync)."""

    def __init__(self, group, host_group=None):
        self.group, self.host_group = group, host_group or group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.first = dist.get_global_rank(group, 0)  # rank 0 of the group, as torch.distributed numbers it

    def sum(self, partial):
        """The sum over the ranks of each rank's `partial`, the same on every rank whatever its size."""
        if self.world <= ALL_REDUCE_MAX_RANKS:
            return funcol.all_reduce(partial, "sum", self.group)
        parts = funcol.all_gather_single(partial.unsqueeze(0), 0, self.group)
        return sum(parts[1:], parts[0])  # in rank order: ((p0 + p1) + p2) + ...

    def from_first(self, *values):
        """Rank 0's values (picklable) as a list on every rank, so that the host decides alike everywhere."""
        values = list(values)
        dist.broadcast_object_list(values, src=self.first, group=self.host_group)
        return values

    def first_numbers(self, numbers):
        """Rank 0's floats (timings), on every rank: one small broadcast on the host."""
        tensor = torch.tensor(numbers, dtype=torch.float64)
        dist.broadcast(tensor, src=self.first, group=self.host_group)
        return tensor.tolist()

    def shard(self, model, stored=None):
        return shard(model, self, stored)

    def smallest(self, value):
        """The smallest of the ranks' integers (free memory: what fits on every rank)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, dist.ReduceOp.MIN, group=self.host_group)
        return int(tensor)


# A family's plan yields (kind, what, detail): ("heads", an attention, its head-count attributes);
# ("rows" or "columns", a projection's name, its fused parts' sizes or None): its weight sliced along
# output or input features; ("table", T5's position table's name, None); ("sum", a module, None).


def llama_plan(model):
    c = model.config
    kv = c.n_kv_heads * c.head_dim
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}"
        yield "heads", layer.attention, ("n_heads", "n_kv_heads")
        yield "rows", f"{p}.attention.wqkv", [c.n_heads * c.head_dim, kv, kv]
        yield "columns", f"{p}.attention.wo", None
        yield "rows", f"{p}.feed_forward.w13", [c.intermediate_size, c.intermediate_size]
        yield "columns", f"{p}.feed_forward.w2", None
        yield "sum", layer.attention, None
        yield "sum", layer.feed_forward, None


def gpt2_plan(model):
    c = model.config
    for i, block in enumerate(model.h):
        p = f"h.{i}"
        yield "heads", block.attn, ("n_head",)
        yield "rows", f"{p}.attn.c_attn", [c.n_embd] * 3
        yield "columns", f"{p}.attn.c_proj", None
        yield "rows", f"{p}.mlp.c_fc", None
        yield "columns", f"{p}.mlp.c_proj", None
        yield "sum", block.attn, None
        yield "sum", block.mlp, None


def t5_plan(model):
    yield "table", "encoder_position_bias", None  # [buckets, heads]
    yield "table", "decoder_position_bias", None
    for stack in ("encoder", "decoder"):
        for i, layer in enumerate(getattr(model, stack)):
            p = f"{stack}.{i}"
            for name in ("self_attn", "cross_attn") if stack == "decoder" else ("self_attn",):
                attention = getattr(layer, name)
                yield "heads", attention, ("n_heads",)
                for projection in "qkv":
                    yield "rows", f"{p}.{name}.{projection}", None
                yield "columns", f"{p}.{name}.o", None
                yield "sum", attention, None
            for projection in ("wi_0", "wi_1") if model.config.gated else ("wi",):
                yield "rows", f"{p}.ffn.{projection}", None
            yield "columns", f"{p}.ffn.wo", None
            yield "sum", layer.ffn, None


# By class name: the model files import nothing but their base, this one none of them.
PLANS = {"Llama": llama_plan, "Gemma": llama_plan, "GPT2": gpt2_plan, "T5": t5_plan}  # Gemma: the same layout


def check_divisible(config, world):
    """A ValueError, before anything is loaded, when `world` ranks cannot split the heads and MLP evenly."""
    family = type(config).__name__
    if family in ("LlamaConfig", "GemmaConfig"):
        heads = "key/value heads" if config.n_kv_heads != config.n_heads else "attention heads"
        splits = [(config.n_kv_heads, heads), (config.intermediate_size, "MLP width")]
    elif family == "GPT2Config":
        splits = [(config.n_head, "attention heads"), (config.n_inner, "MLP width")]
    elif family == "T5Config":
        splits = [(config.num_heads, "attention heads"), (config.d_ff, "feed-forward width")]
    else:
        raise ValueError(f"tensor parallelism does not know the model config {family}")
    for count, what in splits:
        if count % world:
            raise ValueError(f"tp={world} does not divide the target's {count} {what}; use a tp that does")


def take(tensor, dim, parts, rank, world):
    """Rank `rank`'s slice of each part (sizes `parts` along `dim`; None: one) of `tensor`, a copy: the whole can go."""
    slices = []
    for part in tensor.split(parts or [tensor.shape[dim]], dim):
        size = part.shape[dim] // world
        slices.append(part.narrow(dim, rank * size, size))
    return torch.cat(slices, dim).clone(memory_format=torch.contiguous_format)


def take_stored(parts, dim, sizes, rank, world, name):
    """The rank's slice of a stored quantized weight (models/quant.py) along its rows or columns."""
    if dim == 0:
        return {key: take(value, 0, sizes, rank, world) for key, value in parts.items()}
    columns = parts["qweight"].shape[1] * (2 if parts["qweight"].dtype == torch.uint8 else 1)
    groups = parts["scales"].shape[1]
    if groups > 1 and groups % world:
        raise ValueError(f"quantized weight {name}: its {groups} groups of {columns // groups} columns do not "
                         f"split evenly over tp={world}")
    # one group (a scale and offset per row): every slice of the row keeps it
    return {key: take(value, 1, None, rank, world) if key == "qweight" or groups > 1 else value
            for key, value in parts.items()}


def shard(model, tp, stored=None):
    """Shard `model` (maybe on the meta device) and `stored`'s quantized tensors {module name: parts} for tp.rank."""
    plan = PLANS.get(type(model).__name__)
    if plan is None:
        raise ValueError(f"tensor parallelism does not know the model {type(model).__name__}")
    check_divisible(model.config, tp.world)
    rank, world = tp.rank, tp.world
    for kind, what, detail in plan(model):
        if kind == "heads":
            for attribute in detail:
                setattr(what, attribute, getattr(what, attribute) // world)
        elif kind == "table":
            table = model.get_submodule(what)
            table.weight = nn.Parameter(take(table.weight, 1, None, rank, world), requires_grad=False)
            table.embedding_dim = table.weight.shape[1]
        elif kind == "sum":
            what.register_forward_hook(lambda module, args, output: tp.sum(output))
        else:
            shard_linear(model.get_submodule(what), kind, detail, rank, world)
            if stored is not None and what in stored:
                stored[what] = take_stored(stored[what], 0 if kind == "rows" else 1, detail, rank, world, what)
    model.tp = tp
    return model


def shard_linear(linear, kind, sizes, rank, world):
    """A Linear's weight (and bias) replaced by the rank's slice of output ("rows") or input features."""
    dim = 0 if kind == "rows" else 1
    linear.weight = nn.Parameter(take(linear.weight, dim, sizes, rank, world), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape
    if linear.bias is not None and dim == 0:
        linear.bias = nn.Parameter(take(linear.bias, 0, sizes, rank, world), requires_grad=False)
    elif rank != 0:  # a partial sum's bias: added once, on rank 0
        linear.bias = None
