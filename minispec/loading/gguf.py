"""Import a llama.cpp GGUF file once into an ordinary checkpoint folder (config.json, model.safetensors,
tokenizer files). The `gguf` package reads the container and dequantizes; with keep_quantized, quantized
tensors are unpacked below into models.quant's stored form, which dequantizes bit for bit to gguf's values
(the command line: minispec/convert.py)."""

import fcntl
import glob
import json
import math
import os
import re
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, TokenType, quants
from tqdm import tqdm

from ..models.checks import COUNT, FLAG, INTEGER, POSITIVE, REQUIRED, TEXT, TEXTS, Check, check, integer, list_of
from ..models.quant import QUANT_METHOD, common_form, pack_int4
from .tokenizer import BYTE_FALLBACK, BYTE_LEVEL, SPACES
from .weights import release_file_pages, release_freed_memory, save_safetensors

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Each header value is ~350 bytes of numpy objects in gguf's reader: bounded, above a 262k-token vocabulary's.
MAX_HEADER_VALUES = 1 << 21


@dataclass
class GGUFTensor:
    name: str
    type: str  # ggml type name, e.g. "Q4_K"
    shape: tuple  # torch order: outermost first (GGUF stores dims innermost first)
    data: torch.Tensor | None  # raw bytes, a view of the mapped file; None for unsupported types


class BadFile(ValueError):
    """A problem minispec found in the file itself, its message ready to follow the file's name."""


class Reader(GGUFReader):
    """gguf's reader held to the file's bounds (its reads past the end come back short, without a word),
    its tensor infos kept as read: minispec makes its own views, and refuses a type only when it is read."""

    def __init__(self, path):
        self.values = 0
        super().__init__(path, mode="c")  # private, hence writable, which torch.from_numpy wants; nothing is written

    @property
    def data(self):
        return self.array

    @data.setter
    def data(self, mapped):  # a plain array over the mapping: np.memmap's slices, one a value, cost twice as much
        self.array = mapped.view(np.ndarray)

    def _get(self, offset, dtype, count=1, override_order=None):
        if offset + np.dtype(dtype).itemsize * int(count) > len(self.data):
            raise BadFile(f"truncated GGUF file (header runs past the end, {len(self.data)} bytes)")
        self.values += 1
        if self.values > MAX_HEADER_VALUES:
            raise BadFile(f"corrupt GGUF file (its header holds more than {MAX_HEADER_VALUES} values)")
        return super()._get(offset, dtype, count, override_order)

    def _push_field(self, field, skip_sum=False):
        if field.name in self.fields:
            raise BadFile(f"corrupt GGUF file (metadata key {field.name!r} appears twice)")
        return super()._push_field(field, skip_sum)

    def _build_tensors(self, start_offs, fields):
        self.infos = fields


def metadata_value(name, field):
    if field.types[:2] == [GGUFValueType.ARRAY] * 2:  # as in llama.cpp; nesting recurses as deep as a file asks
        raise BadFile(f"corrupt GGUF file (an array of arrays in metadata {name!r})")
    value = field.contents()
    # a float32 as the shortest decimal that is the same float32: 1e-6, not 9.999999974752427e-07
    return float(str(np.float32(value))) if field.types == [GGUFValueType.FLOAT32] else value


def read_gguf(path):
    """(metadata dict, {name: GGUFTensor}), the data memory-mapped; every problem is a ValueError naming the file."""
    path = Path(path)
    with open(path, "rb") as file:
        magic, version = file.read(4), int.from_bytes(file.read(4).ljust(4, b"\0"), "little")
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    if version not in (2, 3):  # also refuses big-endian files, whose tensor data the unpackers would misread
        hint = " (a big-endian file?)" if version >= 1 << 16 else ""
        raise ValueError(f"{path}: unsupported GGUF version {version}{hint}; minispec reads versions 2 and 3")
    try:
        reader = Reader(path)
        metadata = {name: metadata_value(name, field) for name, field in reader.fields.items()
                    if not name.startswith("GGUF.")}  # the reader's own entries: version and counts
        tensors = tensor_views(reader)
    except BadFile as error:
        raise ValueError(f"{path}: {error}") from None
    except RecursionError:
        raise ValueError(f"{path}: corrupt GGUF file (arrays of arrays nested too deep)") from None
    except (ValueError, KeyError, IndexError, OverflowError) as error:  # what gguf's reader raises on garbage
        raise ValueError(f"{path}: corrupt GGUF file ({error})") from None
    return metadata, tensors


