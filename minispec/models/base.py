"""What every minispec model shares: the static KV cache and the one interface decoding code uses.

    prefix = model.encode(prompt)    # T5: runs the encoder once; decoder-only models return the prompt
    logits = model.prefill(prefix, logits_for=1)   # empties the cache and fills it from position 0
    logits = model.decode(tokens)    # appends 1..k tokens at position `model.length`
    model.rollback(length)           # forget everything from `length` on: moves a pointer, copies nothing
    model.reorder_cache(beam_idx)    # beam search: beams live in the batch dimension
    logits = model.decode_rows(Feed(tokens, lengths, widths[, parents]))  # a cache row per request, chains or trees
    model.keep(row, slots, length)   # a tree's accepted path moved into place as a chain
    model.move_row(source, destination, length)  # a row moved into a finished one's place

Draft heads read `decode_rows(..., hidden=True)`'s (logits, hidden states), `embed_tokens` and `logits`.
A family implements `setup_caches`, `features(tokens, input_pos, layout, keys, last)` (hidden states
[batch, n, dim]), `embed_tokens(tokens)`, `logits(hidden)` (float32), a `config` with vocab_size and the
properties `context_length` (None: no limit) and `head` (a Linear, or the tied Embedding). `features` attends
only to cache positions <= each query's position, through kernels.attend_cache, so entries past the
current length are never read and rolling back needs no clearing.
"""

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from itertools import accumulate
from typing import NamedTuple, Optional

import torch
from torch import nn

from . import backend
from .kernels import (attend_cache, can_pack, causal_mask, elementwise, linear, pack_together, query_rows_mask,
                      to_device, tree_layout, whole_blocks)


# Eager forwards over more tokens (prompts) run in chunks of this many (CachedLM.eager_forward).
PREFILL_CHUNK = 128

# Marks a layer's part that torch.compile compiles once for all the layers (older PyTorch: once per layer).
compile_region = getattr(torch.compiler, "nested_compile_region", lambda function: function)


class Family(NamedTuple):
    """What a family module gives the loader (loading/checkpoint.py)."""
    config: type  # from_hf(config.json's dict) -> the config, a dataclass with vocab_size; LAYER_STACKS
    model: type  # a CachedLM built from that config
    convert: object  # convert_hf_weights(state_dict, config) -> the model's own keys


class Feed(NamedTuple):
    """One decode_rows forward: tokens [rows, n], row i at cache length lengths[i] (host ints), its first
    widths[i] tokens its own (None: all); each row's token tree (None: chains); a draft head's inputs."""
    tokens: torch.Tensor
    lengths: list
    widths: Optional[list] = None
    parents: Optional[list] = None
    inputs: Optional[torch.Tensor] = None

    def ends(self, j):
        """One past the last cache slot the first j tokens of any row write."""
        return max(length + max(min(j, width), 1) for length, width in zip(self.lengths, self.widths))

    def input_pos(self):
        """Each token's cache slot: a row's padding rewrites its last token's."""
        n = self.tokens.shape[1]
        slots = [[length + min(j, max(width - 1, 0)) for j in range(n)]
                 for length, width in zip(self.lengths, self.widths)]
        return to_device(slots[0] if len(slots) == 1 else slots, self.tokens.device)

    def layout(self, positions):
        """The trees' TreeLayout over `positions` cache positions (None: chains)."""
        return None if self.parents is None else tree_layout(self.lengths, self.parents, self.widths,
                                                             self.tokens.shape[1], positions, self.tokens.device)


class KVCache(nn.Module):
    """Keys and values of one attention layer, preallocated for `max_seq_len` positions."""

    def __init__(self, batch_size, n_heads, max_seq_len, head_dim, dtype, device):
        super().__init__()
        shape = (batch_size, n_heads, max_seq_len, head_dim)
        with torch.inference_mode(False):  # usable (and compilable) outside generate()'s inference mode too
            self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
            self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    first_row = 0  # the cache row of the forward's batch row 0 (set by CachedLM.rows_from)

    def update(self, input_pos, k, v):
        """Write k, v [rows, heads, n, head_dim] at input_pos [n] or [rows, n] of the rows from `first_row`."""
        rows = slice(self.first_row, self.first_row + k.shape[0])
        if input_pos.dim() == 1:
            self.k[rows].index_copy_(2, input_pos, k)
            self.v[rows].index_copy_(2, input_pos, v)
        else:
            index = input_pos[:, None, :, None].expand_as(k)
            self.k[rows].scatter_(2, index, k)
            self.v[rows].scatter_(2, index, v)
        return self.k[rows], self.v[rows]


