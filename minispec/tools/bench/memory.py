"""Memory: the bytes a decode step reads and the bandwidth that achieves, against the device's measured
read bandwidth and a GPU's datasheet peak; a generation's peak tensor memory, which must not grow with it."""

import functools
import itertools
import re
import time

import torch
from torch import nn

from minispec import generate
from minispec.models.base import KVCache
from minispec.models.quant import Int8Embedding

# Datasheet DRAM bandwidth in bytes/s by torch.cuda.get_device_name(): the first match wins, variants first.
PEAK_BANDWIDTH = [
    (r"\bh200\b", 4.8e12), (r"\bh100\b.*pcie", 2.0e12), (r"\bh100\b.*nvl", 3.9e12), (r"\bh100\b", 3.35e12),
    (r"\ba100\b.*80gb.*pcie", 1.935e12), (r"\ba100\b.*80gb", 2.039e12), (r"\ba100\b", 1.555e12),
    (r"\bl40s\b", 0.864e12), (r"\bl4\b", 0.3e12), (r"\ba10g?\b", 0.6e12), (r"\brtx 4090\b", 1.008e12),
    (r"\bv100\b", 0.9e12),
]


def decode_bytes(model, length):
    """Bytes one decode step must read: every decoder weight once as stored (not an encoder's; of an untied
    embedding table the looked-up row), and one cache row's keys and values over `length` positions."""
    weights = 0
    modules = dict(model.named_modules())
    for name, tensor in model.state_dict().items():  # parameters and persistent buffers: the weights
        owner = modules[name.rpartition(".")[0]]
        if model.is_encoder_decoder and name.startswith("encoder"):
            continue
        looked_up = isinstance(owner, (nn.Embedding, Int8Embedding)) and owner is not model.head
        numel = tensor.numel() // owner.num_embeddings if looked_up else tensor.numel()  # a row's share
        weights += numel * tensor.element_size()
    return weights + model.kv_bytes_per_position() * length  # one request: one cache row


BOUND_SLACK = 0.5e9  # bytes a process may hold beyond its weights and KV cache: torch, code, buffers


def resident_bound(model, peak_rss):
    """The process's peak resident bytes against its bound: the model's weights in the dtype they run in
    (each tensor once, however many modules share it; the caches are no state), its KV caches as
    allocated, and BOUND_SLACK."""
    weights = sum(t.nbytes for t in {t.data_ptr(): t for t in model.state_dict().values()}.values())
    kv = sum(t.nbytes for m in model.modules() if isinstance(m, KVCache) for t in m.buffers())
    bound = weights + kv + BOUND_SLACK
    return {"weights_bytes": weights, "kv_bytes": kv, "peak_rss_bytes": peak_rss, "bound_bytes": bound,
            "met": peak_rss <= bound}


def peak_bandwidth(device_name):
    """Datasheet peak bytes/s for a known GPU name, else None."""
    name = device_name.lower()
    return next((peak for pattern, peak in PEAK_BANDWIDTH if re.search(pattern, name)), None)


def timed(fn, device):
    """fn()'s value and seconds, a GPU's queue drained before and after."""
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    value = fn()
    if cuda:
        torch.cuda.synchronize(device)
    return value, time.perf_counter() - start


# The streaming read: a sum over a buffer far larger than any cache (a CPU's last level, a GPU's L2).
READ_BUFFER_BYTES = {"cpu": 1 << 30, "cuda": 4 << 30}
READ_ROUNDS = 5


@functools.cache
def read_bandwidth(device):
    """Bytes/s the device reads at, streaming: the fastest of READ_ROUNDS sums, once per process."""
    device = torch.device(device)
    size = READ_BUFFER_BYTES[device.type]
    if device.type == "cuda":  # a GPU holding a model beside it: a quarter of what is free at most
        size = min(size, torch.cuda.mem_get_info(device)[0] // 4)
    buffer = torch.ones(size // 4, device=device)  # written: pages mapped before timing
    fastest = min(timed(buffer.sum, device)[1] for _ in range(READ_ROUNDS))
    return buffer.numel() * 4 / fastest


def bandwidth(model, position, step_seconds):
    """The bytes the model's decode step reads and the bandwidth it achieves, against the measured limit
    and a known GPU's peak."""
    device_name = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else str(model.device)
    size, limit, peak = decode_bytes(model, position), read_bandwidth(model.device), peak_bandwidth(device_name)
    achieved = size / step_seconds
    return {"device_name": device_name, "bytes_per_step": size, "achieved_bytes_per_s": achieved,
            "limit_bytes_per_s": limit, "fraction_of_limit": achieved / limit,
            "peak_bytes_per_s": peak, "fraction_of_peak": achieved / peak if peak else None}


def tensor_memory(device, fn):
    """(peak, kept): bytes of tensors fn() allocates on `device`, the most alive at once and those alive
    when it returns (freeing an older tensor counts as minus its size). CPU: torch.profiler's allocation
    events, since the resident set would hide a loop that keeps a few kilobytes a step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start, torch.cuda.memory_allocated(device) - start
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the raw events: FunctionEvents fold allocations into their operator, losing their order
    events = [event for event in prof.profiler.kineto_results.events()
              if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU]
    sizes = [event.nbytes() for event in sorted(events, key=lambda event: event.start_ns())]  # a free's is negative
    return max([0, *itertools.accumulate(sizes)]), sum(sizes)


def memory_growth(target, draft, gamma, prompt, long_tokens, short_tokens=16):
    """Tensor memory of a short and a long generation on the same caches: a lean loop's peaks differ only
    by attention over the longer context, and it keeps nothing but what the next request replaces."""
    def run(n):
        return lambda: generate(target, prompt, draft=draft, gamma=gamma, max_new_tokens=n, ignore_eos=True)

    run(long_tokens)()  # allocates the caches (and compiles) once, for both measurements
    (peak_short, kept_short), (peak_long, kept_long) = (tensor_memory(target.device, run(n))
                                                        for n in (short_tokens, long_tokens))
    return {"short_tokens": short_tokens, "long_tokens": long_tokens, "peak_short_bytes": peak_short,
            "peak_long_bytes": peak_long, "kept_short_bytes": kept_short, "kept_long_bytes": kept_long,
            "growth": peak_long / peak_short - 1 if peak_short else None}
