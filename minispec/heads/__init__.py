"""Draft heads: small trained modules on the target's own hidden states that guess for it. `load_draft_head`
reads a head's folder, as its authors publish it or as `python -m minispec.tools.train_heads` writes it."""

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..api import available_memory
from ..loading.checkpoint import check_shapes, cut_padding
from ..loading.weights import (CheckpointError, file_identity, read_config, read_weights, save_safetensors,
                               weight_files, write_whole)
from ..models import quant
from ..models.base import CachedLM, pack_linears
from ..models.checks import COUNT, check
from . import eagle, eagle3, medusa

KINDS = {"eagle": eagle, "eagle3": eagle3, "medusa": medusa}
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt")


def is_head_dir(path):
    """Whether `path` is a draft head's folder rather than a model checkpoint."""
    directory = Path(path).expanduser()
    try:
        hf = read_config(directory)
    except (OSError, ValueError):
        return False  # the checkpoint loader says what is wrong with it
    if "minispec_head" in hf or "medusa_num_heads" in hf:
        return True
    # EAGLE's authors publish a one-layer Llama config beside weights with fc and no tokenizer; pickled
    # weights are not read here, so such a folder counts as a head (whose loader says how to convert them)
    if hf.get("num_hidden_layers") != 1 or any(directory.glob("tokenizer*")):
        return False
    files = sorted(directory.glob("*.safetensors"))
    try:
        return not files or any(name.endswith("fc.weight") for f in files for name in safe_open(f, "pt").keys())
    except (OSError, SafetensorError):
        return False  # the checkpoint loader says what is wrong with it


def kind_of(hf, directory):
    """"medusa", "eagle" or "eagle3", from config.json (minispec's own field, else the published configs')."""
    kind = hf.get("minispec_head")
    if kind is None:
        eagle3_config = "draft_vocab_size" in hf or "eagle3" in str(hf.get("architectures")).lower()
        kind = "medusa" if "medusa_num_heads" in hf else "eagle3" if eagle3_config else "eagle"
    if kind not in KINDS:
        raise CheckpointError(f"{directory}/config.json: unknown head kind {kind!r} (minispec knows "
                              f"{', '.join(KINDS)})")
    return kind


def check_size(kind, hf, target):
    """A ValueError naming config.json's fields, before building, when their head needs more memory than is free."""
    dim, vocab, size = target.hidden_size, target.vocab_size, target.dtype.itemsize
    if kind == "medusa":
        n_heads, n_layers = medusa.config_from_hf(hf)
        need, fields = n_heads * (n_layers * (dim * dim + dim) + dim * vocab) * size, "medusa_num_heads, medusa_num_layers"
    else:  # an EAGLE head's layers, each about its attention (4 dim x dim) and MLP (3 dim x intermediate)
        n_layers, wide = check(hf, "num_hidden_layers", COUNT, 1), check(hf, "hidden_size", COUNT, dim)
        layer = 4 * wide * wide + 3 * wide * check(hf, "intermediate_size", COUNT, 4 * wide)
        need, fields = n_layers * layer * size, "num_hidden_layers, hidden_size, intermediate_size"
    free = available_memory(target.device)
    if free is not None and need > free:
        raise ValueError(f"{fields} ask for a head of {need / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB "
                         "free")


def load_draft_head(path, target, quantize="auto"):
    """The draft head in folder `path` for `target`. quantize, for an EAGLE head: "int8", "int4", None (the
    target's dtype), or "auto": int8 on a CPU or beside a quantized target."""
    if quantize != "auto":
        quant.check_settings(quantize, quant.DEFAULT_GROUP_SIZE)
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise CheckpointError(f"{path}: not a directory (a draft head is a folder with config.json and weights)")
    hf = read_config(directory)
    if hf.get("vocab_size", 0) == target.checkpoint_rows:  # saved for the target's rows: cut as the target was
        hf = {**hf, "vocab_size": target.vocab_size}
    kind = kind_of(hf, directory)
    if not any(directory.glob("*.safetensors")):
        pickles = [file.name for pattern in PICKLES for file in directory.glob(pattern)]
        if pickles:
            raise CheckpointError(
                f"{directory}: {pickles[0]} is a pickle file, which can run code when loaded; minispec reads "
                "safetensors only. Convert it once where you trust it: python -c \"import torch, safetensors.torch "
                f"as s; s.save_file(torch.load('{pickles[0]}'), 'model.safetensors')\"")
    try:
        check_size(kind, hf, target)
        with torch.device("meta"):  # shapes only: the weights are assigned as they are read
            head = KINDS[kind].build(hf, target)
    except (ValueError, KeyError) as error:
        raise CheckpointError(f"{directory}/config.json: {error}") from error
    if quantize == "auto":
        quantize = "int8" if kind != "medusa" and (target.device.type == "cpu" or target.quantization is not None) else None
    elif quantize is not None and kind == "medusa":
        raise ValueError(f"{directory}: a Medusa head is not quantized (its heads are the target's output head)")
    load_weights(head, directory, assign=True)
    if kind != "medusa":
        eagle.check_draft_vocab(head, directory)
    head = head.to(target.device).eval().requires_grad_(False)
    if isinstance(head, CachedLM):  # an EAGLE head
        if quantize is not None:
            quant.quantize_model(head, quantize, dtype=head.dtype)
        pack_linears(head)  # packed products for what stays float: row-invariant, and the one-call layer's
    identities = "|".join(file_identity(f) for f in sorted(directory.iterdir()) if f.is_file())
    # its quantization too: an int8 head's stored costs are not a float one's (decoding/profiles.py)
    head.fingerprint = hashlib.sha256(f"{identities}|{target.fingerprint}|{quantize}".encode()).hexdigest()[:20]
    head.name = directory.name
    return head


def load_weights(head, directory, assign=False):
    """The folder's weights into `head` in its target's dtype; `assign`: take the tensors themselves."""
    weights = KINDS[head.kind].convert_weights(read_weights(weight_files(directory)), head)
    if head.target.checkpoint_rows:
        cut_padding(head, weights, {}, head.target.checkpoint_rows)
    check_shapes(head, weights, directory)
    head.load_state_dict({k: v.to(head.target.dtype) if v.is_floating_point() else v for k, v in weights.items()},
                         assign=assign)


def save_draft_head(head, hf, directory):
    """Write a head as load_draft_head reads it: config.json (`hf`) and model.safetensors, published names."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: (tensor.detach().float() if tensor.is_floating_point() else tensor).contiguous()
               for name, tensor in KINDS[head.kind].published(head).items()}
    save_safetensors(tensors, directory / "model.safetensors", sync=True)
    config = json.dumps({**hf, "minispec_head": head.kind}, indent=2) + "\n"
    write_whole(directory / "config.json", lambda file: file.write_text(config), sync=True)
