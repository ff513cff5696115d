"""minispec's own CPU kernels: quantized and float32 products (qlinear.cpp, flinear.cpp), attention over a
KV cache (attention.cpp) and a Llama model's layers in one call (layer.cpp), compiled at first use for
this machine's instruction set and cached, with weights and caches in huge pages (pages.py). They serve
the models as a backend (`Native`, models/backend.py's interface), which a load installs. Where they
cannot be built (no compiler, no x86, a failed build, or MINISPEC_NATIVE=0), `available()` is False.

Why: PyTorch's CPU int4 kernel is compute-bound on AVX2 and its int8 one takes a call per group; oneDNN's
float32 product costs more from its 7th row on; and an eager step of a small model spends as much in
dispatching small operations (attention's, a layer's) as in their arithmetic.
"""

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..models import backend, kernels
from ..models.backend import PyTorch
from . import pages
from .layers import stack_of

log = logging.getLogger("minispec")

SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("qlinear.cpp", "flinear.cpp", "attention.cpp", "layer.cpp"))
HEADER = Path(__file__).with_name("native.h")  # what they include: part of the build's key too
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")  # and cxx_standard()
BUILD_SECONDS = 600  # a hung compiler must not hang a load
# A first build's time (seconds), before this machine has timed one: a quiet machine's, a busy one's.
FIRST_BUILD_SECONDS = (20, 80)


def cpu_flags():
    """What -march=native builds for: the kernel is cached per instruction set, not per file."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def compiler():
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def cxx_standard():
    """The C++ standard torch's headers need: C++20 from torch 2.14 on, C++17 before."""
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    return "-std=c++20" if (major, minor) >= (2, 14) else "-std=c++17"


def build_command(cxx, out):
    from torch.utils import cpp_extension
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    libs = cpp_extension.library_paths()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [cxx, *FLAGS, cxx_standard(), f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes, *map(str, SOURCES),
            "-o", str(out), *[f"-L{path}" for path in libs], *[f"-Wl,-rpath,{path}" for path in libs],
            "-lc10", "-ltorch_cpu"]


