"""A quantized model's weights and the KV caches in huge pages (minispec/native/pages.py): buffers over one
mapping, the same numbers and the same tokens, a shared buffer still shared, the mapping alive as long
as its tensors, and nothing moved where huge pages cannot be asked for."""

import gc
import sys

import pytest
import torch
from conftest import make_reference, save_reference
from test_base import packed_modules

import minispec
from minispec import native
from minispec.models import kernels
from minispec.native import pages

# A model's buffers move where the native backend serves it (PyTorch's asks for no huge pages).
native_backend = pytest.mark.skipif(not native.available(), reason="minispec's CPU kernels cannot be built here")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")


@pytest.fixture
def small_pages(monkeypatch):
    """Tiny models hold less than a huge page: move them as if pages were 4 KiB. Returns the mappings
    made, as [start, end) addresses."""
    monkeypatch.setattr(pages, "HUGE_PAGE", 4096)
    made, mapping = [], pages.mmap.mmap

    def recorded(*args, **kwargs):
        region = mapping(*args, **kwargs)
        start = pages.ctypes.addressof(pages.ctypes.c_char.from_buffer(region))
        made.append((start, start + len(region)))
        return region
    monkeypatch.setattr(pages.mmap, "mmap", recorded)
    return made


def inside(tensors, mappings):
    """Whether every tensor's bytes lie in one of the mappings, each [start, end)."""
    tensors = list(tensors)
    return any(all(start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end for tensor in tensors)
               for start, end in mappings)


@native_backend
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_quantized_model_decodes_from_one_mapping_as_before(tmp_path, small_pages, monkeypatch, mode):
    directory = save_reference(make_reference("llama_gqa"), tmp_path / "ckpt")
    moved = minispec.load(directory, quantize=mode)
    assert len(list(moved.buffers())) > 10 and inside(moved.buffers(), small_pages)
    monkeypatch.setattr(pages, "in_huge_pages", lambda modules: 0)
    kept = minispec.load(directory, quantize=mode)
    assert not inside(kept.buffers(), small_pages)
    assert all(torch.equal(a, b) for a, b in zip(moved.state_dict().values(), kept.state_dict().values()))
    prompt = [5, 17, 33, 8, 90, 41]
    one, other = (minispec.generate(m, prompt, max_new_tokens=16, ignore_eos=True) for m in (moved, kept))
    assert one.tokens == other.tokens and len(set(one.tokens)) > 3


@native_backend
def test_a_self_draft_moves_its_quantized_weights(tmp_path, small_pages):
    target = minispec.load(save_reference(make_reference("llama_gqa"), tmp_path / "ckpt"))
    out = minispec.generate(target, [5, 17, 33, 8], draft="int8", max_new_tokens=8, ignore_eos=True)
    assert out.tokens == minispec.generate(target, [5, 17, 33, 8], max_new_tokens=8, ignore_eos=True).tokens
    [copy] = minispec.decoding.drafters.SELF_DRAFTS[target].values()
    quantized = [tensor for name, tensor in copy.named_buffers()  # not the caches decoding made since
                 if name.rsplit(".", 1)[-1] in ("weight", "scales", "offsets", "steps")]
    assert len(quantized) > 10 and inside(quantized, small_pages)


@native_backend
def test_a_moved_model_compiles(tmp_path, small_pages):
    """Each buffer has a storage of its own over the mapping: torch.compile refuses inputs that alias."""
    directory = save_reference(make_reference("llama_gqa"), tmp_path / "ckpt")
    compiled, eager = minispec.load(directory, quantize="int4", compile=True), minispec.load(directory, quantize="int4")
    assert inside(compiled.buffers(), small_pages)
    prompt = [5, 17, 33, 8, 90, 41]
    assert (minispec.generate(compiled, prompt, max_new_tokens=8, ignore_eos=True).tokens
            == minispec.generate(eager, prompt, max_new_tokens=8, ignore_eos=True).tokens)