class RMSNorm(nn.Module):
    """Llama's and T5's layer norm, statistics in float32 at least (as the reference)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = backend.current().rms_norm(x, self.weight, self.eps)
        if y is not None:
            return y
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return self.weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def pack_linears(model, packed_one=None):
    """Give every float Linear (and a tied head) a packed copy of its weight (kernels.pack) where a packed
    kernel takes the model's dtype. The float weight stays: checkpoints and `.to()` read it."""
    if not can_pack(model.dtype, model.device):
        return model
    weights = {}  # by address: a weight two modules share is packed once
    for module in [*model.modules(), model.head]:  # the head: a Linear, or the token Embedding when tied
        is_linear = isinstance(module, Linear) or (module is model.head and isinstance(module, Embedding))
        if is_linear and module.weight.dtype == model.dtype and not module.packed:
            weights[module.weight.data_ptr()] = module.weight
            module.packed = True
    pack_together(list(weights.values()), packed_one)
    return model


class Linear(nn.Linear):
    packed = False  # set by pack_linears

    def forward(self, x):
        return linear(x, self.weight, self.bias, self.packed)


class Embedding(nn.Embedding):
    """A token embedding, which can also be the tied output head: `unembed(x)` is x @ weight.T."""

    packed = False  # set by pack_linears when the embedding is also the head

    def reset_parameters(self):
        if not self.weight.is_meta:  # a load's model, whose weights the checkpoint's replace: normal_ on the
            super().reset_parameters()  # meta device imports torch._dynamo, seconds of every load

    def unembed(self, x):
        return linear(x, self.weight, None, self.packed)


