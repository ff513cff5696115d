"""Weight-only int8 and int4 quantization: quantized linear layers and token embeddings, and the
functions that quantize and dequantize weights. The model files never see it: the loader swaps modules.

A quantized weight [out N, in K] is stored (in checkpoints, and as `dequantize` reads it) as
  int8: `qweight` int8 [N, K], `scales` [N, K / group] and optional `offsets`; w = qweight * scales (+ offsets);
  int4: `qweight` uint8 [N, K / 2] of values 0..15, column 2i in the low nibble of byte i; w = q * scales + offsets;
or in the backend's packed layout (PACKED_KEYS: native.pack's output), which a conversion keeps.

Kernels: the backend's own where it takes the layer; elsewhere PyTorch's, which compute in bfloat16 on
CPU whatever the model's dtype (with float32 they take slow paths); on CUDA int8 as gpt-fast does it.
"""

from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

from . import backend
from .base import Decoder, Embedding
from .checks import DEFAULT_GROUP_SIZE, GROUP_SIZES, QUANT_MODES as MODES
from .kernels import linear

# Token embeddings and the output head, in both modes: int8 in groups of 32 columns (the head decides
# every argmax, which per-channel int8 there can change).
HEAD_GROUP_SIZE = 32
COMPUTE_DTYPE = torch.bfloat16


def check_settings(mode, group_size):
    if mode not in (None, *MODES):
        raise ValueError(f"quantize={mode!r}: choose one of {', '.join(MODES)} (or None for the checkpoint's weights)")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size!r}: int4 groups of {', '.join(map(str, GROUP_SIZES))} columns")


# --- the stored form ---------------------------------------------------------------------------------
def pack_int4(q):
    """uint8 [N, K] of values 0..15 -> uint8 [N, K / 2]: column 2i in the low nibble, 2i + 1 in the high one."""
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed):
    """The inverse of pack_int4."""
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(1)


def quantize_int8(weight, group_size=None):
    """Symmetric int8: the largest |w| of each row (or of each group of `group_size` columns) becomes ±127."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, group_size or w.shape[1])
    scales = groups.abs().amax(dim=-1) / 127
    scales = torch.where(scales > 0, scales, 1.0)  # an all-zero group: any scale, its values are 0
    q = (groups / scales[..., None]).round().clamp(-127, 127).to(torch.int8)
    return {"qweight": q.view_as(w), "scales": scales}


def quantize_int4(weight, group_size):
    """Asymmetric group-wise int4: each group of `group_size` columns spans its [min, max] in 16 steps."""
    w = weight.detach().float()
    groups = w.view(w.shape[0], -1, group_size)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = torch.where(high > low, (high - low) / 15, 1.0)  # a constant group: q = 0, w = offset
    q = ((groups - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
    return {"qweight": pack_int4(q.view_as(w)), "scales": scales, "offsets": low}


def is_int4(parts):
    return parts["qweight"].dtype == torch.uint8


def weight_shape(parts):
    rows, columns = parts["qweight"].shape
    return rows, columns * 2 if is_int4(parts) else columns


def dequantize(parts):
    """The float32 weight [N, K] of a stored quantized weight: multiply, then add, as ggml's reference does."""
    q = unpack_int4(parts["qweight"]) if is_int4(parts) else parts["qweight"]
    rows, groups = parts["scales"].shape
    w = q.float().view(rows, groups, -1) * parts["scales"].float()[..., None]
    if parts.get("offsets") is not None:
        w = w + parts["offsets"].float()[..., None]
    return w.view(rows, -1)


def widen_int4(parts):
    """An int4 weight in the int8 form, exactly (for layers the int4 kernel cannot take, and embeddings)."""
    return {"qweight": unpack_int4(parts["qweight"]).to(torch.int8), "scales": parts["scales"],
            "offsets": parts["offsets"]}


def group_size_of(parts):
    return weight_shape(parts)[1] // parts["scales"].shape[1]


def common_form(parts_list):
    """Stored weights to fuse in one form: as they are if they share one, else exactly int8 in the smallest group."""
    forms = {(is_int4(p), group_size_of(p), p.get("offsets") is not None) for p in parts_list}
    if len(forms) == 1:
        return parts_list
    group = min(size for _, size, _ in forms)
    out = []
    for parts in parts_list:
        repeat = group_size_of(parts) // group
        parts = widen_int4(parts) if is_int4(parts) else parts
        scales = parts["scales"].repeat_interleave(repeat, dim=1)
        offsets = parts.get("offsets")
        offsets = torch.zeros_like(scales) if offsets is None else offsets.repeat_interleave(repeat, dim=1)
        out.append({"qweight": parts["qweight"], "scales": scales, "offsets": offsets})
    return out


