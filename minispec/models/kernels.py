"""The kernels that make a forward row-invariant: every token's numbers are the same whether it is
decoded alone, verified among γ + 1 tokens or computed in a batch row beside others, so greedy
speculative decoding gives exactly plain decoding's tokens (docs/design.md, "Row invariance").
"""

import functools
import weakref
from contextlib import contextmanager
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import backend


# Why packed weights on CPU: BLAS sums a 1-row product (a decode step) and partial blocks of rows in other
# orders than full ones, so a token's logits would differ between a 1-token step and a k-token verify. A
# backend's own float32 kernel sums every row alike; elsewhere oneDNN's matmul on a packed weight does,
# with PACKED_MIN_ROWS and PACKED_MAX_ROWS below.
# The packed weights, by the float weight's data_ptr (compiled graphs then hold no per-model constant),
# each living as long as the weight's storage, so that no stale copy stays alive or is found again.
_PACKED = {}  # data_ptr -> [the weight's version when packed, packed weight]


def to_device(values, device, dtype=torch.long):
    """Host numbers as a tensor on `device`, without a host sync (a blocking copy waits for all queued GPU work)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def version(tensor):
    """How often the tensor was written in place (-1 for inference tensors, which keep no count)."""
    return -1 if tensor.is_inference() else tensor._version


def own_kernel(dtype):
    """Whether the backend's own float kernel takes this dtype's products here (else oneDNN's)."""
    return backend.current().float_kernel(dtype)


def pack(weight, packed=None):
    """Keep `packed` (default: the weight packed for its kernel) as the weight's packed copy."""
    if packed is None:
        # oneDNN: 16 is the row count it plans the packing for; every row count then runs the same kernels
        packed = backend.current().float_pack(weight) if own_kernel(weight.dtype) else \
            torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    key = weight.data_ptr()
    entry = _PACKED.get(key)
    if entry is None:
        entry = _PACKED[key] = [version(weight), packed]
        weakref.finalize(weight.untyped_storage(), forget, key, entry)
    else:  # packed again, or moved: in place, so that the storage's finalizer holds no stale copy alive
        entry[:] = version(weight), packed
    return packed


def pack_together(weights, packed_one=None):
    """Pack weights (packed_one() after each), the backend kernel's copies then together in huge pages."""
    for weight in weights:
        pack(weight)
        if packed_one is not None:
            packed_one()
    own = [weight for weight in weights if own_kernel(weight.dtype)]
    backend.current().to_huge_pages([_PACKED[weight.data_ptr()][1] for weight in own],
                                    lambda i, moved: pack(own[i], moved))


def forget(key, entry):
    if _PACKED.get(key) is entry:  # not a newer weight's, packed at the same address since
        del _PACKED[key]


# oneDNN sums a 1-row product in another order than more rows: every product takes at least this many
# rows, the rest zeros (not 2: 2-row products read the weights slowest).
PACKED_MIN_ROWS = 4
# AMX sums bfloat16 products of more than 32 rows in another order: longer ones go in blocks of this many.
PACKED_MAX_ROWS = 32


def packed_weight(weight):
    """The weight's packed copy (repacked if written since); None where no packed kernel takes it (moved, converted)."""
    if not weight.is_cpu:
        return None
    version_packed, packed = _PACKED.get(weight.data_ptr(), (None, None))
    if version_packed != version(weight):  # new or written in place since it was packed
        if not can_pack(weight.dtype, weight.device):
            return None
        packed = pack(weight)
    return packed


def packed_product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    packed = packed_weight(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(rows, x.shape[-1])
    if own_kernel(weight.dtype):
        out = backend.current().float_product(flat.contiguous(), packed, bias, weight.shape[0])
    elif rows <= PACKED_MAX_ROWS:
        out = onednn_product(flat, packed, bias)
    else:
        out = torch.cat([onednn_product(block, packed, bias) for block in flat.split(PACKED_MAX_ROWS)])
    return out.view(*x.shape[:-1], weight.shape[0])


def onednn_product(rows, packed, bias):
    """oneDNN's product of rows [n <= PACKED_MAX_ROWS, K], padded with zero rows to PACKED_MIN_ROWS."""
    n = rows.shape[0]
    if n >= PACKED_MIN_ROWS:
        return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(F.pad(rows, (0, 0, 0, PACKED_MIN_ROWS - n)), packed, bias, "none", [], "")
    return out[:n]


# An op of its own for torch.compile; eager calls the function itself (a Python op's dispatch is dear).
packed_linear = torch.library.custom_op("minispec::packed_linear", mutates_args=())(packed_product)


@packed_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


# cuBLAS picks a GEMM kernel by the number of rows, so a row's sums depend on how many rows share its
# product: every CUDA product is made of products of exactly this many rows (the last padded), which cost
# a weight-bound decode step what 1 row does.
CUDA_ROW_BLOCK = 64


def linear(x, weight, bias, packed):
    if packed:
        eager = not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
        return packed_product(x, weight, bias) if eager else packed_linear(x, weight, bias)
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
    """Whether packed products run here for this dtype (the backend's kernel, or oneDNN's)."""
    return device.type == "cpu" and (own_kernel(dtype) or onednn_packs(dtype))


@functools.cache
def onednn_packs(dtype):
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 16)
        return True
    except RuntimeError:
        return False


# Rows of an elementwise activation are padded to a multiple of this many elements: PyTorch's CPU loops
# take a buffer's remainder through a scalar loop whose silu and tanh-gelu differ in the last bit.
ELEMENTWISE_ROW_MULTIPLE = 64


def elementwise(function, x):
    """function(x) for an elementwise function, each row computed as it would be alone."""
    pad = -x.shape[-1] % ELEMENTWISE_ROW_MULTIPLE
    if pad == 0 or x.is_cuda:
        return function(x)
    return function(F.pad(x, (0, pad)))[..., :x.shape[-1]]


# Query rows of one attention call are padded to a multiple of this: BLAS takes rows in blocks of 4 and
# computes a partial block in another order (on CUDA, SDPA's blocks are 16 rows).
ATTENTION_ROW_BLOCK = 4
CUDA_ATTENTION_ROW_BLOCK = 16


def padded_rows(mask):
    """A mask [..., rows, S] with its rows padded as attend pads q's (the last row repeated: an all-masked
    row would be NaN), once a forward rather than every layer."""
    pad = -mask.shape[-2] % (CUDA_ATTENTION_ROW_BLOCK if mask.is_cuda else ATTENTION_ROW_BLOCK)
    if not pad or mask.shape[-2] == 1:
        return mask
    return torch.cat([mask, mask[..., -1:, :].expand(*mask.shape[:-2], pad, mask.shape[-1])], dim=-2)


def rows_as_read(mask):
    """A model's additive mask as attend_cache reads it: rows padded for PyTorch's path, not the backend kernel's."""
    return mask if mask.device.type == "cpu" and native_attention() else padded_rows(mask)


def attend(q, k, v, mask, scale=None):
    """SDPA of q [b, h, rows, d] over k, v [b, h, s, d], each row computed as alone; mask [..., rows or 1, s]."""
    rows = q.shape[-2]
    q, mask = padded_query(q, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[..., :rows, :]


def padded_query(q, mask):
    """q [b, h, rows, d] and its mask [..., rows or 1, S] (or [b, rows, S]) padded to whole row blocks (padded_rows)."""
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    pad = -q.shape[-2] % (CUDA_ATTENTION_ROW_BLOCK if q.is_cuda else ATTENTION_ROW_BLOCK)
    return (F.pad(q, (0, 0, 0, pad)), padded_rows(mask)) if pad else (q, mask)


def causal_mask(input_pos, max_seq_len):
    """Boolean [..., n, max_seq_len]: query i may read cache position j iff j <= input_pos[..., i]."""
    return torch.arange(max_seq_len, device=input_pos.device) <= input_pos[..., None]


def additive(mask):
    """A boolean mask as the additive float32 one attend_cache takes: 0 where readable, -inf elsewhere."""
    return torch.zeros(mask.shape, device=mask.device).masked_fill_(~mask, float("-inf"))


def query_rows_mask(mask, group):
    """A boolean mask [..., n, keys] as Attention reads it: additive, repeated for the `group` query heads
    sharing a K/V head (extra query rows of that head), its rows as attend_cache reads them."""
    return rows_as_read(additive(mask.repeat(*[1] * (mask.dim() - 2), group, 1)))


# Attention over a KV cache is computed in one canonical order, so that a token's numbers do not depend on
# where in the cache its keys sit (a tree's node reads ancestors scattered among its siblings' slots). Keys
# go in blocks of KEY_BLOCK positions: a block's exp-sum and value product come from one fixed-shape kernel
# over its keys in position order, and blocks are added one after another (cumsum). A tree's rows then
# need their own copy of only the one or two blocks that hold the tree (`TreeLayout`).
KEY_BLOCK = 32


def whole_blocks(positions):
    """`positions` rounded up to whole blocks of KEY_BLOCK."""
    return -(-positions // KEY_BLOCK) * KEY_BLOCK


class TreeLayout(NamedTuple):
    """Where a forward's tokens sit when they form trees (one per batch row): a token's position is its
    depth after the row's length, its keys and values in the next free cache slot."""
    positions: torch.Tensor  # [rows, n]: each token's position (RoPE, learned positions, masks)
    window: torch.Tensor  # [rows, n, W]: the cache slot holding each window position's key, for each token
    window_positions: torch.Tensor  # [rows, W]: those positions: whole blocks, the blocks that hold the trees
    first_block: int  # the window's first block in row 0 (the host knows it: no device sync to read it)
    shared: dict  # attend_cache's index tensors, made by the forward's first layer for the others


def tree_layout(lengths, parents, widths, n, cache_positions, device):
    """The TreeLayout of trees fed at cache slots lengths[r], lengths[r] + 1, ... of each row r: the
    row's widths[r] tokens are the last nodes of its tree parents[r], node j attached to node
    parents[r][j] (-1: to the row's cached tokens); earlier nodes were written just before lengths[r].
    Rows of fewer than n tokens are padded as decode_rows pads them."""
    blocks = cache_positions // KEY_BLOCK
    positions, first_block = [], []
    moved = []  # (row, token, position, slot) of each key read from another slot than its position's
    for r, (length, row_parents, width) in enumerate(zip(lengths, parents, widths)):
        written = len(row_parents) - width  # nodes already in the cache
        start = length - written  # the slot of node 0, which sits at position start
        depth, row_moved = [], []
        for j, parent in enumerate(row_parents):
            depth.append(0 if parent < 0 else depth[parent] + 1)
            ancestor = j
            # Its path: the ancestor at depth d is read as position start + d. Up to the first token
            # with a sibling before it, the path is a chain in its own slots (keys already in place).
            while j >= written and ancestor >= 0 and ancestor != depth[ancestor]:
                row_moved.append((j - written, start + depth[ancestor], start + ancestor))
                ancestor = row_parents[ancestor]
        last = max(width - 1, 0)  # padding tokens read as the row's last token does
        row_moved += [(t, position, slot) for t in range(width, n) for token, position, slot in row_moved
                      if token == last]
        moved += [(r, token, position, slot) for token, position, slot in row_moved]
        fed = [start + d for d in depth[written:]] or [length]  # nothing to feed: a placeholder at its length
        positions.append(fed + [fed[-1]] * (n - len(fed)))
        # The window: the blocks from the first position some token reads from another slot (a chain
        # before the tree, such as a prompt, reads its own) to the last position.
        first_block.append((min(p for _, p, _ in row_moved) if row_moved else max(fed)) // KEY_BLOCK)
    # One block when every row's tree fits in one (usually: trees are a few tokens deep), else two.
    window_blocks = max(max(row) // KEY_BLOCK - first for row, first in zip(positions, first_block)) + 1
    if window_blocks > 2:
        raise ValueError(f"a token tree spans {window_blocks} blocks of {KEY_BLOCK} positions (at most 2)")
    first_block = [min(first, blocks - window_blocks) for first in first_block]
    span = [[first * KEY_BLOCK + i for i in range(window_blocks * KEY_BLOCK)] for first in first_block]
    # Built on the device from the moved keys: a few hundred numbers cross instead of the window.
    span = to_device(span, device)
    window = span[:, None, :].repeat(1, n, 1)  # outside a token's path, a position's key is in its own slot
    if moved:  # each moved key at its offset in its row's window
        moved = [(r, token, position - first_block[r] * KEY_BLOCK, slot) for r, token, position, slot in moved]
        row, token, offset, slot = to_device(list(zip(*moved)), device)
        window.index_put_((row, token, offset), slot)
    return TreeLayout(to_device(positions, device), window, span, first_block=first_block[0], shared={})


def tree_keys(layout, S):
    """[rows, n, S]: the cache slot holding each of the first S positions' key, for each token (computed,
    not stored: a compiled graph fuses it into the gather that reads it)."""
    rows, n, W = layout.window.shape
    position = torch.arange(S, device=layout.window.device)
    offset = position - layout.window_positions[:, :1]  # [rows, S]
    inside = (offset >= 0) & (offset < W)
    path = layout.window.gather(2, offset.clamp(0, W - 1)[:, None, :].expand(rows, n, S))
    return torch.where(inside[:, None, :], path, position)


class TreeIndices(NamedTuple):
    """What attend_cache gathers for a forward's trees, the same in every layer (`tree_indices`); q has
    rows = group x n query rows (group-major), padded by `pad` to whole row blocks."""
    scores: torch.Tensor  # [b, h, rows + pad, S]: the cache slot whose score each row reads at each position
    values: torch.Tensor  # [b, h, n x W, d]: each token's window of values, its path's in position order
    weights: torch.Tensor  # [b, h, n x W / KEY_BLOCK x (group + pad') x KEY_BLOCK]: the window's weights by
    # (token, block), each the rows of one product, padded to a whole row block by repeating the last
    blocks: torch.Tensor  # [b, h, W / KEY_BLOCK, group, n, d]: the window's blocks among all blocks
    first_block: Optional[int]  # the first of them in batch row 0 (None in a compiled graph: it would guard on it)


def tree_indices(layout, b, h, group, pad, d, S, compiling=False):
    """attend_cache's TreeIndices for q [b, h, group x n (+ pad), d] over S positions under `layout`."""
    n, span = layout.window.shape[1:]
    row_block = CUDA_ATTENTION_ROW_BLOCK if layout.window.is_cuda else ATTENTION_ROW_BLOCK
    padded_group = group + -group % row_block
    rows = torch.arange(group * n + pad, device=layout.window.device).clamp(max=group * n - 1)  # pad: the last
    scores = tree_keys(layout, S).repeat(1, group, 1)[:, rows]  # row g x n + t reads as token t does
    values = layout.window.reshape(b, 1, n * span, 1)
    # weights[b, h, row, position] for row = g x n + t (g < group, then the last g again) and the window's
    # positions, in the order (t, block, g, key) of the products' rows
    g = torch.arange(padded_group, device=rows.device).clamp(max=group - 1)
    t = torch.arange(n, device=rows.device)
    row = (g[None, :] * n + t[:, None])  # [n, padded group]
    blocked = layout.window_positions.view(b, 1, span // KEY_BLOCK, 1, KEY_BLOCK)
    weights = (row[None, :, None, :, None] * S + blocked).reshape(b, 1, -1)
    blocks = (layout.window_positions[:, ::KEY_BLOCK] // KEY_BLOCK).view(b, 1, -1, 1, 1, 1)
    return TreeIndices(scores[:, None].expand(b, h, -1, -1), values.expand(b, h, -1, d),
                       weights.expand(b, h, -1), blocks.expand(b, h, -1, group, n, d),
                       None if compiling else layout.first_block)


def native_attention():  # decided once: compiled graphs hold whichever kernel eager runs
    """Whether attention over a CPU's cache runs the backend's own kernel."""
    return backend.current().attends()


def attend_cache(q, k, v, mask, scale=None, layout=None, softcap=0.0):
    """Attention of q [b, h, rows, d] over a KV cache k, v [b, h, S, d] in the canonical order above; mask: additive
    float32 [..., rows or 1, S' <= S] by position; `layout`: trees. On CPUs a backend's own kernel computes it in
    one call, except with gradients (it has no backward) or a `softcap` (Gemma 2's tanh capping)."""
    own = not softcap and not (torch.is_grad_enabled() and q.requires_grad)
    if q.device.type == "cpu" and native_attention() and own:
        return backend_attend(q, k, v, mask, scale, layout)
    b, h, rows, d = q.shape
    S = mask.shape[-1]  # the positions the forward reads: all the cache's, or its first blocks
    k, v = k[:, :, :S], v[:, :, :S]
    q, mask = padded_query(q, mask)
    pad = q.shape[-2] - rows
    scores = q.float() @ k.float().transpose(-1, -2)  # each score alone: invariant to the key's slot
    if layout is not None:  # each token's keys in position order: its path, not its siblings'
        shape = (b, h, rows // layout.window.shape[1], pad, d, S)
        indices = once_a_forward(layout, shape, lambda: tree_indices(layout, *shape, torch.compiler.is_compiling()))
        scores = scores.gather(-1, indices.scores)
    if scale != 1.0:  # out of place: gradients can flow (training a draft head)
        scores = scores * (scale if scale is not None else d ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores + mask
    weights = (scores - scores.amax(-1, keepdim=True)).exp().view(b * h, rows + pad, S // KEY_BLOCK, KEY_BLOCK)
    values = v.float()
    products = weights.transpose(1, 2) @ values.view(b * h, S // KEY_BLOCK, KEY_BLOCK, d)  # [bh, blocks, rows, d]
    if layout is not None:
        tree_products(products.view(b, h, -1, rows + pad, d), weights.view(b, h, -1), values, indices)
    # Each block's products and exp-sum, then the blocks added one after another: cumsum adds in order,
    # so blocks of zeros past a row's keys (however many the forward reads) change nothing.
    blocks = torch.cat([products, weights.sum(-1).transpose(1, 2).unsqueeze(-1)], dim=-1)
    total = blocks.cumsum(1)[:, -1] if blocks.shape[1] > 1 else blocks[:, 0]
    out = total[..., :d] / total[..., d:]
    return out.view(b, h, rows + pad, d)[..., :rows, :].to(q.dtype)


def backend_attend(q, k, v, mask, scale, layout):
    """attend_cache through the backend's kernel: every row alone, so no padded rows."""
    b, h, rows, d = q.shape
    if mask.dim() == 3:
        mask = mask.unsqueeze(1)
    mask = mask[..., :rows, :] if mask.shape[-2] > 1 else mask
    mask = mask.float().expand(b, h, rows, mask.shape[-1])  # T5's position bias is in the model's dtype
    slots = None if layout is None else key_slots(layout, mask.shape[-1])
    out = backend.current().attend(q.float().contiguous(), k, v, mask, slots, d ** -0.5 if scale is None else scale)
    return out.to(q.dtype)


def key_slots(layout, width):
    """tree_keys(layout, width) as a backend's attention kernel reads them, made once a forward."""
    return once_a_forward(layout, width, lambda: tree_keys(layout, width))


def once_a_forward(layout, key, make):
    """make(), kept in layout.shared for the forward's other layers (a compiled graph computes it once anyway)."""
    if torch.compiler.is_compiling():
        return make()
    found = layout.shared.get(key)
    if found is None:
        found = layout.shared[key] = make()
    return found


def tree_products(products, weights, values, indices):
    """Recompute the window's blocks of products [b, h, blocks, rows + pad, d] in place from each token's path."""
    b, h, _, _, d = products.shape
    _, _, window_blocks, group, n, _ = indices.blocks.shape
    if b == 1:  # one request: whole rows of d copied (a gather takes each number alone, 8x slower here)
        own = values[0].index_select(1, indices.values[0, 0, :, 0])
    else:
        own = values.gather(2, indices.values)
    own = own.view(-1, KEY_BLOCK, d)  # [(b, h, token, block), key, d]
    w = weights.gather(2, indices.weights).view(own.shape[0], -1, KEY_BLOCK)  # [(b, h, token, block), group + pad', key]
    mine = (w @ own).view(b, h, n, window_blocks, -1, d)[..., :group, :].permute(0, 1, 3, 4, 2, 5)
    products = products[:, :, :, :group * n].unflatten(3, (group, n))
    if indices.first_block is not None and b == 1:  # the window's blocks are consecutive: a copy, not a scatter
        first = indices.first_block
        products[:, :, first:first + window_blocks].copy_(mine)
    else:
        products.scatter_(2, indices.blocks, mine)


@contextmanager
def without_row_invariance(model):
    """The model without row invariance (BLAS linears, attention rows unpadded): what it costs, for the bench."""
    global ATTENTION_ROW_BLOCK
    packed = [module for module in model.modules() if getattr(module, "packed", False)]
    block, ATTENTION_ROW_BLOCK = ATTENTION_ROW_BLOCK, 1
    for module in packed:
        module.packed = False
    try:
        yield
    finally:
        for module in packed:
            module.packed = True
        ATTENTION_ROW_BLOCK = block