def apply_rope(x, cos, sin):
    """Rotate x [B, T, heads, head_dim] by cos and signed sin [T or B x T, head_dim] (rope_tables): the
    halves swapped by a roll times the signed sines are rotate_half's, bit for bit, in fewer operations."""
    wide = x.float()
    return (wide * cos.unsqueeze(-2) + wide.roll(x.shape[-1] // 2, -1) * sin.unsqueeze(-2)).type_as(x)


class Attention(nn.Module):
    """A Llama or Gemma layer's grouped-query attention over its KVCache, q, k and v from one fused projection
    (q and k heads normed first where config.qk_norm); scores scaled by `scale`, soft-capped by `softcap` (0: not)."""

    def __init__(self, config, window, norm, out_bias, scale=None, softcap=0.0):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        self.window, self.scale, self.softcap = window, scale, softcap
        self.wqkv = Linear(config.dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.wo = Linear(self.n_heads * self.head_dim, config.dim, bias=out_bias)
        self.q_norm = norm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.kv_cache = None

    def project(self, x, cos, sin):
        """x [B, T, dim] -> q, k, v [B, T, heads + 2 kv_heads, head_dim] in one new tensor, q and k rotated
        (a compile region's outputs come out wrong when they are views of its other tensors)."""
        B, T, _ = x.shape
        kv_size = self.n_kv_heads * self.head_dim
        qk, v = self.wqkv(x).split([self.n_heads * self.head_dim + kv_size, kv_size], dim=-1)
        qk = qk.view(B, T, self.n_heads + self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.n_heads, self.n_kv_heads], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = apply_rope(qk, cos, sin)
        return torch.cat([qk, v.view(B, T, self.n_kv_heads, self.head_dim)], dim=2)

    def forward(self, qkv, input_pos, mask, layout):
        """The attention of `project`'s q, k, v (the layer's keys and values written to its cache)."""
        B, T = qkv.shape[:2]
        q, k, v = qkv.transpose(1, 2).split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=1)
        k, v = self.kv_cache.update(input_pos, k, v)
        # Grouped-query attention without copying the cache: the query heads sharing a K/V head become
        # extra query rows of that head (their mask repeated by query_rows_mask).
        q = q.reshape(B, self.n_kv_heads, self.n_heads // self.n_kv_heads * T, self.head_dim)
        y = attend_cache(q, k, v, mask, self.scale, layout, self.softcap)
        y = y.reshape(B, self.n_heads, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)
        return self.wo(y)


class GatedMLP(nn.Module):
    """A Llama or Gemma layer's MLP: w2(act(gate) * up), with gate and up fused into w13."""

    def __init__(self, config, act, bias=False):
        super().__init__()
        self.act = act
        self.w13 = Linear(config.dim, 2 * config.intermediate_size, bias=bias)
        self.w2 = Linear(config.intermediate_size, config.dim, bias=bias)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return self.w2(elementwise(self.act, gate) * up)


class CachedLM(nn.Module):
    """Base of every minispec model: the decoding interface on top of a family's `forward`."""

    is_encoder_decoder = False

    def __init__(self):
        super().__init__()
        self.length = 0  # number of valid positions in the KV caches
        self.encoder_calls = 0  # stays 0 for decoder-only models
        self.cache_batch_size = self.cache_max_seq_len = 0
        # Set by the loader (minispec.loading.checkpoint.load_model): tokenizer and special token ids.
        self.tokenizer, self.bos_token_id, self.eos_token_ids, self.pad_token_id = None, None, (), None
        self.name = type(self).__name__
        self.fingerprint = None  # set by the loader: the checkpoint's files
        self.directory = None  # set by the loader: the checkpoint folder read (a GGUF file's conversion)
        self.checkpoint_rows = None  # set by a loader that cut padding rows
        self.compiled_forward = None  # set by compile()
        self.quantization = None  # set by models.quant.quantize_model: mode, group size, notes
        self.tp = None  # set by models.tp.shard: this rank's place in a tensor-parallel group

    def setup_caches(self, batch_size, max_seq_len):
        """Record the caches' shape: whole blocks of keys, as attention reads them (a family allocates them)."""
        self.cache_batch_size, self.cache_max_seq_len, self.length = batch_size, whole_blocks(max_seq_len), 0
        self._kv_caches = None  # the caches the subclass is about to make

    def forward(self, tokens, input_pos, logits_for=None, layout=None, keys=None, hidden=False, inputs=None):
        """float32 logits [batch, n, vocab] (of the last `logits_for`); `hidden`: (logits, every position's states,
        or with layer indices those entering them: EAGLE-3). `inputs`: what a draft head reads beside each token."""
        last = None if hidden else logits_for
        extra = ({} if inputs is None else {"inputs": inputs}) | ({"taps": hidden} if isinstance(hidden, tuple) else {})
        x = self.features(tokens, input_pos, layout, keys, last, **extra)
        x, states = x if isinstance(hidden, tuple) else (x, x)
        logits = self.logits(x if logits_for is None or not hidden else x[:, x.shape[1] - logits_for:])
        return (logits, states) if hidden else logits

    def ensure_caches(self, batch_size, max_seq_len):
        """Reuse the caches when they fit; otherwise allocate them, rounded up to a power of two so that
        slightly longer requests reuse them too (a new shape costs an allocation and a recompilation)."""
        context = self.context_length
        if context is not None and max_seq_len > context:
            raise ValueError(f"{self.name}: a sequence of {max_seq_len} tokens does not fit the model's context of "
                             f"{context} tokens; use a shorter prompt or fewer new tokens")
        # Fewer rows than the caches hold are fine: forwards use the first rows.
        if batch_size > self.cache_batch_size or max_seq_len > self.cache_max_seq_len:
            self.setup_caches(batch_size, self.cache_length_for(max_seq_len))
            backend.current().in_huge_pages(self.kv_caches())  # read every step, as the weights are

    def cache_length_for(self, max_seq_len):
        """The positions a cache allocated for `max_seq_len` gets (see ensure_caches)."""
        size = max(256, 1 << (max_seq_len - 1).bit_length())
        return min(size, self.context_length) if self.context_length else size

    def kv_bytes_per_position(self):
        """Bytes of keys and values one cache row holds per position, over every layer's KVCache."""
        if not self.cache_batch_size:  # the shapes tell: a cache of one block shows them
            self.setup_caches(1, 1)
            self.cache_batch_size = self.cache_max_seq_len = 0  # too small to keep: the first request sizes it
        return sum(2 * m.k.shape[1] * m.k.shape[3] * m.k.element_size() for m in self.kv_caches())

    def compile(self, mode=None):
        """torch.compile the decode forward (models/compiled.py)."""
        from .compiled import compile_model  # the compiler's part: read only by a compiled load
        return compile_model(self, mode)

    def encode(self, prompt, row=None):
        """The tokens the decoder starts from (here: the prompt itself); with `row`, one request's of a batch."""
        return prompt

    def prepare_batch(self, rows, longest_prompt):
        """Room for `rows` requests decoded together (T5's encoder memory)."""

    def encode_row(self, row, prompt):
        return self.encode(prompt, row)

    def prefill(self, tokens, logits_for=None):
        """Start a sequence of exactly `tokens` (maybe none): logits of the last `logits_for` positions (None: all)."""
        self.length = 0
        return self.decode(tokens, logits_for, eager=True) if tokens.shape[1] else None

    def decode(self, tokens, logits_for=None, eager=False):
        """Append tokens [batch, n] at position `length`: decode_rows of one length for every row."""
        n = tokens.shape[1]
        if self.length + n > self.cache_max_seq_len:
            raise ValueError(f"{self.name}: writing {n} tokens at position {self.length} overflows the KV cache of "
                             f"{self.cache_max_seq_len} positions")
        logits = self.decode_rows(Feed(tokens, [self.length]), logits_for=logits_for, eager=eager)
        self.length += n
        return logits

    def eager_forward(self, tokens, input_pos, logits_for, layout, ends, hidden=False, inputs=None):
        """forward() in chunks of PREFILL_CHUNK tokens from the end (a tree's nodes all in the last), each
        attending over the cache positions up to its last token only (Feed.ends); chunks change no number."""
        n = tokens.shape[1]
        cuts = [n - i for i in range(0, n, PREFILL_CHUNK)][::-1]  # each chunk's end
        out = []
        for start, end in zip([0] + cuts[:-1], cuts):
            wanted = None if logits_for is None else min(end - start, max(logits_for - (n - end), 0))
            last = None if layout is None or end < n else layout._replace(  # earlier chunks: a chain
                positions=layout.positions[:, start:], window=layout.window[:, start:], shared={})
            out.append(self.forward(tokens[:, start:end], input_pos[..., start:end], wanted, last,
                                    self.keys_for(ends(end)), hidden, None if inputs is None else inputs[:, start:end]))
        if len(out) == 1:
            return out[0]
        return tuple(torch.cat(part, dim=1) for part in zip(*out)) if hidden else torch.cat(out, dim=1)

    def keys_for(self, end):
        """The cache positions an eager forward attends over when no token lies at `end` or beyond."""
        return min(whole_blocks(end), self.cache_max_seq_len)

    def decode_rows(self, feed, first_row=0, logits_for=None, eager=False, hidden=False):
        """Append a Feed's tokens [rows, n] to the cache rows from `first_row`, each at its own length: logits
        [rows, n, vocab] (of the last `logits_for`). Padding past a row's width recomputes its last token exactly,
        so nothing is written past a row's own tokens (width 0: a placeholder, its logits meaningless). With
        `feed.parents`, trees (kernels.tree_layout). `eager`: skip the compiled forward; `hidden`: forward's."""
        rows, n = feed.tokens.shape
        if feed.widths is None:
            feed = feed._replace(widths=[n] * rows)
        if feed.ends(n) > self.cache_max_seq_len or first_row + rows > self.cache_batch_size:
            raise ValueError(f"{self.name}: writing {n} tokens at position {max(feed.lengths)} of cache rows "
                             f"{first_row}..{first_row + rows - 1} overflows the KV cache of "
                             f"{self.cache_batch_size} rows x {self.cache_max_seq_len} positions")
        if self.compiled_forward is not None and first_row == 0 and not eager and logits_for is None:
            from .compiled import decode_compiled  # read only by a compiled model
            return decode_compiled(self, feed, hidden)
        with self.rows_from(first_row) if first_row else nullcontext():  # eager: a graph would guard on the row
            return self.eager_forward(feed.tokens, feed.input_pos(), logits_for,
                                      feed.layout(self.keys_for(feed.ends(n))), feed.ends, hidden, feed.inputs)

    @staticmethod
    def padded(feeds):
        """decode_rows' tokens and widths from each row's token ids (1-D; None: nothing to feed): shorter
        rows repeat their last token, empty rows get a placeholder (a draft head's inputs alike)."""
        widths = [0 if feed is None else len(feed) for feed in feeds]
        if len(feeds) == 1 and widths[0]:
            return feeds[0].unsqueeze(0), widths
        fed = [feed for feed in feeds if feed is not None]
        flat = torch.cat(fed + [fed[0].new_zeros(1, *fed[0].shape[1:])])  # the placeholder last
        index = [[offset + min(j, w - 1) if w else len(flat) - 1 for j in range(max(widths))]
                 for offset, w in zip(accumulate(widths, initial=0), widths)]
        return flat[to_device(index, flat.device)], widths

    @contextmanager
    def rows_from(self, first_row):
        """The forwards inside write and read the caches from batch row `first_row` on."""
        modules = [module for module in self.modules() if hasattr(module, "first_row")]  # caches, T5's memory
        for module in modules:
            module.first_row = first_row
        try:
            yield
        finally:
            for module in modules:
                module.first_row = 0

    def move_row(self, source, destination, length=None):
        """Copy the first `length` positions (None: all) of cache row `source` into row `destination`."""
        for module in self.kv_caches():
            module.k[destination, :, :length] = module.k[source, :, :length]
            module.v[destination, :, :length] = module.v[source, :, :length]

    def keep(self, row, slots, length):
        """Keys and values of cache row `row` at `slots` (increasing, each >= its destination) moved to
        positions length, length + 1, ...: a tree's accepted path laid out as a chain."""
        moved = next((i for i, slot in enumerate(slots) if slot != length + i), len(slots))
        slots, length = slots[moved:], length + moved  # a path's first nodes may be in place already
        caches = [cache for module in self.kv_caches() for cache in (module.k, module.v)]
        if not slots or backend.current().keep(caches, row, slots, length):  # one call, not two operations a cache
            return
        index = to_device(slots, self.device)
        for cache in caches:
            cache[row, :, length:length + len(slots)] = cache[row, :, index]

    def kv_caches(self):
        """Every layer's KVCache, found once per setup_caches (keep runs every tree step)."""
        found = self.__dict__.get("_kv_caches")
        if found is None:
            found = self._kv_caches = [module for module in self.modules() if isinstance(module, KVCache)]
        return found

    def rollback(self, length):
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {self.length} positions")
        self.length = length

    def reorder_cache(self, beam_idx):
        """Batch row i becomes row beam_idx[i], for the first len(beam_idx) rows."""
        for module in self.kv_caches():
            for cache in (module.k, module.v):
                cache[:len(beam_idx)] = cache.index_select(0, beam_idx)

    @property
    def vocab_size(self):
        return self.config.vocab_size

    @property
    def hidden_size(self):
        """Width of the hidden states: what embed_tokens returns and the output head reads."""
        return self.embed_tokens(torch.zeros(1, dtype=torch.long, device=self.device)).shape[-1]

    @property
    def device(self):
        return next(self.parameters()).device

    @property
    def dtype(self):
        return next(self.parameters()).dtype


@dataclass
class DecoderConfig:
    """The sizes a Decoder family's config (Llama's, Gemma's) starts with."""
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_seq_len: int

    # config.json's layer count -> the checkpoint's name for the stack of layers (checkpoint.check_layer_counts)
    LAYER_STACKS = {"num_hidden_layers": "layers"}


class Decoder(CachedLM):
    """Llama's and Gemma's decoder: an embedding, a block per config.windows entry (None: full attention), a head."""

    def __init__(self, config, block, norm):
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(block(config, window) for window in config.windows)
        self.norm = norm(config.dim, config.norm_eps)
        self.output = None if config.tie_word_embeddings else Linear(config.dim, config.vocab_size, bias=False)

    @property
    def context_length(self):
        return self.config.max_seq_len

    @property
    def head(self):
        return self.tok_embeddings if self.output is None else self.output

    def setup_caches(self, batch_size, max_seq_len):
        super().setup_caches(batch_size, max_seq_len)
        for layer in self.layers:
            # the layer's own head count: fewer than the config's when sharded (models/tp.py)
            layer.attention.kv_cache = KVCache(batch_size, layer.attention.n_kv_heads, self.cache_max_seq_len,
                                               self.config.head_dim, self.dtype, self.device)

    def window_masks(self, positions, keys):
        """{window: mask} over `keys` positions as Attention reads them: keys up to a query's p, after p - window."""
        causal = causal_mask(positions, keys)
        key_pos = torch.arange(keys, device=positions.device)
        group = self.config.n_heads // self.config.n_kv_heads
        return {w: query_rows_mask(causal if w is None else causal & (key_pos > positions[..., None] - w), group)
                for w in set(self.config.windows)}

    def features(self, tokens, input_pos, layout=None, keys=None, last=None, taps=None):
        """The final hidden states, and with `taps` the states entering those layers side by side (EAGLE-3's)."""
        tapped = []
        x = self.blocks(self.embed_tokens(tokens), input_pos, layout, keys, taps or (), tapped)
        x = self.norm(x if last is None else x[:, x.shape[1] - last:])
        return x if taps is None else (x, torch.cat(tapped, dim=-1))

    def blocks(self, x, input_pos, layout, keys, taps=(), tapped=None):
        """The layers over embedded tokens x [batch, n, dim] (an EAGLE head's one layer too); the state
        entering each layer listed in `taps` is appended to `tapped` (index n_layers: the last one's output)."""
        positions = input_pos if layout is None else layout.positions  # a tree's tokens: their depths
        masks = self.window_masks(positions, keys or self.cache_max_seq_len)
        rope = self.rope(positions)  # (cos, sin) of the global layers, then of the sliding ones
        fused = self.fused_layers(x)
        if fused is not None:
            x, *states = fused(x, input_pos, *rope[0], masks, layout, taps)
            if states:
                tapped.extend(states)
            return x
        for i, layer in enumerate(self.layers):
            if i in taps:
                tapped.append(x)
            window = layer.attention.window
            x = layer(x, input_pos, *rope[window is not None], masks[window], layout)
        if len(self.layers) in taps:  # the last layer's output (training an EAGLE-3 head reads it too)
            tapped.append(x)
        return x

    def fused_layers(self, x):
        """The backend's one call for every layer of this forward (a function of blocks' inputs); None: the modules."""
        return None

    def embed_tokens(self, tokens):
        return self.tok_embeddings(tokens)

    def logits(self, hidden):
        return (self.tok_embeddings.unembed(hidden) if self.output is None else self.output(hidden)).float()


def rope_cos_sin(inv_freq, max_seq_len, scale=1.0):
    """cos and signed sin [max_seq_len, head_dim] float32 of the pairs' inverse frequencies, times `scale`."""
    angles = torch.outer(torch.arange(max_seq_len, device=inv_freq.device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos() * scale, angles.sin() * scale
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


# A Llama-like checkpoint's Hugging Face names -> ours (Decoder's).
DECODER_RENAMES = {
    "model.embed_tokens.": "tok_embeddings.", "model.norm.": "norm.", "lm_head.": "output.",
    ".self_attn.o_proj.": ".attention.wo.", ".mlp.down_proj.": ".feed_forward.w2.",
    ".input_layernorm.": ".attention_norm.",
    ".self_attn.q_norm.": ".attention.q_norm.", ".self_attn.k_norm.": ".attention.k_norm.",
}


def convert_decoder_weights(weights, config, renames):
    """A Llama-like checkpoint's names -> ours (DECODER_RENAMES and `renames`), q/k/v and gate/up fused (stored
    quantized tensors too). Unknown keys pass through, so the loader reports them as unexpected."""
    renames = DECODER_RENAMES | renames
    out = {}
    for name, tensor in weights.items():
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name.removeprefix("model.")] = tensor
    if config.tie_word_embeddings:  # tied checkpoints may or may not carry a copy of the embedding
        out.pop("output.weight", None)
    for i in range(config.n_layers):
        attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
        for kind in ("weight", "bias", "qweight", "scales", "offsets"):
            fuse(out, [f"{attn}.{p}_proj.{kind}" for p in "qkv"], f"layers.{i}.attention.wqkv.{kind}")
            fuse(out, [f"{mlp}.gate_proj.{kind}", f"{mlp}.up_proj.{kind}"], f"layers.{i}.feed_forward.w13.{kind}")
    return out


def fuse(weights, names, fused_name):
    """Concatenate checkpoint tensors along dim 0 into one of our fused tensors (when all are present)."""
    if all(name in weights for name in names):
        parts = [weights.pop(name) for name in names]
        if len({p.shape[1:] for p in parts}) > 1:
            shapes = ", ".join(f"{n} {tuple(p.shape)}" for n, p in zip(names, parts))
            raise ValueError(f"tensors {shapes} disagree in shape and cannot be fused into {fused_name}")
        weights[fused_name] = torch.cat(parts)