def tensor_views(reader):
    """{name: GGUFTensor} of the reader's tensor infos, each checked against the file's size."""
    if reader.alignment % 8:
        raise BadFile(f"corrupt GGUF file (general.alignment {reader.alignment} is not a multiple of 8)")
    data = torch.from_numpy(reader.data)
    tensors = {}
    for info in reader.infos:
        name, dims = info.name, info.parts[3].tolist()
        type_id, offset = int(info.parts[4][0]), int(info.parts[5][0])
        if name in tensors:
            raise BadFile(f"corrupt GGUF file (tensor {name!r} appears twice)")
        if len(dims) > 4:
            raise BadFile(f"corrupt GGUF file (tensor {name!r} has {len(dims)} dimensions)")
        kind = GGMLQuantizationType(type_id) if type_id in GGML_QUANT_SIZES else None
        type_name, raw = f"ggml type {type_id}" if kind is None else kind.name, None
        if type_name in (*FLOAT_TYPES, *QUANT_TYPES):  # the others keep data=None; dequantize() names them
            block, block_bytes = GGML_QUANT_SIZES[kind]
            if dims and dims[0] % block:
                raise BadFile(f"corrupt GGUF file (tensor {name!r} rows of {dims[0]} are not whole {type_name} blocks)")
            if offset % reader.alignment:
                raise BadFile(f"corrupt GGUF file (tensor {name!r} offset {offset} is not aligned)")
            start, size = reader.data_offset + offset, math.prod(dims) // block * block_bytes
            if start + size > len(data):
                raise BadFile(f"truncated GGUF file (tensor {name!r} needs bytes up to {start + size}, "
                              f"the file has {len(data)})")
            raw = data[start:start + size]
        tensors[name] = GGUFTensor(name, type_name, tuple(reversed(dims)), raw)
    return tensors


# ---------------------------------------------------------------------------------------------
# Quantized blocks: raw blocks [n, block_bytes] (uint8) -> (q [n, block] integers, scales [n, groups],
# offsets [n, groups] or None), value = q * scale + offset in float32, multiply then add: ggml computes its
# values in exactly these operations (d * (q - 8) is q * d + (-8 d), both terms exact), so they match bit for bit.