PACKED_KEYS = ("packed_weight", "packed_scales", "packed_offsets", "packed_steps")
STORED_KEYS = ("qweight", "scales", "offsets", *PACKED_KEYS)
QUANT_METHOD = "minispec"  # config.json's quantization_config.quant_method for checkpoints holding stored forms


def take_stored(weights):
    """Pop a checkpoint's quantized weights out of {name: tensor}: {module name: stored tensors}."""
    stored = defaultdict(dict)
    for name in [name for name in weights if name.rpartition(".")[2] in STORED_KEYS]:
        module, _, key = name.rpartition(".")
        stored[module][key] = weights.pop(name)
    return dict(stored)


def check_stored(parts, shape):
    """A one-line reason why stored tensors are not a quantized weight of `shape` [N, K], or None."""
    if "packed_weight" in parts:
        return check_packed(parts, shape)
    qweight, scales, offsets = parts.get("qweight"), parts.get("scales"), parts.get("offsets")
    if qweight is None or scales is None:
        return f"has {' and '.join(sorted(parts))} but needs qweight and scales"
    if qweight.dtype not in (torch.int8, torch.uint8) or qweight.dim() != 2 or scales.dim() != 2:
        return f"qweight {qweight.dtype} {tuple(qweight.shape)} is neither int8 [N, K] nor uint8 [N, K / 2]"
    if is_int4(parts) and offsets is None:
        return "an int4 qweight (uint8) needs offsets"
    if weight_shape(parts) != tuple(shape):
        return f"qweight {tuple(qweight.shape)} ({qweight.dtype}) does not make a weight of shape {tuple(shape)}"
    if scales.shape[0] != shape[0] or scales.shape[1] == 0 or shape[1] % scales.shape[1]:
        return f"scales {tuple(scales.shape)} do not divide a weight of shape {tuple(shape)} into groups"
    if offsets is not None and offsets.shape != scales.shape:
        return f"offsets {tuple(offsets.shape)} and scales {tuple(scales.shape)} differ in shape"
    return None


def check_packed(parts, shape):
    """check_stored for the kernels' layout: [tiles of 16 rows, K / 32, 4 to 8 vectors, 64], scales [tiles, G, 16]."""
    weight, scales = parts["packed_weight"], parts.get("packed_scales")
    rows, columns = shape
    if scales is None or weight.dim() != 4 or scales.dim() != 3 or weight.shape[2] not in (4, 5, 6, 8):
        return f"has {' and '.join(sorted(parts))}, not a packed weight and its scales"
    if not 0 <= weight.shape[0] * 16 - rows < 16 or weight.shape[1] * 32 != columns or weight.shape[3] != 64 \
            or scales.shape[0] != weight.shape[0] or scales.shape[1] == 0 or columns % scales.shape[1]:
        return f"packed {tuple(weight.shape)}, scales {tuple(scales.shape)} do not make a weight of shape {tuple(shape)}"
    steps = parts.get("packed_steps")
    if steps is not None and steps.dtype != torch.float16:
        return f"packed_steps are {steps.dtype}, an older minispec's layout: convert the checkpoint again"
    return None


def int4_problem(out_features, in_features, group_size, device):
    """Why the int4 kernel cannot take a weight of this shape, or None."""
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if backend.current().takes_quantized(in_features, group_size, device):
        return None  # the backend's own kernel takes any number of rows
    rows = 16 if device.type == "cpu" else 8
    if out_features % rows:
        return f"out_features {out_features} is not a multiple of {rows}"
    return None


