"""Quantized checkpoints in the native kernels' layout: a conversion rewritten once in it (pack_stored),
so that a load maps it from the file as it is, and unpacked again where the kernels do not take it."""
from pathlib import Path

from ..models import backend
from .weights import save_safetensors


def pack_stored(directory, model):
    """Rewrite a checkpoint's quantized weights in the kernels' layout (models.quant's packed form): packing them
    at every load took most of its time, and the stored form's float32 scales made the file larger."""
    if any(hasattr(module, "native") and not module.native for module in model.modules()):
        return  # no kernels here, or a layer they do not take: PyTorch's layout, which no load reads from a file
    tensors = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        tensors.update(module.named_parameters(prefix=name, recurse=False))
        for key, tensor in module._buffers.items():
            if tensor is not None and key not in module._non_persistent_buffers_set:
                tensors[prefix + ("packed_" if getattr(module, "native", False) else "") + key] = tensor
    save_safetensors(tensors, Path(directory) / "model.safetensors", metadata={"format": "pt"})


def unpacked_unless_taken(model, stored, device, tp):
    """The quantized weights, those in the kernels' layout unpacked where these kernels do not take them as they are."""
    shapes = {name: model.get_submodule(name).weight.shape for name in stored}
    if all("packed_weight" not in parts or tp is None and backend.current().takes_quantized(
            shapes[name][1], shapes[name][1] // parts["packed_scales"].shape[1], device)
           for name, parts in stored.items()):
        return stored
    from .. import native  # the layout's reader: pure torch, also where the kernels do not build
    return {name: native.unpack(parts, shapes[name][0]) if "packed_weight" in parts else parts
            for name, parts in stored.items()}
