"""A model's weights and KV caches in 2 MiB pages (Linux): moved into one anonymous mapping advised
MADV_HUGEPAGE. Why: a decode step streams every weight once, and with 4 KiB pages each read is also a
walk of the page tables.
"""

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line (and on any element size)
MADV_HUGEPAGE = 14  # linux/mman.h
MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere
TRIM_BYTES = 1 << 20


def advise_huge_pages(address, length):
    """Ask the kernel to back [address, address + length) with huge pages; False where it refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(address, length, MADV_HUGEPAGE) == 0


def in_huge_pages(modules):
    """Move the contiguous CPU buffers of `modules` into one mapping in huge pages (a shared buffer stays
    shared). Returns the bytes moved: 0 off Linux, where refused, or for less than a page."""
    owners = {}  # id(tensor) -> (tensor, [(module, name), ...])
    for module in modules:
        for name, tensor in module._buffers.items():
            if tensor is not None and tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.numel():
                owners.setdefault(id(tensor), (tensor, []))[1].append((module, name))
    tensors, places = [tensor for tensor, _ in owners.values()], [places for _, places in owners.values()]
    owners.clear()

    def place(i, moved):
        for module, name in places[i]:
            module._buffers[name] = moved
    return to_huge_pages(tensors, place)


def to_huge_pages(tensors, place):
    """Copy contiguous CPU `tensors` into one mapping in huge pages, handing each copy to place(i, copy),
    the list's entries dropped as they are copied. Returns the bytes moved, as in_huge_pages."""
    if not sys.platform.startswith("linux"):
        return 0
    sizes = [-(-tensor.nbytes // ALIGN) * ALIGN for tensor in tensors]
    total = sum(sizes)
    if total < HUGE_PAGE:
        return 0
    try:
        region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # no address space or memory for a second copy (a limit): the tensors stay as they are
        return 0
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    start = -address % HUGE_PAGE
    if not advise_huge_pages(address + start, total):
        return 0
    offset = start
    for i, size in enumerate(sizes):
        tensor, tensors[i] = tensors[i], None  # nothing here holds it once its place lets go
        # A storage of its own over its part, not a view of one tensor: torch.compile refuses aliased inputs.
        moved = torch.frombuffer(region, dtype=tensor.dtype, count=tensor.numel(), offset=offset).view(tensor.shape)
        moved.copy_(tensor)  # pages are taken as they are first written: huge ones, as advised
        place(i, moved)
        del tensor  # freed now, unless something else holds it: a load's peak grows by a tensor, not a model
        if size >= TRIM_BYTES and MALLOC_TRIM is not None:
            MALLOC_TRIM(0)  # glibc keeps freed heap memory: a second copy of the model
        offset += size
    return total
