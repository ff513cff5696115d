"""The kernels that make a forward row-invariant: every token's numbers are the same whether it is
decoded alone, verified among γ + 1 tokens, or computed in a batch row beside others, so greedy
speculative decoding (and every batch) gives exactly plain decoding's tokens, in float32 and bfloat16
alike (docs/design.md, "Row invariance"; tests/test_rows.py guards it). The linear layers multiply
through oneDNN on a weight packed once; attention pads its query rows to full blocks.
"""

import functools
import weakref
from contextlib import contextmanager
from typing import Optional

import torch
import torch.nn.functional as F


# Why oneDNN on CPU: BLAS's float32 GEMM takes a 1-row product (a decode step) through a GEMV and partial
# blocks of rows through other kernels, each summing in its own order, so a token's logits would differ
# by rounding between a 1-token step and a k-token verify, and a near-tie could flip greedy's argmax.
# oneDNN's matmul over a weight packed once for it computes every row alike whatever the row count,
# and is faster than BLAS's at the 1-16 rows decoding uses (docs/performance.md, row invariance).
# The packed weights, by the float weight's data_ptr: the op finds them from the weight it is given,
# so compiled graphs hold no per-model constant and a target and its draft share graphs as before.
# An entry lives as long as the weight's storage (not its Parameter, which outlives its data after
# `.to()`, `.half()` or `param.data = ...`), so no stale copy stays alive, and none is found by a new
# tensor that the allocator places at a freed address.
_PACKED = {}  # data_ptr -> (the weight's version when packed, packed weight: an opaque oneDNN tensor)


def version(tensor):
    """How often the tensor was written in place (-1 for inference tensors, which keep no count)."""
    return -1 if tensor.is_inference() else tensor._version


def pack(weight):
    """Pack a weight for oneDNN; the packed copy goes when the weight's storage does."""
    key = weight.data_ptr()
    # 16: the row count oneDNN plans the packing for; every row count then runs the same kernels
    entry = _PACKED[key] = version(weight), torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    weakref.finalize(weight.untyped_storage(), forget, key, entry)
    return entry[1]


def forget(key, entry):
    if _PACKED.get(key) is entry:  # not a newer weight's, packed at the same address since
        del _PACKED[key]


@torch.library.custom_op("minispec::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if weight.device.type != "cpu":  # the model was moved after loading
        return F.linear(x, weight, bias)
    version_packed, packed = _PACKED.get(weight.data_ptr(), (None, None))
    if version_packed != version(weight):  # new or written in place since it was packed (a test, a LoRA merge)
        if not can_pack_on_cpu(weight.dtype):  # converted after loading to a dtype oneDNN cannot take here
            return F.linear(x, weight, bias)
        packed = pack(weight)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# On CUDA, cuBLAS picks a GEMM kernel (tile shape, split-K) by the number of rows, so a row's sums depend
# on how many rows share its product. Seen on an H100 (docs/performance.md, "GPU"): float32 products of
# 16 and 17+ rows differ, and bfloat16 ones of 64 and 65+ rows when K is 8192, so no padding to a multiple
# keeps one kernel. Every CUDA product is therefore made of products of exactly CUDA_ROW_BLOCK rows (the
# last block padded): one kernel for any width. 64 rows cost a bfloat16 decode step what 1 row costs,
# since it is bound by reading the weight; a long prompt's prefill pays one weight read per 64 tokens.
CUDA_ROW_BLOCK = 64


def linear(x, weight, bias, packed):
    if packed:
        return packed_linear(x, weight, bias)
    if x.is_cuda:
        return in_row_blocks(lambda rows: F.linear(rows, weight, bias), x)
    return F.linear(x, weight, bias)


def in_row_blocks(product, x):
    """product(rows) of x [..., K], with every call taking exactly CUDA_ROW_BLOCK rows."""
    rows = x.numel() // x.shape[-1]
    flat = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, -rows % CUDA_ROW_BLOCK))
    out = torch.cat([product(block) for block in flat.split(CUDA_ROW_BLOCK)]) if rows > CUDA_ROW_BLOCK \
        else product(flat)
    return out[:rows].view(*x.shape[:-1], out.shape[-1])


def can_pack(dtype, device):
    """Whether oneDNN matmuls run here for this dtype (float32 wherever torch has oneDNN; bfloat16 and
    float16 only on CPUs with the instructions for them)."""
    return device.type == "cpu" and can_pack_on_cpu(dtype)


@functools.cache
def can_pack_on_cpu(dtype):
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 16)
        return True
    except RuntimeError:
        return False


# Query rows of one attention call are padded to a multiple of this. Why: float32 SDPA on CPU runs its
# score and value matmuls through BLAS, whose kernels take rows in blocks of 4 and compute a partial block
# (1-3 rows: a 1-token decode step) in another order, so a token's numbers would depend on how many
# tokens share its forward. Full blocks give every row the same arithmetic (docs/design.md, "Row
# invariance"; tests/test_rows.py guards it). Costs a few zero rows of q. On CUDA, SDPA padded to 16
# rows kept every row's numbers for 1 to 64 rows on an H100 (tests/test_cuda.py guards it).
ATTENTION_ROW_BLOCK = 4
CUDA_ATTENTION_ROW_BLOCK = 16


def attend(q, k, v, mask, scale=None):
    """scaled_dot_product_attention of q [b, h, rows, d] over k, v [b, h, s, d], with each query row
    computed as it would be alone. mask: boolean or additive, [..., rows or 1, s]."""
    rows = q.shape[-2]
    if mask.dim() == 3:  # [batch, rows, s]: a mask per batch row, the same for every head
        mask = mask.unsqueeze(1)
    pad = -rows % (CUDA_ATTENTION_ROW_BLOCK if q.is_cuda else ATTENTION_ROW_BLOCK)
    if pad:
        q = F.pad(q, (0, 0, 0, pad))
        if mask.shape[-2] > 1:  # padded rows repeat the last row's mask: an all-masked row would be NaN
            mask = torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], pad, mask.shape[-1])], dim=-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :rows, :]


def causal_mask(input_pos, max_seq_len):
    """Boolean [..., n, max_seq_len] for input_pos [..., n]: query i may read cache position j iff
    j <= input_pos[..., i]."""
    return torch.arange(max_seq_len, device=input_pos.device) <= input_pos[..., None]



@contextmanager
def without_row_invariance(model):
    """The model computing as it would without row invariance: BLAS linears and attention rows unpadded.
    Only to measure what row invariance costs (minispec.bench --row-invariance-price)."""
    global ATTENTION_ROW_BLOCK
    packed = [module for module in model.modules() if getattr(module, "packed", False)]
    block = ATTENTION_ROW_BLOCK
    for module in packed:
        module.packed = False
    ATTENTION_ROW_BLOCK = 1
    try:
        yield
    finally:
        for module in packed:
            module.packed = True
        ATTENTION_ROW_BLOCK = block
