"""A load's memory: the checkpoint file is not held resident beside the copies a load makes of it, a cast
comes before the fusions that copy, quantizing frees each float weight as it goes, and weights that run
packed are pages of a file that packing drops."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import weakref

from pathlib import Path

import pytest
import torch

from minispec.loading import checkpoint
from minispec.loading.checkpoint import load_model
from minispec.loading import weights
from minispec.loading.weights import save_safetensors
from minispec.models import kernels, quant

LAYERS, DIM, HIDDEN, VOCAB = 4, 256, 512, 1024
LAYER_BYTES = (4 * DIM * DIM + 3 * DIM * HIDDEN) * 4  # a float32 layer's projections: 2.5 MiB


@pytest.fixture
def llama_dir(tmp_path):
    """A float32 Llama checkpoint of a few MiB a layer (Hugging Face names: q/k/v and gate/up apart, which a
    load fuses), no tokenizer."""
    config = {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": DIM, "intermediate_size": HIDDEN,
              "num_hidden_layers": LAYERS, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 64, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"model.embed_tokens.weight": (VOCAB, DIM), "model.norm.weight": (DIM,), "lm_head.weight": (VOCAB, DIM)}
    for i in range(LAYERS):
        layer = f"model.layers.{i}"
        shapes.update({f"{layer}.self_attn.{p}_proj.weight": (DIM, DIM) for p in "qkvo"})
        shapes.update({f"{layer}.mlp.{p}_proj.weight": (HIDDEN, DIM) for p in ("gate", "up")})
        shapes.update({f"{layer}.mlp.down_proj.weight": (DIM, HIDDEN), f"{layer}.input_layernorm.weight": (DIM,),
                       f"{layer}.post_attention_layernorm.weight": (DIM,)})
    generator = torch.Generator().manual_seed(0)
    save_safetensors({name: torch.randn(shape, generator=generator) * 0.05 for name, shape in shapes.items()},
                     tmp_path / "model.safetensors")
    return tmp_path


def resident_bytes(file):
    """This process's resident bytes of the mappings of `file` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.split()[-1] == str(file.resolve())
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def mapped_file(tensor):
    """The file whose mapping holds the tensor's memory (/proc/self/maps), or None: anonymous memory."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            start, end = (int(end, 16) for end in fields[0].split("-"))
            if start <= tensor.data_ptr() < end:
                return Path(fields[5]) if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def watch_conversion(monkeypatch, file):
    """[(resident bytes of `file`, {dtypes handed}) at each call of the Llama family's conversion]."""
    family, seen = checkpoint.family("llama"), []

    def convert(weights, config):
        seen.append((resident_bytes(file), {tensor.dtype for tensor in weights.values()}))
        return family.convert(weights, config)

    monkeypatch.setattr(checkpoint, "family", lambda model_type: family._replace(convert=convert))
    return seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
def test_a_load_holds_at_most_a_layer_of_the_file_resident(llama_dir, monkeypatch):
    """Checking every tensor, then fusing every layer, with all of the file's pages kept resident, held the
    whole file beside the fused copies: the pages go every RELEASE_BYTES of the check and after each layer."""
    file = llama_dir / "model.safetensors"
    seen = watch_conversion(monkeypatch, file)
    monkeypatch.setattr(checkpoint, "RELEASE_BYTES", LAYER_BYTES)
    assert file.stat().st_size > 4 * LAYER_BYTES
    checkpoint.read_checkpoint(llama_dir)
    assert len(seen) > LAYERS  # a conversion a layer
    assert max(resident for resident, _ in seen) <= LAYER_BYTES
    assert resident_bytes(file) <= LAYER_BYTES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_are_cast_before_the_fusions_copy_them_and_exactly(llama_dir, monkeypatch, dtype):
    """A float32 copy of every fused weight, then its cast, held both at once; casting first gives the same
    numbers."""
    full = {name: tensor.to(dtype) for name, tensor in load_model(llama_dir).state_dict().items()}
    seen = watch_conversion(monkeypatch, llama_dir / "model.safetensors")
    cast = load_model(llama_dir, dtype=dtype).state_dict()
    assert seen and all(dtypes == {dtype} for _, dtypes in seen)
    assert cast.keys() == full.keys() and all(torch.equal(cast[name], full[name]) for name in full)


def test_quantizing_frees_each_float_weight_as_it_goes(llama_dir):
    """Each replaced float weight is freed once its module is done, and the token embedding and the head
    come last, after every layer's weights have gone."""
    model = load_model(llama_dir)
    weights = {name: weakref.ref(module.weight) for name, module in model.named_modules()
               if isinstance(module, (torch.nn.Linear, torch.nn.Embedding))}
    alive = []  # the names of the float weights alive at each call of layer_done
    quant.quantize_model(model, "int8",
                         layer_done=lambda: alive.append({name for name, ref in weights.items() if ref() is not None}))
    assert alive[-1] <= {"output"}  # the module at hand, the last
    embedding_gone = next(names for names in alive if "tok_embeddings" not in names)
    assert embedding_gone <= {"output"}


def forward(model):
    model.setup_caches(1, 16)
    return model.prefill(torch.arange(1, 9)[None])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps: Linux")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_are_pages_of_a_kept_file_that_packing_drops(llama_dir, tmp_path, monkeypatch, dtype):
    """The copies a load made (fused, cast) stayed resident beside the packed copies that every product reads:
    kept in a file as converted, the weights are file pages, each dropped once packed. The same numbers;
    the file is read again until the checkpoint changes, and goes once its checkpoint has gone."""
    if not kernels.can_pack(dtype, torch.device("cpu")):
        pytest.skip(f"no packed {dtype} products on this CPU")
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    in_memory = load_model(llama_dir, dtype=dtype)  # the checkpoint's few MiB: below KEEP_MIN_BYTES
    assert all(mapped_file(tensor) != tmp_path / "weights" for tensor in in_memory.state_dict().values())
    monkeypatch.setattr(checkpoint, "KEEP_MIN_BYTES", 0)
    packing, pack = [], kernels.pack
    monkeypatch.setattr(kernels, "pack", lambda weight, *rest: packing.append(resident_bytes(
        mapped_file(weight))) or pack(weight, *rest))
    read, read_weights = [], checkpoint.read_weights
    monkeypatch.setattr(checkpoint, "read_weights", lambda files: read.append(files) or read_weights(files))
    for made in (True, False):
        read.clear(), packing.clear()
        model = load_model(llama_dir, dtype=dtype)
        files = {mapped_file(tensor) for tensor in model.state_dict().values()}
        assert len(files) == 1 and files.pop().parent == tmp_path / "weights" / "kept"
        kept = mapped_file(model.output.weight)
        assert read == ([[llama_dir / "model.safetensors"]] if made else []) + [[kept]]
        assert len(packing) >= 4 * LAYERS + 1 and max(packing) == 0  # each weight's pages gone before the next
        assert resident_bytes(kept) == 0
        assert torch.equal(forward(model), forward(in_memory))
        assert all(torch.equal(t, in_memory.state_dict()[name]) for name, t in model.state_dict().items())
    other = shutil.copytree(llama_dir, tmp_path / "copy", ignore=shutil.ignore_patterns("weights"))
    load_model(other, dtype=dtype)
    assert len(list(kept.parent.iterdir())) == 2
    shutil.rmtree(other)  # gone: its kept weights go at the next keeping
    os.utime(llama_dir / "model.safetensors", ns=(0, 0))  # the checkpoint changed: converted and kept again
    read.clear()
    load_model(llama_dir, dtype=dtype)
    assert read == [[llama_dir / "model.safetensors"]] + [[kept]]
    assert list(kept.parent.iterdir()) == [kept]


def test_weights_stay_in_memory_where_the_weights_folder_cannot_keep_them(llama_dir, tmp_path, monkeypatch, capfd):
    """A weights folder that cannot be written (here a file) costs the memory kept weights save, not the load."""
    (tmp_path / "weights").write_text("")
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setattr(checkpoint, "KEEP_MIN_BYTES", 0)
    model = load_model(llama_dir)
    assert "cannot keep the converted weights" in capfd.readouterr().err
    assert not list(tmp_path.glob("**/*.partial"))
    stored = checkpoint.read_weights([llama_dir / "model.safetensors"])
    assert torch.equal(model.output.weight, stored["lm_head.weight"])


def test_an_int4_draft_keeps_only_the_layers_it_requantized(llama_dir, tmp_path, monkeypatch):
    """A float checkpoint loaded int4 as a draft: its layers are quantized from the file at each load as a
    target's are; only the head int4_draft made is kept, and a later load maps it (same logits)."""
    from minispec.loaders import load_draft
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setattr(checkpoint, "KEEP_MIN_BYTES", 0)
    target = load_model(llama_dir, quantize="int8")
    first = load_draft(str(llama_dir), target, draft_quantize="int4")
    if not first.head.native:
        pytest.skip("the native kernels' layout is what a kept draft holds")
    [kept] = (tmp_path / "weights" / "kept").glob("*.safetensors")  # quantized loads keep no float weights
    assert {name.rpartition(".")[0] for name in checkpoint.read_weights([kept])} == {"output"}
    again = load_draft(str(llama_dir), target, draft_quantize="int4")
    tokens = torch.tensor([[5, 17, 33, 8]])
    first.setup_caches(1, 16), again.setup_caches(1, 16)
    assert torch.equal(first.prefill(tokens), again.prefill(tokens))


def test_an_int4_draft_stays_in_memory_where_the_weights_folder_cannot_keep_it(llama_dir, tmp_path, monkeypatch,
                                                                                capfd):
    """A weights folder that cannot be written costs the int4 draft's requantizing at each load, not the load."""
    from minispec.loaders import load_draft
    (tmp_path / "weights").write_text("")
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path / "weights"))
    monkeypatch.setattr(checkpoint, "KEEP_MIN_BYTES", 0)
    target = load_model(llama_dir, quantize="int8")
    draft = load_draft(str(llama_dir), target, draft_quantize="int4")
    assert isinstance(draft.head, quant.Int4Linear) and draft.fingerprint.endswith("int4 draft")
    assert ("cannot keep the int4 draft" in capfd.readouterr().err) == draft.head.native
    assert not list(tmp_path.glob("**/*.partial"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps: Linux")
def test_a_replaced_modules_file_pages_go_and_anonymous_memory_is_never_dropped(tmp_path):
    """release_tensor_pages drops the resident pages of tensors mapped from a file (they read back the same,
    from the page cache) and leaves a tensor in anonymous memory as it is: dropping its pages would zero it."""
    file = tmp_path / "weights.safetensors"
    save_safetensors({"mapped": torch.arange(1 << 20, dtype=torch.float32)}, file)
    mapped = torch.from_file(str(file), shared=True, size=file.stat().st_size, dtype=torch.uint8)
    anonymous = torch.arange(1 << 20, dtype=torch.float32)
    expected_mapped, expected_anonymous = mapped.clone(), anonymous.clone()
    assert mapped_file(mapped) == file.resolve() and mapped_file(anonymous) is None
    assert resident_bytes(file) >= file.stat().st_size - 4096  # read in full by the clone
    weights.release_tensor_pages([mapped, anonymous])
    assert resident_bytes(file) <= 4096  # at most the page it shares with the header
    assert torch.equal(anonymous, expected_anonymous) and torch.equal(mapped, expected_mapped)


def test_what_a_killed_writer_left_of_a_kept_file_goes_at_the_next_keeping(tmp_path):
    """A kept file is written whole or not at all, but a writer killed (SIGKILL, out of memory) cannot remove its
    partial file, the size of the model's weights: a keeping removes those whose process is gone, and no other."""
    folder = tmp_path / "kept"
    script = ("import sys, time; from pathlib import Path; from minispec.loading.weights import write_whole\n"
              "write_whole(Path(sys.argv[1]), lambda p: (p.write_bytes(b'x'), time.sleep(60)))")
    writer = subprocess.Popen([sys.executable, "-c", script, str(folder / "a.safetensors")])
    deadline = time.monotonic() + 60
    while not list(folder.glob("*.partial")) and time.monotonic() < deadline and writer.poll() is None:
        time.sleep(0.05)
    writer.kill()
    writer.wait()
    [left] = folder.glob("*.partial")
    writing = folder / f"b.safetensors.{os.getpid()}.1.partial"  # this process's: still being written
    other = folder / "notes.partial"
    writing.write_bytes(b"x"), other.write_bytes(b"x")
    checkpoint.sweep_kept(folder)
    assert not left.exists() and writing.exists() and other.exists()