def library_path(cxx):
    texts = [path.read_text() for path in (*SOURCES, HEADER)]
    parts = (*texts, torch.__version__, cxx, " ".join(FLAGS), cpu_flags())
    key = hashlib.sha256(b"\0".join(part.encode() for part in parts)).hexdigest()[:16]
    root = os.environ.get("MINISPEC_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                              os.path.expanduser("~/.cache"), "minispec")
    return Path(root) / "kernels" / f"kernels-{key}.so"


def build(cxx, path):
    """Compile into a temporary file beside `path`, then rename it there (a build cut short leaves none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".partial")
    os.close(fd)
    last = build_seconds_file(path)
    try:
        estimate = float(last.read_text()) if last.exists() else None
    except ValueError:
        estimate = None
    try:
        low, high = FIRST_BUILD_SECONDS
        log.warning("minispec: building its CPU kernels, once per machine: %s",
                    f"about {estimate:.0f} s, as the last build here" if estimate else f"{low}-{high} s")
        start = time.monotonic()
        code, errors = compile_showing_progress(build_command(cxx, partial), estimate or high)
        if code != 0:
            raise RuntimeError(first_error(errors))
        os.replace(partial, path)
        last.write_text(f"{time.monotonic() - start:.1f}\n")
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def build_seconds_file(path):
    """Where the last build on this machine left its time: the next build's estimate."""
    return path.parent / "build-seconds"


def compile_showing_progress(command, estimate):
    """(exit status, stderr) of the compiler, killed past BUILD_SECONDS; on a terminal, a progress bar."""
    bar = tqdm(total=round(estimate), desc="minispec: building CPU kernels", unit="s", leave=False,
               disable=not sys.stderr.isatty(), bar_format="{desc}: {n:.0f} of about {total} s |{bar}|")
    with bar, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as process:
        start = time.monotonic()
        while True:
            try:
                errors = process.communicate(timeout=1)[1]
                return process.returncode, errors
            except subprocess.TimeoutExpired:
                elapsed = time.monotonic() - start
                if elapsed > BUILD_SECONDS:
                    process.kill()
                    raise
                bar.update(min(elapsed, bar.total) - bar.n)


def first_error(stderr):
    """The compiler's first error line (its last lines are often only a caret under the code)."""
    lines = stderr.strip().splitlines()
    return next((line.strip() for line in lines if "error" in line), lines[-1].strip() if lines else "compiler failed")


@functools.cache
def available():
    """Load (building them first if needed) the kernels; False, with one logged line, where they cannot be."""
    if os.environ.get("MINISPEC_NATIVE", "1") == "0":
        return False
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False  # the kernel's fast path is AVX2; elsewhere PyTorch's kernels serve
    cxx = compiler()
    if cxx is None:
        log.warning("minispec: no C++ compiler found: PyTorch's slower kernels serve instead of minispec's own")
        return False
    try:
        path = library_path(cxx)
        if not path.exists():
            build(cxx, path)
        load(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as error:
        log.warning("minispec: could not build its CPU kernels (%s): PyTorch's serve instead", error)
        return False
    return True


TILE = 16  # output columns the kernel computes together
BLOCK = 32  # inputs per block
STEP_INPUTS = 256  # inputs sharing a step in the two-level form: a GGUF K-quant's super-block
# A K-quant super-block's scales are its fp16 step times small integers, the largest 63 (Q4_K, Q5_K) or
# -128 (Q6_K): the step is found from the largest value, and checked.
LARGEST_MULTIPLIERS = (63, -128, 127)
CHUNK_ELEMENTS = 1 << 22  # pack's temporaries: a few rows of a weight at a time, not a whole head


@functools.cache
def load(path):
    torch.ops.load_library(path)
    torch.library.register_fake("minispec_native::qlinear")(  # for torch.compile's tracing
        lambda x, qweight, scales, offsets, steps, group: x.new_empty(x.shape[0], scales.shape[0] * TILE))
    torch.library.register_fake("minispec_native::flinear")(
        lambda x, packed, bias, features: x.new_empty(x.shape[0], features))
    torch.library.register_fake("minispec_native::attend")(lambda q, k, v, mask, slots, scale: torch.empty_like(q))


def pack(q, scales, offsets):
    """A stored weight (q: int8 [N, K], or uint8 [N, K] of values 0..15 for int4; scales, offsets [N, G])
    in qlinear.cpp's layout (described there): 4, 5, 6 or 8 bits a value, whichever holds them all;
    scales and offsets float32 or float16 [tiles, G, 16], or int8 multipliers of float16 steps where they
    are such (`two_level`). Returns (qweight, scales, offsets, steps or None)."""
    pad = -q.shape[0] % TILE
    tiles, K = (q.shape[0] + pad) // TILE, q.shape[1]
    bits = 4 if q.dtype == torch.uint8 else 5 if five_bits(q, offsets) else 6 if six_bits(q) else 8
    packed = torch.empty(tiles, K // BLOCK, bits, TILE * 4, dtype=torch.uint8 if bits < 8 else q.dtype)
    rows = max(TILE, CHUNK_ELEMENTS // K // TILE * TILE)
    for row in range(0, q.shape[0], rows):
        packed[row // TILE:(row + rows) // TILE] = pack_values(q[row:row + rows], bits, offsets)
    levels = [two_level(t, K // scales.shape[1]) for t in (scales, offsets) if t is not None]
    steps = None
    if all(level is not None for level in levels):
        scales, offsets = levels[0][0], None if offsets is None else levels[1][0]
        steps = torch.stack([level_steps for _, level_steps in levels], -1).half()
    one_level = torch.float16 if steps is None and all(t is None or fits_half(t) for t in (scales, offsets)) \
        else torch.float32

    def tiled(t):  # [N, ...] -> [tiles, ..., 16]
        t = F.pad(t, (0,) * (2 * t.dim() - 2) + (0, pad)).view(tiles, TILE, *t.shape[1:])
        return t.movedim(1, -1).contiguous()
    return (packed, *(None if t is None else tiled(t if steps is not None else t.to(one_level))
                      for t in (scales, offsets, steps)))


def pack_values(q, bits, offsets):
    """pack's weight layout for rows of q, padded to whole tiles: [tiles, K / 32, `bits` vectors, 64]."""
    q = F.pad(q, (0, 0, 0, -q.shape[0] % TILE))
    tiles, K = q.shape[0] // TILE, q.shape[1]
    # [tile, c, block, k, j] -> [tile, block, k, c, j]
    q = q.view(tiles, TILE, K // BLOCK, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, K // BLOCK, 8, TILE * 4)
    if bits == 4:
        return q[:, :, :4] | (q[:, :, 4:] << 4)
    if bits < 8:  # vector k's top `width` bits at bits width·k on of the extra vectors, one bit string
        u = (q.to(torch.int16) + stored_bias(bits, offsets)).to(torch.uint8)
        width = bits - 4
        extra = [sum(u[:, :, k] >> 4 << k * width % 8 for k in range(8) if k * width // 8 == p) for p in range(width)]
        return torch.cat([(u[:, :, :4] & 0x0F) | (u[:, :, 4:] & 0x0F) << 4, torch.stack(extra, 2)], 2)
    return q


def fits_half(values):
    """Whether every value is a float16 one (the kernel then reads half the bytes)."""
    return bool(torch.equal(values.to(torch.float16).float(), values.float()))


def stored_bias(bits, offsets):
    """What the packed layout adds to a 5- or 6-bit weight's values (qlinear.cpp's stored_bias)."""
    return 32 if bits == 6 else 16 if bits == 5 and offsets is None else 0


def five_bits(q, offsets):
    """Whether an int8 weight's values all fit 5 bits: -16..15 without offsets, 0..31 with them."""
    low, high = (0, 31) if offsets is not None else (-16, 15)
    return q.dtype == torch.int8 and q.numel() > 0 and low <= q.min() and q.max() <= high


def six_bits(q):
    """Whether an int8 weight's values all fit 6 bits, -32..31."""
    return q.dtype == torch.int8 and q.numel() > 0 and -32 <= q.min() and q.max() <= 31


def two_level(values, group):
    """values [N, G] (scales or offsets) as int8 multipliers [N, G] times float16 steps [N, K / 256], each
    product exactly the value in float32; None where they are not such (GGUF's K-quants are)."""
    N, G = values.shape
    if STEP_INPUTS % group or (G * group) % STEP_INPUTS:
        return None
    v = values.float().view(N, G * group // STEP_INPUTS, STEP_INPUTS // group)
    largest = v.gather(-1, v.abs().argmax(-1, keepdim=True))
    found = torch.zeros_like(largest, dtype=torch.bool)
    steps, multipliers = torch.zeros_like(largest), torch.zeros_like(v)
    for multiplier in LARGEST_MULTIPLIERS:  # each step of 256 inputs the first that gives every value exactly
        step = largest / multiplier
        m = torch.where(step != 0, v / step, 0.0).round()
        taken = ~found & ((m >= -128) & (m <= 127) & (m * step == v)).all(-1, keepdim=True) \
            & (step.half().float() == step)
        steps, multipliers = torch.where(taken, step, steps), torch.where(taken, m, multipliers)
        found |= taken
    if not found.all():
        return None
    return multipliers.to(torch.int8).view(N, G), steps.view(N, -1)


def takes(in_features, group):
    """Whether the kernel takes a layer of this input width and group size, and is here to."""
    return in_features % BLOCK == 0 and (group == 16 or group % BLOCK == 0) and available()


def rows_of(tokens, qweight, scales, offsets, steps):
    """The int8 weight rows (output columns) `tokens` of a packed weight (int4's values 0..15 as int8), and
    their scales and offsets in float32: q [..., K], scales, offsets [..., G] (a token embedding's lookup)."""
    tiles, blocks, vectors = qweight.shape[:3]
    tile, column = tokens // TILE, tokens % TILE
    # [tile, block, k, c, j] at (tile, c) -> [..., block, k, j]: the inputs in order
    q = qweight.view(tiles, blocks, vectors, TILE, 4)[tile, :, :, column]
    if vectors < 8:  # 4-, 5- or 6-bit (pack): the nibbles, and the top bits, back together less the stored bias
        width = vectors - 4
        extra, q = q, torch.cat([q[..., :4, :] & 0x0F, q[..., :4, :] >> 4], -2).to(torch.int8)
        if width:
            top = torch.stack([(extra[..., 4 + k * width // 8, :] >> k * width % 8) & ((1 << width) - 1)
                               for k in range(8)], -2)
            q = ((q.to(torch.int16) | top << 4) - stored_bias(vectors, offsets)).to(torch.int8)
    q = q.flatten(-3)

    def values(table, which):
        if steps is None:
            return table[tile, :, column].float()
        step = steps[tile, :, which, column].repeat_interleave(table.shape[1] // steps.shape[1], dim=-1)
        return table[tile, :, column].float() * step.float()
    return q, values(scales, 0), None if offsets is None else values(offsets, 1)


def unpack(packed, rows):
    """A packed weight's first `rows` rows in models/quant.py's stored form: for a load these kernels do not serve."""
    weight = packed["packed_weight"]
    q, scales, offsets = rows_of(torch.arange(rows), weight, packed["packed_scales"], packed.get("packed_offsets"),
                                 packed.get("packed_steps"))
    if weight.shape[2] == 4:  # int4: two values a byte, as quant.pack_int4 stores them
        q = q.view(torch.uint8)
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    return {"qweight": q, "scales": scales} | ({} if offsets is None else {"offsets": offsets})


def qlinear(x, qweight, scales, offsets, steps, group):
    """x [M, K] float32 @ the packed weight's transpose -> [M, N padded to tiles] float32."""
    return torch.ops.minispec_native.qlinear(x, qweight, scales, offsets, steps, group)


def float_pack(weight):
    """A float32 weight [N, K] in flinear.cpp's layout: [N / its tile, K, tile], padded with zeros."""
    return torch.ops.minispec_native.flinear_pack(weight.detach())


def float_product(x, packed, bias, features):
    """x [M, K] float32 (contiguous) @ the float_pack'ed weight's transpose + bias -> [M, features]."""
    return torch.ops.minispec_native.flinear(x, packed, bias, features)


def attend(q, k, v, mask, slots, scale):
    """Attention of q [B, H, R, d] float32 over a KV cache k, v [B, H, S, d] with an additive float32 mask
    [B, H, R, P], in kernels.attend_cache's canonical order; slots int64 [B, n, P]: the cache slot of each
    position for query row r's token r % n (a tree's), or None. -> [B, H, R, d] float32."""
    return torch.ops.minispec_native.attend(q, k, v, mask, slots, scale)


def keep(caches, row, slots, length):
    """CachedLM.keep's move in every cache of `caches` (k and v tensors [rows, H, S, d] on the CPU)."""
    torch.ops.minispec_native.keep(caches, row, slots, length)


def llama_layers(stack, x, input_pos, cos, sin, masks, layout, taps):
    """Llama.blocks' layers over x [B, T, D] float32 in one call (layer.cpp), as layers.py's LayerStack lays
    them out, masks by window. -> [the last layer's output, then the state entering each layer in `taps`]."""
    slots = None if layout is None else kernels.key_slots(layout, next(iter(masks.values())).shape[-1])
    return torch.ops.minispec_native.llama_layers(
        x, stack.tensors, stack.caches, stack.numbers, stack.eps, cos, sin, stack.first_cache.first_row, input_pos,
        [masks[w] for w in stack.windows], slots, stack.scale, sorted(taps))


class Native(PyTorch):
    """The models' backend through these kernels where they take the tensors: CPU, float32, no gradients."""

    float_pack, float_product, attend = staticmethod(float_pack), staticmethod(float_product), staticmethod(attend)
    pack_quantized, quantized_product, quantized_rows = staticmethod(pack), staticmethod(qlinear), staticmethod(rows_of)

    def float_kernel(self, dtype):
        return dtype == torch.float32

    def attends(self):
        return True

    def rms_norm(self, x, weight, eps):
        training = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        if torch.compiler.is_compiling() or training or x.dtype != torch.float32 or weight.dtype != torch.float32 \
                or x.device.type != "cpu":
            return None
        # one call, as the one-call layer computes it, where PyTorch's norm is seven operations
        return torch.ops.minispec_native.rms_norm(x, weight, eps)

    def keep(self, caches, row, slots, length):
        if caches[0].is_cpu:
            keep(caches, row, slots, length)
        return caches[0].is_cpu

    def takes_quantized(self, in_features, group, device):
        return device.type == "cpu" and takes(in_features, group)

    def fused_llama(self, model, x):
        """layer.cpp's one call for every layer, where the forward can: eager, float32, on a CPU, with this
        attention kernel, every layer's weights ours, not sharded (the sums across ranks hook the modules)."""
        if torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32 or model.tp is not None \
                or (torch.is_grad_enabled() and x.requires_grad) or not kernels.native_attention():
            return None
        stack = stack_of(model)
        return None if stack is None else functools.partial(llama_layers, stack)

    def in_huge_pages(self, modules):
        return pages.in_huge_pages(modules)

    def to_huge_pages(self, tensors, place):
        return pages.to_huge_pages(tensors, place)


NATIVE = Native()


def choose():
    """This package's backend where its kernels build here, else PyTorch's operations."""
    return NATIVE if available() else backend.PYTORCH


def install(compile=False):
    """Choose the models' backend (at every load; `compile`: the load compiles its model)."""
    if backend.use(choose()) is NATIVE and compile and torch._inductor.config.cpp.vec_isa_ok is None:
        # Inductor checks its vector instructions by building test programs, seconds a process: these
        # kernels, built by the same toolchain, have answered that already.
        torch._inductor.config.cpp.vec_isa_ok = True


backend.offer(choose)  # models made without a load (tests, a script's own) take it at first use