class Quantized(nn.Module):
    """What the quantized layers share: the backend's kernel, and the output's dtype, shape and bias."""

    def take(self, q, scales, offsets, bias, shape, packed=None):
        """The layer's numbers; True where the backend's kernel takes it, its buffers then in that kernel's layout."""
        self.out_features, self.in_features = shape
        self.bias, self.on_cpu, self.group = bias, q.device.type == "cpu", shape[1] // scales.shape[1]
        self.native = packed is not None or backend.current().takes_quantized(self.in_features, self.group, q.device)
        if self.native:
            packed = packed or backend.current().pack_quantized(q, scales, offsets)
            for name, tensor in zip(("weight", "scales", "offsets", "steps"), packed):
                self.register_buffer(name, tensor)
        return self.native

    def take_packed(self, parts, bias, shape):
        """take() for parts in the kernels' layout (a conversion's, a kept int4 draft's); False for others."""
        if "packed_weight" not in parts:
            return False
        packed = [parts.get(key) for key in PACKED_KEYS]
        return self.take(packed[0], packed[1], None, bias, shape, packed)

    def native_forward(self, x):
        rows = x.reshape(-1, self.in_features).float()
        y = backend.current().quantized_product(rows.contiguous(), self.weight, self.scales, self.offsets, self.steps,
                                                self.group)
        if y.shape[1] != self.out_features:  # padded to whole tiles
            y = y[:, :self.out_features]
        return self.output(y, x)

    def output(self, y, x):
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(Quantized):
    """y = x @ (qweight * scales (+ offsets)).T + bias: on CPU aten._weight_int8pack_mm, a call per group of scales
    (the offsets' share from x's group sums); on CUDA the weight converted inside the matmul, as gpt-fast does."""

    def __init__(self, parts, bias=None, shape=None):
        super().__init__()
        if self.take_packed(parts, bias, shape):  # the kernels' layout, as a conversion keeps it: taken as it is
            return
        qweight, scales, offsets = parts["qweight"], parts["scales"], parts.get("offsets")
        if self.take(qweight, scales, offsets, bias, qweight.shape):
            return
        if scales.shape[1] == 1 and offsets is None:
            weight, scales = qweight, scales.view(-1)
        else:  # [groups, N, group]: each group's columns contiguous, as _weight_int8pack_mm wants them
            weight, scales = qweight.view(self.out_features, scales.shape[1], -1).transpose(0, 1), scales.t()
        copy = torch.contiguous_format  # never views of a checkpoint's file, which they would keep resident
        self.register_buffer("weight", weight.clone(memory_format=copy))
        self.register_buffer("scales", scales.to(COMPUTE_DTYPE).clone(memory_format=copy))
        self.register_buffer("offsets", None if offsets is None else offsets.float().clone(memory_format=copy))

    def forward(self, x):
        if self.native:
            return self.native_forward(x)
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        if self.weight.dim() == 2:  # one scale per output channel
            if self.on_cpu:
                y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)
            else:
                y = linear(rows, self.weight.to(COMPUTE_DTYPE), None, packed=False) * self.scales
        elif self.on_cpu:
            groups = rows.view(rows.shape[0], *self.weight.shape[::2]).transpose(0, 1).contiguous()  # [G, M, g]
            y = torch.ops.aten._weight_int8pack_mm(groups[0], self.weight[0], self.scales[0]).float()
            for i in range(1, self.weight.shape[0]):
                y += torch.ops.aten._weight_int8pack_mm(groups[i], self.weight[i], self.scales[i])
            if self.offsets is not None:
                y += F.linear(groups.float().sum(-1).t(), self.offsets)
        else:  # CUDA: the grouped weight dequantized in the compute dtype
            w = self.weight.to(COMPUTE_DTYPE) * self.scales[..., None]
            if self.offsets is not None:
                w = w + self.offsets.t()[..., None].to(COMPUTE_DTYPE)
            y = linear(rows, w.transpose(0, 1).reshape(self.out_features, self.in_features), None, packed=False)
        return self.output(y, x)


def int4pack_mm_cpu(x: torch.Tensor, weight: torch.Tensor, group: int,
                    scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, group, scales_and_zeros)


# Opaque to torch.compile: inductor's lowering of aten's CPU int4 kernel hands it the group size as a
# tensor, which the kernel refuses ("group size must be a scalar", torch 2.13); eager calls it directly.
int4pack_mm_cpu_op = torch.library.custom_op("minispec::int4pack_mm_cpu", mutates_args=())(int4pack_mm_cpu)


@int4pack_mm_cpu_op.register_fake
def _(x, weight, group, scales_and_zeros):
    return x.new_empty(x.shape[0], weight.shape[0])


class Int4Linear(Quantized):
    """y = x @ (q * scales + offsets).T + bias by PyTorch's int4 kernels, which compute (q - 8) * scale + zero."""

    def __init__(self, parts, bias=None, shape=None):
        super().__init__()
        if self.take_packed(parts, bias, shape):
            return
        scales, offsets = parts["scales"].float(), parts["offsets"].float()
        q = unpack_int4(parts["qweight"])
        if self.take(q, scales, offsets, bias, q.shape):
            return
        if self.on_cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        else:  # the CUDA packer takes even columns in the high nibble; 8 inner k-tiles where K allows
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, 0::2] << 4) | q[:, 1::2], tiles)
        self.register_buffer("weight", packed)
        scales_and_zeros = torch.stack([scales, offsets + 8 * scales], dim=-1)
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().to(COMPUTE_DTYPE))

    def forward(self, x):
        if self.native:
            return self.native_forward(x)
        rows = x.reshape(-1, self.in_features).to(COMPUTE_DTYPE)
        # Not in row blocks on CUDA (kernels.in_row_blocks): this kernel keeps each row's numbers unpadded.
        mm = (torch.ops.aten._weight_int4pack_mm if not self.on_cpu else
              int4pack_mm_cpu_op if torch.compiler.is_compiling() else int4pack_mm_cpu)
        return self.output(mm(rows, self.weight, self.group, self.scales_and_zeros), x)