@native_backend
def test_kv_caches_move_as_they_are_made(tmp_path, small_pages, monkeypatch):
    """A float model's caches too (read every step): moved when ensure_caches makes them, the same tokens."""
    target = minispec.load(save_reference(make_reference("llama_gqa"), tmp_path / "ckpt"))
    out = minispec.generate(target, [5, 17, 33, 8], max_new_tokens=12, ignore_eos=True)
    caches = [tensor for cache in target.kv_caches() for tensor in (cache.k, cache.v)]
    assert len(caches) > 2 and inside(caches, small_pages)
    monkeypatch.setattr(pages, "in_huge_pages", lambda modules: 0)
    target.setup_caches(1, 1)  # the next request makes them anew, in ordinary pages
    assert minispec.generate(target, [5, 17, 33, 8], max_new_tokens=12, ignore_eos=True).tokens == out.tokens
    assert not inside([target.kv_caches()[0].k], small_pages)


class Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Module(), torch.nn.Module()
        table = torch.arange(3000, dtype=torch.float32)
        self.a.register_buffer("table", table)
        self.b.register_buffer("table", table)  # one tensor, two owners (a tied head's)
        self.a.register_buffer("codes", torch.arange(999, dtype=torch.int8))
        self.a.register_buffer("halves", torch.linspace(0, 1, 77, dtype=torch.float16))


def test_shared_buffers_stay_shared_and_the_mapping_lives_with_its_tensors(small_pages):
    module = Shared()
    expected = {name: tensor.clone() for name, tensor in module.state_dict().items()}
    assert pages.in_huge_pages(module.modules()) >= 3000 * 4 + 999 + 77 * 2
    assert module.a.table is module.b.table and inside(module.buffers(), small_pages)
    for name, tensor in module.named_buffers(remove_duplicate=False):
        assert tensor.data_ptr() % pages.ALIGN == 0 and tensor.is_contiguous()
    gc.collect()  # nothing but the tensors holds the mapping now
    assert all(torch.equal(module.state_dict()[name], tensor) for name, tensor in expected.items())
    assert all(module.state_dict()[name].dtype == tensor.dtype for name, tensor in expected.items())


def no_memory(*args, **kwargs):
    raise OSError(12, "Cannot allocate memory")


@pytest.mark.parametrize("why", ["not linux", "refused", "no memory"])
def test_nothing_moves_where_huge_pages_cannot_be_asked_for(small_pages, monkeypatch, why):
    if why == "not linux":
        monkeypatch.setattr(sys, "platform", "darwin")
    elif why == "refused":
        monkeypatch.setattr(pages, "advise_huge_pages", lambda address, length: False)
    else:
        monkeypatch.setattr(pages.mmap, "mmap", no_memory)
    module = Shared()
    before = {name: tensor for name, tensor in module.named_buffers()}
    assert pages.in_huge_pages(module.modules()) == 0
    assert all(tensor is before[name] for name, tensor in module.named_buffers())


def test_a_float_models_packed_weights_move_and_decode_as_before(tmp_path, small_pages, monkeypatch):
    """A float32 model's products read the packed copies of its weights (kernels.pack_together): those
    move into one mapping, the same numbers, the same tokens as copies left in ordinary pages."""
    if not kernels.own_kernel(torch.float32):
        pytest.skip("minispec's float32 kernel is not built here")
    directory = save_reference(make_reference("llama_gqa"), tmp_path / "ckpt")
    moved = minispec.load(directory)
    copies = [kernels.packed_weight(module.weight) for module in packed_modules(moved)]
    assert len(copies) > 5 and inside(copies, small_pages)
    monkeypatch.setattr(pages, "to_huge_pages", lambda tensors, place: 0)
    kept = minispec.load(directory)
    kept_copies = [kernels.packed_weight(module.weight) for module in packed_modules(kept)]
    assert not inside(kept_copies, small_pages) and all(map(torch.equal, copies, kept_copies))
    prompt = [5, 17, 33, 8, 90, 41]
    one, other = (minispec.generate(m, prompt, max_new_tokens=16, ignore_eos=True) for m in (moved, kept))
    assert one.tokens == other.tokens and len(set(one.tokens)) > 3