def _f16(blocks, start):  # the fp16 scale stored at byte `start` of every block, as [n, 1] fp32
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _fields(packed, runs, bits):
    """ggml's packed values of `bits` bits in [n, bytes] uint8: each of `runs` runs of bytes holds its values' low
    bits, then their next bits, and so on."""
    n, size = packed.shape
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8).view(-1, 1)
    return ((packed.reshape(n, runs, 1, size // runs) >> shifts) & ((1 << bits) - 1)).reshape(n, size * 8 // bits)


def unpack_q4_0(blocks):  # d(2) qs(16): d * (q - 8)
    d = _f16(blocks, 0)
    return _fields(blocks[:, 2:], 1, 4), d, -8 * d


def unpack_q4_1(blocks):  # d(2) m(2) qs(16): d * q + m
    return _fields(blocks[:, 4:], 1, 4), _f16(blocks, 0), _f16(blocks, 2)


def unpack_q5_0(blocks):  # d(2) qh(4) qs(16): d * (q - 16), q's fifth bit from qh (bit i of the little-endian u32)
    q = _fields(blocks[:, 6:], 1, 4) | (_fields(blocks[:, 2:6], 4, 1) << 4)
    return q.to(torch.int8) - 16, _f16(blocks, 0), None


def unpack_q5_1(blocks):  # d(2) m(2) qh(4) qs(16): d * q + m
    q = _fields(blocks[:, 8:], 1, 4) | (_fields(blocks[:, 4:8], 4, 1) << 4)
    return q, _f16(blocks, 0), _f16(blocks, 2)


def unpack_q8_0(blocks):  # d(2) qs(32 x int8): d * q
    return blocks[:, 2:].contiguous().view(torch.int8), _f16(blocks, 0), None


def _k_scales_offsets(blocks):  # (d * scale) * q - dmin * min for each of the 8 sub-blocks of 32
    sc, mn = (torch.from_numpy(x).float() for x in quants.Q4_K.get_scale_min(blocks[:, 4:16].numpy()))
    return _f16(blocks, 0) * sc, -(_f16(blocks, 2) * mn)


def unpack_q4_k(blocks):  # d(2) dmin(2) scales(12) qs(128): each 32 bytes hold two sub-blocks of 32
    return _fields(blocks[:, 16:], 4, 4), *_k_scales_offsets(blocks)


def unpack_q5_k(blocks):  # d(2) dmin(2) scales(12) qh(32) qs(128); sub-block i takes bit i of qh
    return _fields(blocks[:, 48:], 4, 4) | (_fields(blocks[:, 16:48], 1, 1) << 4), *_k_scales_offsets(blocks)


def unpack_q6_k(blocks):  # ql(128) qh(64) scales(16 x int8) d(2): (d * scale) * (q - 32), 16 sub-blocks of 16
    q = (_fields(blocks[:, :128], 2, 4) | (_fields(blocks[:, 128:192], 2, 2) << 4)).to(torch.int8) - 32
    return q, _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float(), None


QUANT_TYPES = {"Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q5_0": unpack_q5_0, "Q5_1": unpack_q5_1,
               "Q8_0": unpack_q8_0, "Q4_K": unpack_q4_k, "Q5_K": unpack_q5_k, "Q6_K": unpack_q6_k}
CHUNK_BLOCKS = 1 << 16
PROGRESS_MIN_BYTES = 64 << 20  # files with less quantized data convert too fast to need progress lines


def check_supported(tensor):
    if tensor.data is None:
        raise ValueError(f"tensor {tensor.name!r} uses unsupported quantization type {tensor.type}; "
                         f"minispec reads {', '.join([*FLOAT_TYPES, *QUANT_TYPES])}")


def dequantize(tensor):
    """The tensor's values: F32/F16/BF16 as stored (a view of the file), quantized types as fp32."""
    check_supported(tensor)
    if tensor.type in FLOAT_TYPES:
        return tensor.data.view(FLOAT_TYPES[tensor.type]).view(tensor.shape)
    kind = GGMLQuantizationType[tensor.type]
    block, block_bytes = GGML_QUANT_SIZES[kind]
    blocks = tensor.data.view(-1, block_bytes).numpy()
    out = torch.empty(len(blocks), block)  # filled chunk by chunk
    for i in range(0, len(out), CHUNK_BLOCKS):
        out[i:i + CHUNK_BLOCKS] = torch.from_numpy(quants.dequantize(blocks[i:i + CHUNK_BLOCKS], kind))
    return out.view(tensor.shape)


def to_smallest_dtype(values):
    """float32 values as float16 when that is exact (GGUF's own scales are), to keep files small."""
    half = values.half()
    return half if torch.equal(half.float(), values) else values


def stored_form(tensor):
    """A quantized 2-D tensor kept quantized: models.quant's stored form {qweight, scales[, offsets]}, a row per
    tensor row, which `models.quant.dequantize` turns into exactly what `dequantize` gives."""
    check_supported(tensor)
    blocks, chunks = tensor.data.view(-1, GGML_QUANT_SIZES[GGMLQuantizationType[tensor.type]][1]), []
    for i in range(0, blocks.shape[0], CHUNK_BLOCKS):  # in chunks, so that temporaries stay small
        q, scales, offsets = QUANT_TYPES[tensor.type](blocks[i:i + CHUNK_BLOCKS])
        qweight = pack_int4(q) if tensor.type.startswith("Q4") else q.to(torch.int8)
        chunks.append({"qweight": qweight, "scales": scales, "offsets": offsets})
    parts = {key: torch.cat([chunk[key] for chunk in chunks]).reshape(tensor.shape[0], -1) for key in chunks[0]
             if chunks[0][key] is not None}
    return {key: value if key == "qweight" else to_smallest_dtype(value) for key, value in parts.items()}


# ---------------------------------------------------------------------------------------------
# llama.cpp names and metadata -> Hugging Face config and weights

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_TYPES = {"gemma3": "gemma3_text"}  # config.json's model_type where it is not the GGUF architecture's name
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {  # blk.N.<key> -> model.layers.N.<value>
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"attn_{x}.{part}": f"self_attn.{x}_proj.{part}" for x in "qkv" for part in ("weight", "bias")},
    "attn_output.weight": "self_attn.o_proj.weight", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    **{f"ffn_{x}.weight": f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")},
}
# Gemma 2 and 3: norms before and after attention and the MLP (ffn_norm comes before the MLP, Llama's after attention)
GEMMA3_LAYER_NAMES = {**LAYER_NAMES, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                      "post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3 rope scaling, stored as a tensor; becomes config, not a weight


def meta(metadata, key, kind, default=REQUIRED):
    """metadata[key], checked to be `kind`: GGUF types its values, but a file can give any key any type."""
    return check(metadata, key, kind, default, "GGUF metadata ")


def hf_name(name, model_type):  # of a tensor that check_tensors accepted
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    names = GEMMA3_LAYER_NAMES if model_type in ("gemma2", "gemma3_text") else LAYER_NAMES
    layer, kind = re.fullmatch(r"blk\.(\d+)\.(.+)", name).groups()
    return f"model.layers.{layer}.{names[kind]}"


def hf_config(metadata, tensors):
    """config.json's contents (as hub checkpoints write it), each metadata value and tensor checked."""
    arch = meta(metadata, "general.architecture", TEXT)
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; minispec imports {', '.join(ARCHITECTURES)}")

    def get(key, kind, default=REQUIRED):
        return meta(metadata, f"{arch}.{key}", kind, default)

    hidden, n_head = get("embedding_length", COUNT), get("attention.head_count", COUNT)
    embedding = tensors.get("token_embd.weight")
    if embedding is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    if len(embedding.shape) != 2 or not embedding.shape[0]:
        raise ValueError(f"GGUF tensor 'token_embd.weight' has shape {embedding.shape}, expected (vocabulary size, "
                         f"{hidden})")
    n_kv_head = get("attention.head_count_kv", COUNT, n_head)
    if n_head % n_kv_head:
        raise ValueError(f"GGUF metadata {arch}.attention.head_count {n_head} is not a multiple of "
                         f"{arch}.attention.head_count_kv {n_kv_head}")
    head_dim = get("attention.key_length", COUNT, hidden // n_head)
    if head_dim % 2 or not head_dim:
        raise ValueError(f"GGUF metadata gives attention heads of {head_dim} dimensions; rotary embeddings need "
                         "a positive even number")
    if get("rope.dimension_count", COUNT, head_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings ({get('rope.dimension_count', COUNT)} of {head_dim} head dims) "
                         "are not supported")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": embedding.shape[0],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length", COUNT),
        "num_hidden_layers": get("block_count", COUNT),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv_head,
        "max_position_embeddings": get("context_length", COUNT),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", POSITIVE),
        "rope_theta": get("rope.freq_base", POSITIVE, 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if head_dim != hidden // n_head or arch in ("qwen3", "gemma2", "gemma3"):  # an absent one reads as 128, 256
        config["head_dim"] = head_dim
    if arch == "llama" and "blk.0.attn_q.bias" in tensors:
        config["attention_bias"] = True
    if arch in ("gemma2", "gemma3"):
        config.update(gemma_config(get, config, head_dim, arch))
    check_tensors(tensors, config, head_dim)
    config["model_type"] = MODEL_TYPES.get(arch, arch)
    config["rope_scaling"] = rope_scaling(metadata, arch, tensors, head_dim, config["rope_theta"])
    config.update(special_token_ids(metadata, config["vocab_size"]))
    return config


def check_tensors(tensors, config, head_dim):
    """Every tensor the config implies present, of the shape it implies, and no other, so that a file that would
    convert but not load is refused first; block_count is checked against the file's blocks before it sizes anything."""
    n_layers, hidden, ffn, vocab = (config[key] for key in (
        "num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"))
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    blocks = {int(match[1]) for name in tensors if (match := re.fullmatch(r"blk\.(\d+)\..+", name))}
    if len(blocks) != n_layers or max(blocks, default=-1) != n_layers - 1:
        numbered = f", numbered up to {max(blocks)}" if blocks else ""
        raise ValueError(f"GGUF metadata {config['model_type']}.block_count is {n_layers}, but the file holds "
                         f"tensors of {len(blocks)} blocks{numbered}")
    layer = {"attn_norm.weight": (hidden,), "attn_q.weight": (q, hidden), "attn_k.weight": (kv, hidden),
             "attn_v.weight": (kv, hidden), "attn_output.weight": (hidden, q), "ffn_norm.weight": (hidden,),
             "ffn_gate.weight": (ffn, hidden), "ffn_up.weight": (ffn, hidden), "ffn_down.weight": (hidden, ffn)}
    qwen2, bias = config["model_type"] == "qwen2", config.get("attention_bias", False)
    if qwen2 or bias:
        layer.update({"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)})
    if bias and not qwen2:  # Qwen2's output projection has no bias
        layer["attn_output.bias"] = (hidden,)
    if config["model_type"] in ("qwen3", "gemma3"):
        layer.update({"attn_q_norm.weight": (head_dim,), "attn_k_norm.weight": (head_dim,)})
    if config["model_type"] in ("gemma2", "gemma3"):  # norms after attention and after the MLP too
        layer.update({"post_attention_norm.weight": (hidden,), "post_ffw_norm.weight": (hidden,)})
    shapes = {f"blk.{i}.{kind}": shape for i in range(n_layers) for kind, shape in layer.items()}
    missing = [name for name in ["output_norm.weight", *shapes] if name not in tensors]
    if missing:
        raise ValueError(f"GGUF file lacks tensor(s) {', '.join(missing[:5])}")
    shapes.update({"token_embd.weight": (vocab, hidden), "output.weight": (vocab, hidden),
                   "output_norm.weight": (hidden,), ROPE_FREQS: (head_dim // 2,)})
    for name, tensor in tensors.items():
        if name not in shapes:
            raise ValueError(f"unexpected tensor {name!r}: minispec maps only {'/'.join(ARCHITECTURES)} decoder tensors")
        if tensor.shape != shapes[name]:
            raise ValueError(f"GGUF tensor {name!r} has shape {tensor.shape}, but the metadata implies {shapes[name]}")


def gemma_config(get, config, head_dim, arch):
    """What llama.cpp's Gemma 2 and 3 assume beyond the metadata: queries scaled by head_dim^-0.5 (by
    (hidden / heads)^-0.5 in the 27B models), Gemma 2's even layers sliding and its soft-caps, Gemma 3's
    every 6th layer global and the others sliding with RoPE base 10000."""
    n_layers, window = config["num_hidden_layers"], get("attention.sliding_window", COUNT, None)
    big = 46 if arch == "gemma2" else 62  # the 27B model's layers
    scalar = config["hidden_size"] // config["num_attention_heads"] if n_layers == big else head_dim
    if arch == "gemma2":
        return {"layer_types": ["full_attention" if i % 2 else "sliding_attention" for i in range(n_layers)],
                "sliding_window": window or 4096, "query_pre_attn_scalar": scalar,
                "attn_logit_softcapping": get("attn_logit_softcapping", POSITIVE, 50.0),
                "final_logit_softcapping": get("final_logit_softcapping", POSITIVE, 30.0)}
    types = ["sliding_attention" if window and (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    softcap = get("final_logit_softcapping", POSITIVE, None)
    return {"layer_types": types, "sliding_window": window or 4096, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": scalar, **({"final_logit_softcapping": softcap} if softcap else {})}


def token_ids(metadata, keys, vocab_size):
    """{name: id} of the special tokens in the metadata ({name: tokenizer.ggml key}), each a token of the vocabulary."""
    token_id = Check(integer(0, vocab_size - 1), f"must be a token id from 0 to {vocab_size - 1}")
    return {name: meta(metadata, f"tokenizer.ggml.{key}", token_id) for name, key in keys.items()
            if f"tokenizer.ggml.{key}" in metadata}


def special_token_ids(metadata, vocab_size):
    ids = token_ids(metadata, {"bos_token_id": "bos_token_id", "pad_token_id": "padding_token_id"}, vocab_size)
    # Chat models end turns with eot/eom tokens too; generation should stop at any of them.
    ends = token_ids(metadata, {key: key for key in ("eos_token_id", "eot_token_id", "eom_token_id")}, vocab_size)
    eos = list(dict.fromkeys(ends.values()))
    if eos:
        ids["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return ids


def rope_scaling(metadata, arch, tensors, head_dim, theta):
    if ROPE_FREQS in tensors:
        return llama3_rope_scaling(dequantize(tensors[ROPE_FREQS]).tolist(), head_dim, theta)
    kind = meta(metadata, f"{arch}.rope.scaling.type", TEXT, "none")
    factor = meta(metadata, f"{arch}.rope.scaling.factor", POSITIVE, 1.0)
    if kind == "none" or (kind == "linear" and factor == 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = meta(metadata, f"{arch}.rope.scaling.original_context_length", COUNT, None)
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


LOW_FREQ_FACTOR, HIGH_FREQ_FACTOR = 1.0, 4.0  # Meta's Llama 3 rope scaling values, the same for every 3.x


def llama3_rope_scaling(freq_factors, head_dim, theta):
    """The HF llama3 rope_scaling that made llama.cpp's rope_freqs tensor, with Meta's frequency factors: the
    factor is the largest divisor; the original context follows from any divisor between 1 and it (without
    one, any power of two between the kept and the divided wavelengths gives the same divisors)."""
    factor = max(freq_factors)
    if factor <= 1.0 + 1e-6:
        return None
    wavelengths = [2 * math.pi * theta ** (2 * i / head_dim) for i in range(len(freq_factors))]
    smooth = [(1 / f - 1 / factor) / (1 - 1 / factor) for f in freq_factors]
    between = [(w, s) for w, s in zip(wavelengths, smooth) if 1e-4 < s < 1 - 1e-4]
    if between:
        wavelength, s = between[0]
        original = round(wavelength * (LOW_FREQ_FACTOR + (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR) * s))
    else:
        kept = [w for w, f in zip(wavelengths, freq_factors) if f < 1 + 1e-6]
        original = 2 ** math.ceil(math.log2(HIGH_FREQ_FACTOR * max(kept, default=0.25)))
    # the divisors those give, as llama.cpp's converter computes them (smooth 0: long wavelengths, divided by factor)
    smooth = [min(max((original / w - LOW_FREQ_FACTOR) / (HIGH_FREQ_FACTOR - LOW_FREQ_FACTOR), 0.0), 1.0)
              for w in wavelengths]
    expected = [1 / ((1 - s) / factor + s) for s in smooth]
    if len(freq_factors) != head_dim // 2 or any(abs(a - b) > 1e-3 * b for a, b in zip(freq_factors, expected)):
        raise ValueError("GGUF rope_freqs.weight is not Llama 3 rope scaling (low/high frequency factors 1 and 4)")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": LOW_FREQ_FACTOR,
            "high_freq_factor": HIGH_FREQ_FACTOR, "original_max_position_embeddings": original}


def unpermute(weight, n_head):
    """Undo llama.cpp's reordering of each q/k head from rotate-half halves to ggml's interleaved pairs."""
    rows = weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *weight.shape[1:])
    return rows.transpose(1, 2).reshape(weight.shape)


# Projections minispec's llama fuses into one layer (models/llama.py: wqkv, w13).
FUSED = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))


def kept_quantized(tensors, source=None):
    """{GGUF name: stored form} of every quantized 2-D tensor, the projections fused into one layer brought to
    one form (quant.common_form: Q4_K_M files quantize v with Q6_K, q and k with Q4_K), or all dequantized where
    one of them is float. `source`: the file, whose pages are dropped as each tensor is read."""
    stored = {}
    for name, tensor in tensors.items():
        if tensor.type in QUANT_TYPES and len(tensor.shape) == 2:
            stored[name] = stored_form(tensor)
            if source:
                release_file_pages([source])
    layers = {match[1] for name in tensors if (match := re.fullmatch(r"blk\.(\d+)\..+", name))}
    for layer in layers:
        for kinds in FUSED:
            names = [f"blk.{layer}.{kind}.weight" for kind in kinds if f"blk.{layer}.{kind}.weight" in tensors]
            if all(name in stored for name in names):
                stored.update(zip(names, common_form([stored[name] for name in names])))
            else:
                for name in names:
                    stored.pop(name, None)
    return stored


def hf_weights(tensors, config, dtype=None, progress=False, keep_quantized=False, source=None):
    """{HF name: tensor}: dequantized, cast to `dtype` if given, or kept quantized (<name>.qweight, .scales...)."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    stored = kept_quantized(tensors, source) if keep_quantized else {}
    quantized_bytes = sum(t.data.numel() for t in tensors.values() if t.type in QUANT_TYPES)
    weights = {}
    with tqdm(total=quantized_bytes, bar_format="minispec: converted {percentage:.0f}% of {total_fmt}iB",
              unit_scale=True, unit_divisor=1024, disable=not progress or quantized_bytes < PROGRESS_MIN_BYTES) as bar:
        for name, tensor in tensors.items():
            if name == ROPE_FREQS:
                continue
            target, kind = hf_name(name, config["model_type"]), name.split(".")[-2]
            llama_qk = config["model_type"] == "llama" and kind in heads
            rows = partial(unpermute, n_head=heads[kind]) if llama_qk else (lambda weight: weight)
            if name in stored:
                prefix = target.removesuffix(".weight")
                weights.update({f"{prefix}.{key}": rows(value) for key, value in stored[name].items()})
            else:
                weight = rows(dequantize(tensor))
                if config["model_type"] in ("gemma2", "gemma3_text") and name.endswith("norm.weight"):
                    weight = weight - 1  # llama.cpp stores Gemma's norm weights w as the 1 + w they scale by
                weights[target] = weight if dtype is None else weight.to(dtype)
            if source and tensor.type in QUANT_TYPES and name not in stored:  # its pages: read, and copied
                release_file_pages([source])
            bar.update(tensor.data.numel() if tensor.type in QUANT_TYPES else 0)
    return weights


# ---------------------------------------------------------------------------------------------
# Tokenizer: the GGUF vocabulary, merges and special tokens as a Hugging Face tokenizer.json

SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                  "pad_token": "padding_token_id"}  # tokenizer_config.json name -> tokenizer.ggml key


def split_then_bytes(digits):
    """Llama 3's and Qwen2's pre-tokenizer: their regexes differ only in the digits a piece takes."""
    regex = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + digits +
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    split = {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}
    return {"type": "Sequence", "pretokenizers": [split, {**BYTE_LEVEL, "use_regex": False}]}


# tokenizer.ggml.pre -> (normalizer, pre_tokenizer) of the model's original tokenizer.json
PRE_TOKENIZERS = {
    "gpt-2": (None, BYTE_LEVEL),
    "smollm": (None, {"type": "Sequence",
                      "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]}),
    "qwen2": ({"type": "NFC"}, split_then_bytes("")),
    "llama-bpe": (None, split_then_bytes("{1,3}")),
    # Gemma's SentencePiece vocabulary (tokenizer.ggml.model 'llama'): spaces as "▁", bytes outside it as <0xNN>
    "gemma": (SPACES, {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}),
}


def merges_by_rank(tokens):
    """BPE merges for a SentencePiece vocabulary that lists none (Gemma's): every split of a token into two,
    in the reference's order (earlier tokens first, then longer left parts)."""
    vocab = set(tokens)
    return [[token[:cut], token[cut:]] for token in tokens for cut in range(len(token) - 1, 0, -1)
            if token[:cut] in vocab and token[cut:] in vocab]


def tokenizer_files(metadata, vocab_size):
    """{file name: JSON content} of tokenizer.json and tokenizer_config.json ({} without a vocabulary)."""
    model = meta(metadata, "tokenizer.ggml.model", TEXT, None)
    if model is None:
        return {}
    gemma = model == "llama" and meta(metadata, "general.architecture", TEXT) in ("gemma2", "gemma3")
    if model == "llama" and not gemma:
        raise ValueError("GGUF SentencePiece vocabularies (tokenizer.ggml.model 'llama') are not supported yet "
                         "but for gemma2's and gemma3's")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; minispec imports byte-level BPE ('gpt2')")
    pre = "gemma" if gemma else meta(metadata, "tokenizer.ggml.pre", TEXT, "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; minispec knows {', '.join(PRE_TOKENIZERS)}")
    normalizer, pre_tokenizer = PRE_TOKENIZERS[pre]
    spelled = meta(metadata, "tokenizer.ggml.tokens", TEXTS)
    # Gemma's whitespace tokens with spaces, as the reference reads them: in "▁"s (its normalizer's), not added tokens
    tokens = ["\u2581" * len(t) if gemma and " " in t and not t.strip() else t for t in spelled]
    if len(tokens) > vocab_size:
        raise ValueError(f"GGUF metadata tokenizer.ggml.tokens holds {len(tokens)} tokens, but token_embd.weight "
                         f"has {vocab_size} rows")
    types = meta(metadata, "tokenizer.ggml.token_type", list_of(INTEGER, "integers"), [TokenType.NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"GGUF metadata tokenizer.ggml.token_type holds {len(types)} types for {len(tokens)} tokens")
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == TokenType.CONTROL} for i, kind in enumerate(types)
             if kind in (TokenType.CONTROL, TokenType.USER_DEFINED) and tokens[i] == spelled[i]]
    ids = token_ids(metadata, SPECIAL_TOKENS, len(tokens))
    bos = ids.get("bos_token") if meta(metadata, "tokenizer.ggml.add_bos_token", FLAG, False) else None
    eos = ids.get("eos_token") if meta(metadata, "tokenizer.ggml.add_eos_token", FLAG, False) else None
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer, "post_processor": template_processor(tokens, bos, eos),
        "decoder": BYTE_FALLBACK if gemma else
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": tokens[ids["unk_token"]] if gemma and "unk_token" in ids else None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": gemma, "byte_fallback": gemma,
            "ignore_merges": False, "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": merges_by_rank(tokens) if gemma else meta(metadata, "tokenizer.ggml.merges", TEXTS, []),
        },
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": bos is not None,
              "add_eos_token": eos is not None, "clean_up_tokenization_spaces": False,
              **{name: tokens[i] for name, i in ids.items()}}
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = meta(metadata, "tokenizer.chat_template", TEXT)
    return {"tokenizer.json": tokenizer, "tokenizer_config.json": config}


def template_processor(tokens, bos_id, eos_id):
    """A post-processor putting bos/eos (either may be None) around every encoded text."""
    wrap = [i for i in (bos_id, eos_id) if i is not None]
    if not wrap:
        return None

    def template(sequence, type_id):
        return [{"Sequence": {"id": part, "type_id": type_id}} if part == sequence else
                {"SpecialToken": {"id": tokens[part], "type_id": type_id}} for part in (bos_id, sequence, eos_id)
                if part is not None]

    return {
        "type": "TemplateProcessing",
        "single": template("A", 0),
        "pair": template("A", 0) + template("B", 1),
        "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for i in wrap},
    }


# Written last into a converted folder: the GGUF file's SHA-256 and the layout of the tensors. A folder
# without it (cut short), or with another file's hash or another layout, is converted again.
COMPLETE = "conversion-complete"
LAYOUT = "2"


def convert_gguf(gguf_path, out_dir, dtype=None, progress=True, keep_quantized=False, check=None, source_hash=""):
    """Write `out_dir` from a GGUF file and return it: float weights in their type or `dtype`, quantized ones as
    the exact fp32 values they dequantize to, or kept quantized. The folder is staged, checked by `check` and
    renamed at the end, so a failure leaves nothing. Every problem with the file is a ValueError naming it."""
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"{out_dir} already exists; remove it or choose another output directory")
    metadata, tensors = read_gguf(gguf_path)
    # Everything that can reject the file runs before the slow part and before anything is written.
    try:
        for tensor in tensors.values():
            check_supported(tensor)
        config = hf_config(metadata, tensors)
        tokenizer = tokenizer_files(metadata, config["vocab_size"])
    except ValueError as error:
        raise ValueError(f"{gguf_path}: {error}") from None
    # a large file's pages dropped as each tensor is read (a small one's cost less than reading /proc/self/maps)
    source = gguf_path if gguf_path.stat().st_size >= PROGRESS_MIN_BYTES else None
    weights = hf_weights(tensors, config, dtype, progress, keep_quantized, source)
    if keep_quantized:
        config["quantization_config"] = {"quant_method": QUANT_METHOD}

    with staging(out_dir) as staged:
        (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_safetensors(weights, staged / "model.safetensors", metadata={"format": "pt"})
        del weights  # before the check loads the folder again, and given back to the system
        release_freed_memory()
        for file_name, content in tokenizer.items():
            (staged / file_name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        try:
            if check:
                check(staged)
        except ValueError as error:
            message = str(error).replace(str(staged), str(out_dir))  # the folder it would have been
            raise ValueError(f"{gguf_path}: its conversion does not load: {message}") from None
        (staged / COMPLETE).write_text(f"{source_hash} layout {LAYOUT}")
        staged.rename(out_dir)
    return out_dir


@contextmanager
def staging(target):
    """A new partial folder beside `target` to build it in (the body renames it to keep it), removed when the
    body ends, fails or SIGTERM arrives, or by the next sweep_partials if the process is killed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sweep_partials(target)
    # the lock: released however the process ends; waits only while another sweeps
    with locked(target.parent, fcntl.LOCK_SH), sigterm_raises() as held:
        staged = None
        try:
            with held():
                staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-{os.getpid()}-", dir=target.parent))
            yield staged
        finally:
            with held():
                if staged:
                    shutil.rmtree(staged, ignore_errors=True)


def sweep_partials(target):
    """Remove the partials of `target` that killed processes left, while no process writes one (the lock)."""
    # OSError: no folder yet, or none this process may read: nothing it could sweep
    with suppress(OSError), locked(target.parent, fcntl.LOCK_EX | fcntl.LOCK_NB) as held:
        for stale in target.parent.glob(glob.escape(f".{target.name}.partial-") + "*") if held else ():
            shutil.rmtree(stale, ignore_errors=True)


@contextmanager
def locked(folder, operation):
    """Whether fcntl.flock took `folder`'s lock, held through the body; False where another process holds it or the
    file system has none (partials are then never swept, rather than swept while they are written)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, operation)
            held = True
        except OSError:
            held = False
        yield held
    finally:
        os.close(fd)  # and with it the lock


@contextmanager
def sigterm_raises():
    """SIGTERM raises SystemExit in the body, so that its cleanup runs (where the default handler is in place,
    in the main thread); yields `held`, a context deferring it to its end: no partial is half made or removed."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield nullcontext
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)  # the exit status of a process SIGTERM ended

    @contextmanager
    def held():
        pending = []
        signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, terminate)
            if pending:
                terminate(pending[0], None)

    signal.signal(signal.SIGTERM, terminate)
    try:
        yield held
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