class Int8Embedding(Int8Linear):
    """An int8 token embedding: a lookup dequantizes the rows it reads; `unembed` (a tied head) is the int8 matmul."""

    def __init__(self, parts, dtype, shape=None):
        super().__init__(parts, shape=shape)
        self.num_embeddings, self.embedding_dim = self.out_features, self.in_features
        self.output_dtype = dtype  # the model's: what a float embedding would return

    def forward(self, tokens):
        return weight_rows(self, tokens).to(self.output_dtype)

    unembed = Int8Linear.forward


def weight_rows(module, tokens):
    """The float32 rows `tokens` (output channels) of an Int8Linear's weight, [*tokens.shape, in_features]."""
    if module.native:
        q, scales, offsets = backend.current().quantized_rows(tokens.reshape(-1), module.weight, module.scales,
                                                              module.offsets, module.steps)
        rows = dequantize({"qweight": q, "scales": scales, "offsets": offsets})
        return rows.view(*tokens.shape, module.in_features)
    if module.weight.dim() == 2:
        return module.weight[tokens].float() * module.scales[tokens].float()[..., None]
    # weight [groups, vocab, group]: gather the tokens' rows of every group
    rows = module.weight[:, tokens].movedim(0, -2).float() * module.scales[:, tokens].movedim(0, -1).float()[..., None]
    if module.offsets is not None:
        rows = rows + module.offsets[tokens][..., None]
    return rows.flatten(-2)


