"""A quantized model's weights in 2 MiB pages (Linux): its buffers moved into one anonymous mapping that
the kernel is asked to back with transparent huge pages (madvise(MADV_HUGEPAGE), which most
distributions' default "madvise" setting honours only where asked).

Why: a decode step streams every weight once, and with 4 KiB pages each 4 KiB read is also a walk of
the page tables. PyTorch allocates each buffer apart, mostly in ordinary pages. SmolLM2's int4 step
(~100 MB of packed weights) took 11-16% less time with its buffers in huge pages, and 5-11% less again
at 600-3000 cached positions with its KV caches there too; a float32 model's parameters gained nothing
(its products read oneDNN's packed copies of them). Measured in docs/performance.md, "Q5_x in 5 bits,
weights in huge pages".
"""

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line (and on any element size)
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(address, length):
    """Ask the kernel to back [address, address + length) with huge pages; False where it refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0


def in_huge_pages(modules):
    """Move the contiguous CPU buffers of `modules` (a model's, or its KV caches) into one mapping in huge
    pages, each over a part of it, the same numbers in the same shapes; a buffer two modules share stays
    shared. Returns the bytes moved: 0 off Linux, where the kernel refuses, or where there is less than
    a page to move."""
    if not sys.platform.startswith("linux"):
        return 0
    owners = {}  # id(tensor) -> (tensor, [(module, name), ...])
    for module in modules:
        for name, tensor in module._buffers.items():
            if tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.numel():
                owners.setdefault(id(tensor), (tensor, []))[1].append((module, name))
    sizes = [-(-tensor.nbytes // ALIGN) * ALIGN for tensor, _ in owners.values()]
    total = sum(sizes)
    if total < HUGE_PAGE:
        return 0
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space or memory for a second copy (a limit): the buffers stay as they are
        return 0
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -address % HUGE_PAGE
    if not advise_huge_pages(address + start, total):
        return 0
    offset, waiting = start, list(owners.values())
    owners.clear()
    for i, size in enumerate(sizes):
        (tensor, places), waiting[i] = waiting[i], None  # nothing here holds it once its owners let go
        # A storage of its own over its part of the mapping (each keeps the mapping alive), not a view
        # of one tensor: torch.compile refuses a graph whose inputs alias one another.
        moved = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=offset).view(tensor.shape)
        moved.copy_(tensor)  # pages are taken as they are first written: huge ones, as advised
        for module, name in places:
            module._buffers[name] = moved
        del tensor  # freed now, unless something else holds it: a load's peak grows by a buffer, not a model
        offset += size
    return total