def int4_draft(model):
    """A draft's int8 layers (a GGUF's own types, and the head) in int4, a chunk of rows at a time: a draft need not
    compute the target's numbers, and int4 reads fewer bytes at less work per byte. In the widest groups the kernel
    takes (narrower ones cost more time than they gain in agreement); layers it cannot take, and embeddings (a tied
    head's too), stay as they are. Returns the replaced layers."""
    if not isinstance(model, Decoder):
        return []
    replaced = []
    layers = [(name, module) for name, module in model.named_modules()
              if isinstance(module, Int8Linear) and not isinstance(module, Int8Embedding)]
    if isinstance(model.head, Int8Embedding):  # a tied head: its own int4 copy, the embedding kept for lookups
        layers.append(("output", model.head))
    for name, module in layers:
        device = module.scales.device
        group_size = next((size for size in sorted(GROUP_SIZES, reverse=True)
                           if not int4_problem(module.out_features, module.in_features, size, device)), None)
        if group_size is None:
            continue
        # chunks small enough that their temporaries are reused from the heap, not mapped and faulted in afresh
        rows = torch.arange(module.out_features, device=device).split(HEAD_CHUNK_ELEMENTS // module.in_features)
        chunks = [quantize_int4(weight_rows(module, ids), group_size) for ids in rows]
        parent, _, attribute = name.rpartition(".")  # setattr: a tied model's `output` is None, not a module
        setattr(model.get_submodule(parent), attribute,
                Int4Linear({key: torch.cat([chunk[key] for chunk in chunks]) for key in chunks[0]}, module.bias))
        replaced.append(module)
    if replaced:
        model.fingerprint = model.fingerprint and f"{model.fingerprint} int4 draft"
    return replaced


# --- quantizing a model -------------------------------------------------------------------------------
def quantize_model(model, mode=None, group_size=DEFAULT_GROUP_SIZE, dtype=torch.float32, stored=None, device=None,
                   layer_done=None):
    """Replace the linear layers and token embeddings by quantized ones, one at a time (each float weight freed
    as soon as its quantized form exists): `stored`'s {module name: stored tensors} (popped), else `mode`'s (the
    head and embeddings int8 in groups of HEAD_GROUP_SIZE, int4 layers the kernel cannot take int8).
    `layer_done()` after each module and chunk of rows. Returns notes on the layers kept int8."""
    stored = {} if stored is None else stored
    layer_done = layer_done or (lambda: None)
    head = model.head
    fallbacks = defaultdict(list)
    mapped = False  # layers taken in the kernels' layout: views of the checkpoint file, left where they are
    # By name, not module (which would keep every float weight alive); the embedding and the head last,
    # when the temporaries of quantizing their many rows meet fewest float weights.
    last = {name for name, module in model.named_modules() if module is head or isinstance(module, Embedding)}
    names = [name for name, module in model.named_modules() if isinstance(module, (nn.Linear, Embedding))]
    for name in sorted(names, key=lambda name: name in last):
        module = model.get_submodule(name)
        parts = stored.pop(name, None)
        if parts is None and mode is None:
            continue
        if parts is not None and "packed_weight" in parts:
            shape, mapped = module.weight.shape, True
            model.set_submodule(name, Int8Embedding(parts, dtype, shape) if isinstance(module, Embedding) else
                                Int8Linear(parts, module.bias, shape))
            continue
        target = torch.device(device) if device is not None else module.weight.device
        if isinstance(module, Embedding):
            if parts is None:
                parts = in_row_chunks(quantize_int8, module.weight, head_group(module.embedding_dim), dtype, layer_done)
            elif is_int4(parts) and backend.current().takes_quantized(module.embedding_dim, group_size_of(parts), target):
                parts = {**parts, "qweight": unpack_int4(parts["qweight"])}  # the kernels' layout keeps int4 as it is
            elif is_int4(parts):
                parts = widen_int4(parts)
            model.set_submodule(name, Int8Embedding(on(parts, target), dtype))
            layer_done()
            continue
        int4 = (mode == "int4" and module is not head) if parts is None else is_int4(parts)
        if int4:
            group = group_size if parts is None else group_size_of(parts)
            problem = int4_problem(module.out_features, module.in_features, group, target)
            if problem:
                fallbacks[problem].append(name)
                int4 = False
        if parts is None:
            group = group_size if int4 else head_group(module.in_features) if module is head else None
            parts = in_row_chunks(quantize_int4 if int4 else quantize_int8, module.weight, group, dtype, layer_done)
        elif is_int4(parts) and not int4:
            parts = widen_int4(parts)
        model.set_submodule(name, (Int4Linear if int4 else Int8Linear)(on(parts, target), module.bias))
        layer_done()
    if stored:
        raise ValueError(f"quantized tensors for {', '.join(sorted(stored)[:5])}, which are not linear layers "
                         "or token embeddings of this model")
    notes = [f"kept int8 ({problem}): {', '.join(names)}" for problem, names in fallbacks.items()]
    model.quantization = {"mode": mode, "group_size": group_size, "notes": notes}
    if not mapped:  # read every step: in huge pages where the backend has them (a copy, which a mapped file saves)
        backend.current().in_huge_pages(model.modules())
    return notes


CHUNK_ELEMENTS = 1 << 22
HEAD_CHUNK_ELEMENTS = 1 << 18


def in_row_chunks(quantize, weight, group_size, dtype, chunk_done):
    """quantize(weight, group_size) a chunk of rows at a time (a chunk's temporaries), in the model's `dtype`."""
    rows = max(1, CHUNK_ELEMENTS // weight.shape[1])
    chunks = []
    for i in range(0, weight.shape[0], rows):
        chunks.append(quantize(weight[i:i + rows].to(dtype), group_size))
        chunk_done()
    return {key: torch.cat([chunk[key] for chunk in chunks]) for key in chunks[0]}


def head_group(in_features):
    return HEAD_GROUP_SIZE if in_features % HEAD_GROUP_SIZE == 0 else None


def on(parts, device):
    return {key: value.to(device) for key, value in parts.items() if value is not None}


def quantized_copy(model, mode, group_size=DEFAULT_GROUP_SIZE):
    """A quantized copy (the self-draft) sharing the float tensors that stay float; compiled when the model is."""
    if model.quantization is not None:
        raise ValueError(f"{model.name} is quantized already; a quantized copy is made from a float model's "
                         "weights: load the target without quantize")
    with torch.device("meta"):
        copy = type(model)(model.config)
    if model.tp is not None:  # a sharded target's copy holds its slices, sharded alike
        model.tp.shard(copy)
    copy.load_state_dict(model.state_dict(), assign=True)  # the model's own tensors: no second float copy
    copy.requires_grad_(False).eval()
    quantize_model(copy, mode, group_size, dtype=model.dtype, device=model.device)
    copy.name = f"{model.name} ({mode})"
    copy.fingerprint = model.fingerprint and f"{model.fingerprint} {mode} {group_size}"
    copy.tokenizer, copy.bos_token_id, copy.eos_token_ids, copy.pad_token_id = (
        model.tokenizer, model.bos_token_id, model.eos_token_ids, model.pad_token_id)
    return copy.compile() if model.compiled_forward is not None else copy
