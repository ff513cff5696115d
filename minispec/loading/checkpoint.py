"""Find a checkpoint (local directory, GGUF file, built-in name or hub id), read its config and safetensors
weights, and build the matching minispec model (its family's models.base.Family, registered in FAMILIES),
quantized at load if asked, or with the quantized weights a checkpoint holds."""

import copy
import dataclasses
import functools
import hashlib
import importlib
import json
import os
import re
import weakref
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from .. import cpus
from ..models import backend
from ..models.base import Family, pack_linears
from ..models.checks import COUNT, check
from ..models.kernels import can_pack
from .tokenizer import ByteLevelBPE, UnsupportedTokenizer, read_chat_template, read_json
from .tokenizer import read_config as read_tokenizer_config
from .weights import (SOURCE_STAMP, CheckpointError, abandoned_partials, file_identity, log, read_config,
                      read_dtypes, read_weights, release_file_pages, release_freed_memory, save_safetensors,
                      weight_files, weights_dir)

# model_type -> the module in minispec/models that reads it, imported on first use
FAMILIES = {"gemma2": "gemma", "gemma3": "gemma", "gemma3_text": "gemma", "gpt2": "gpt2", "llama": "llama",
            "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "t5": "t5"}


def family(model_type) -> Family:
    return importlib.import_module(f"minispec.models.{FAMILIES[model_type]}").FAMILY


def resolve_checkpoint(name_or_path, keep_quantized=False):
    """An existing directory, else what loading.builtin resolves (a .gguf file, a built-in name, a hub id)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    from . import builtin  # conversions and downloads: read only when a load asks for one
    return builtin.resolve(name_or_path, keep_quantized, check=check_checkpoint)


def check_shapes(model, weights, source, stored=None):
    """The checkpoint's tensors (and its quantized weights, `stored`) against the model's."""
    expected = model.state_dict()
    if stored:  # against the float shapes, which the quantized weights take out of `expected`
        from ..models import quant  # only a checkpoint holding quantized weights reads their forms
        for name, parts in stored.items():
            if f"{name}.weight" not in expected:
                raise CheckpointError(f"{source}: unexpected quantized tensor(s) {name}.{', '.join(sorted(parts))}")
            problem = quant.check_stored(parts, expected.pop(f"{name}.weight").shape)
            if problem:
                raise CheckpointError(f"{source}: quantized weight {name}: {problem}")
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{source}: weights lack tensor(s) {', '.join(missing[:5])}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:5])}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(tensor.shape)} in the checkpoint but "
                                  f"the config implies {tuple(expected[name].shape)}")


# The safetensors dtypes of float weights: a cast would turn any other into wrong numbers without a word.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def holds_stored_weights(hf_config, dtypes, convert, config, source):
    """Whether the checkpoint holds minispec's quantized weights; a CheckpointError for any other tensor that is
    not float. The dtypes decide, not config.json's label: the reference saves float tensors labelled "gguf"."""
    quantization = hf_config.get("quantization_config")
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method is None and all(dtype in FLOAT_DTYPES for dtype in dtypes.values()):
        return False
    from ..models import quant  # the stored forms: read only for a checkpoint with other tensors
    ours = method == quant.QUANT_METHOD
    # only the tensors the family's conversion keeps count (the original GPT-2 files hold uint8 attention masks)
    odd = next(((name, dtype) for name, dtype in dtypes.items()
                if dtype not in FLOAT_DTYPES and not (ours and name.rpartition(".")[2] in quant.STORED_KEYS)
                and convert({name: torch.zeros(())}, config)), None)
    if odd and "quantization_config" in hf_config and not ours:
        raise CheckpointError(f"{source}: weights quantized with {method!r}, which minispec does not read; use "
                              "float weights (quantize= quantizes them at load) or a GGUF file")
    if odd:
        raise CheckpointError(f"{source}: tensor {odd[0]} is stored as {odd[1]}; minispec loads float weights "
                              f"({', '.join(FLOAT_DTYPES)})")
    return ours


def check_layer_counts(hf_config, stacks, names):
    """config.json's layer counts (the family's LAYER_STACKS) against the distinct layers the tensors are named
    for, before a config asking for a billion layers takes minutes to build, only to be refused."""
    for key, stack in stacks.items():
        count = check(hf_config, key, COUNT, None)
        layer = re.compile(rf"(?:^|\.){re.escape(stack)}\.(\d+)\.")
        held = len({match[1] for name in names if (match := layer.search(name))})
        if count is not None and count != held:
            raise ValueError(f"{key} is {count} but the weights hold {held} layers")


def check_device(device):
    """torch.device(device), or a one-line ValueError when this machine has no such device."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {str(device)!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {device} does not exist: this machine has {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {device}: MPS (Apple's GPU) is not available on this machine")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device {device}: minispec runs on cpu, cuda or mps")
    return device


# The files that with tokenizer_config.json's settings (but its chat template) make a tokenizer
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model")
# A checked tokenizer by a digest of those and the model type, while a model holds it: a draft's is usually its
# target's, and checking a large vocabulary again costs a second.
TOKENIZERS = weakref.WeakValueDictionary()


def load_tokenizer(directory, model_type=""):
    """The tokenizer of a checkpoint directory (None without tokenizer files), its vocabulary checked once while a
    model holds one alike (read_tokenizer), its chat template its own."""
    directory = Path(directory)
    config = read_tokenizer_config(directory)
    chat_template = read_chat_template(directory, config)
    settings = json.dumps({key: value for key, value in config.items() if key != "chat_template"}, sort_keys=True)
    digest = hashlib.sha256(f"{model_type}\0{settings}".encode())
    for name in VOCABULARY_FILES:
        path = directory / name
        try:
            digest.update(b"\0%s\0%s" % (name.encode(), path.read_bytes() if path.is_file() else b"none"))
        except OSError as error:
            raise CheckpointError(f"cannot read {path}: {error}") from error
    key = digest.digest()
    shared = TOKENIZERS.get(key)
    if shared is None:
        shared = read_tokenizer(directory, model_type, config, chat_template)
        if shared is None:
            return None
        TOKENIZERS[key] = shared
    if shared.chat_template == chat_template:
        return shared
    tokenizer = copy.copy(shared)  # the checked vocabulary and the library's tokenizer shared (read only)
    tokenizer.chat_template = chat_template
    return tokenizer


def read_tokenizer(directory, model_type, config, chat_template):
    """tokenizer.json where it is a byte-level BPE, else the SentencePiece model beside it (`model_type` tells T5's)."""
    sentencepiece_file = next((directory / n for n in VOCABULARY_FILES[1:] if (directory / n).is_file()), None)
    spec_file = directory / "tokenizer.json"
    if spec_file.is_file():
        spec = read_json(spec_file)
        try:
            return ByteLevelBPE(spec, config, chat_template)
        except UnsupportedTokenizer as error:
            if sentencepiece_file is None:
                raise UnsupportedTokenizer(f"{spec_file}: {error}") from error
        except ValueError as error:
            raise ValueError(f"{spec_file}: {error}") from error
        except RecursionError as error:
            raise ValueError(f"{spec_file}: nested too deeply") from error
    if sentencepiece_file is not None:
        t5 = sentencepiece_file.name == "spiece.model" or "T5" in str(config.get("tokenizer_class")) or "t5" in model_type
        from .spm import SentencePieceTokenizer  # SentencePiece checkpoints only
        return SentencePieceTokenizer(sentencepiece_file, config, chat_template, t5)
    return None


class Checkpoint(NamedTuple):
    model: torch.nn.Module  # on the meta device, its special token ids attached
    weights: dict  # {name: tensor} in the model's names, checked against its shapes
    stored: dict  # quantized weights in models.quant's stored form, by layer name
    tokenizer: object  # loading.tokenizer's, or None without tokenizer files
    files: list  # the safetensors files the weights are mapped from: the checkpoint's, or its kept weights'


def read_checkpoint(directory, world=None, dtype=None, keep=False):
    """A checkpoint folder read and checked against its model, built on the meta device. `world`: the ranks of
    a tensor-parallel load; `dtype`: float weights cast as read; `keep`: large ones mapped from kept_weights."""
    hf_config = read_config(directory)
    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise CheckpointError(f"{directory}: unknown model_type {model_type!r}; minispec supports "
                              f"{', '.join(sorted(FAMILIES))}")
    config_class, model_class, convert = family(model_type)
    files = weight_files(directory)
    dtypes = read_dtypes(files)
    try:
        check_layer_counts(hf_config, config_class.LAYER_STACKS, dtypes)
        config = config_class.from_hf(hf_config)
    except KeyError as error:
        raise CheckpointError(f"{directory}/config.json lacks the key {error} for model_type {model_type}") from error
    except ValueError as error:
        raise CheckpointError(f"{directory}/config.json: {error}") from error
    tokenizer = load_tokenizer(directory, model_type)
    rows = config.vocab_size
    # An embedding padded past the tokenizer's ids is cut to them: the model never outputs an id without a
    # token, and models of one tokenizer score the same ids.
    if tokenizer is not None and 0 < tokenizer.n_ids < rows:
        config = dataclasses.replace(config, vocab_size=tokenizer.n_ids)
    if world is not None:
        from ..models import tp  # sharding: read only by a tensor-parallel load
        tp.check_divisible(config, world)  # the same on every rank: each exits with it
    ours = holds_stored_weights(hf_config, dtypes, convert, config, directory)
    try:
        with torch.device("meta"):  # shapes without memory
            model = model_class(config)
    except (RuntimeError, TypeError) as error:  # sizes each below 2^31 whose products overflow torch's sizes
        raise CheckpointError(f"{directory}/config.json: its sizes make tensors too large for torch "
                              f"({str(error).splitlines()[0]})") from error
    attach_special_tokens(model, hf_config, directory)  # before the weights are read: a bad id fails fast
    read = partial(converted_weights, directory, files, convert, config, config_class.LAYER_STACKS)
    if keep and not ours and sum(file.stat().st_size for file in files) >= KEEP_MIN_BYTES:
        weights, files = kept_weights(directory, model_type, dtype, files, read)
    else:
        weights = read(None if ours else dtype)
    stored = {}
    if ours:
        from ..models import quant  # the stored forms, for a checkpoint that holds them
        stored = quant.take_stored(weights)
    if config.vocab_size < rows:
        cut_padding(model, weights, stored, rows)
        model.checkpoint_rows = rows
    check_shapes(model, weights, directory, stored)
    return Checkpoint(model, weights, stored, tokenizer, files)


def converted_weights(directory, files, convert, config, stacks, dtype):
    """The checkpoint's tensors checked, cast to `dtype` and converted by the family (within a layer, so a cast
    before it is exact) a layer at a time, each layer's file pages dropped once its copies are made."""
    weights = read_weights(files)
    check_cast_and_release(weights, directory, dtype, files)
    layer = re.compile(rf"(?:^|\.)({'|'.join(map(re.escape, stacks.values()))})\.(\d+)\.")
    layers = {}
    for name in list(weights):
        match = layer.search(name)
        layers.setdefault(match and match.groups(), {})[name] = weights.pop(name)
    converted = {}
    for key in list(layers):
        try:
            converted.update(convert(layers.pop(key), config))
        except ValueError as error:  # the family's key mapping found tensors it cannot place
            raise CheckpointError(f"{directory}: {error}") from error
        release_file_pages(files)
    return converted


# Products read packed copies, so the converted weights are read once, to pack them: mapped from a kept file,
# they are pages that packing drops, not resident copies. Below this size a second copy on disk is not worth it.
KEEP_MIN_BYTES = 64 << 20


def kept_weights(directory, model_type, dtype, files, read):
    """(weights, the files they map): read(dtype)'s weights kept in a file of the weights folder, written again
    once the checkpoint's files or the family's code change; in memory where that file cannot be written."""
    directory = Path(directory).resolve()
    file, made_from = kept_file(f"{directory}|{dtype}", fingerprint(directory, None, None),
                                [importlib.import_module(f"minispec.models.{FAMILIES[model_type]}")])
    if kept_metadata(file).get("made_from") != made_from:
        weights = read(dtype)
        try:  # save_safetensors makes the folder
            save_safetensors(weights, file, {"made_from": made_from, "directory": str(directory)})
            log(f"kept the converted weights in {file} ({file.stat().st_size / 1e6:.0f} MB), which later loads map "
                "as they are: memory holds the packed copy the products read")
            sweep_kept(file.parent)
        except OSError as error:
            log(f"cannot keep the converted weights in {file} ({error}): they stay in memory")
            return weights, files
        weights.clear()  # the copies: from now on the file's pages
        release_load_memory(files)
    return read_weights([file]), [file]


def kept_int4_draft(model):
    """quant.int4_draft(model) (returning the layers it replaced), its int4 layers kept in a file of the weights
    folder that later loads map rather than quantize again. Written again once the draft's files or the code that
    quantizes and packs them change; not kept for a small draft, or where the kernels do not take them."""
    from .. import native  # the packed layout's writer: its code decides whether a kept file is current
    from ..models import quant
    file, made_from = kept_file(f"{model.directory}|int4 draft", model.fingerprint, (quant, native))
    fingerprint = model.fingerprint
    if kept_metadata(file).get("made_from") != made_from:
        int4 = set(filter(lambda module: isinstance(module, quant.Int4Linear), model.modules()))  # quantized at load
        replaced = quant.int4_draft(model)
        made = {name: module for name, module in model.named_modules()
                if isinstance(module, quant.Int4Linear) and module not in int4}
        tensors = {f"{name}.packed_{key}": getattr(module, key) for name, module in made.items()
                   for key in ("weight", "scales", "offsets", "steps") if getattr(module, key, None) is not None}
        if not made or not all(module.native for module in made.values()) or \
                sum(t.nbytes for t in tensors.values()) < KEEP_MIN_BYTES:
            return replaced
        try:
            save_safetensors(tensors, file, {"made_from": made_from, "directory": str(model.directory)})
            sweep_kept(file.parent)
        except OSError as error:
            log(f"cannot keep the int4 draft in {file} ({error}): it is made again at each load")
            return replaced
        del tensors, made  # from now on the file's pages
    else:
        replaced = []
    layers = []  # (holder, attribute, old layer, int4 layer): every one checked before any is replaced
    for name, parts in quant.take_stored(read_weights([file])).items():
        parent, _, attribute = name.rpartition(".")
        holder = model.get_submodule(parent)
        old = getattr(holder, attribute)  # None: a tied model's own head (int4_draft)
        shape = (model.head.out_features, model.head.in_features) if old is None else (old.out_features,
                                                                                      old.in_features)
        problem = quant.check_stored(parts, shape)
        if problem:  # the file is not this model's after all: made again at the next load
            file.unlink(missing_ok=True)
            raise CheckpointError(f"{file}: {problem}; load the draft again")
        layers.append((holder, attribute, old, quant.Int4Linear(parts, None if old is None else old.bias, shape)))
    for holder, attribute, old, layer in layers:
        setattr(holder, attribute, layer)
        if old is not None and not isinstance(old, quant.Int4Linear):
            replaced.append(old)
    model.fingerprint = fingerprint and f"{fingerprint} int4 draft"
    return replaced


def kept_file(key, source, modules):
    """(the weights folder's file keeping what `key` names, what it is made from: `source` and `modules`' code)."""
    code = b"".join(Path(module.__file__).read_bytes() for module in modules)
    made_from = f"{source}|{hashlib.sha256(code).hexdigest()[:20]}"
    return weights_dir() / "kept" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors", made_from


def kept_metadata(file):
    """What a kept weights file was made from, and for which checkpoint folder; {} for a file missing."""
    try:
        with safe_open(file, "pt") as opened:
            return opened.metadata() or {}
    except Exception:  # missing, or unreadable (safetensors' own error types): made again
        return {}


def sweep_kept(folder):
    """Delete the kept weights of checkpoint folders that are gone, and the partial files of killed writers."""
    gone = [file for file in folder.glob("*.safetensors")
            if (directory := kept_metadata(file).get("directory")) and not Path(directory).is_dir()]
    for file in gone + list(abandoned_partials(folder)):
        with suppress(OSError):
            file.unlink()


def cut_padding(model, weights, stored, rows):
    """The tensors of `rows` rows that the model cut to its tokenizer holds fewer of, as views of their first rows."""
    expected = model.state_dict()
    for name, tensor in weights.items():
        shape = expected[name].shape if name in expected else tensor.shape
        if tensor.dim() and tensor.shape[0] == rows and shape[0] < rows and shape[1:] == tensor.shape[1:]:
            weights[name] = tensor[:shape[0]]
    for name, parts in stored.items():
        if f"{name}.weight" in expected:
            kept = expected[f"{name}.weight"].shape[0]
            stored[name] = {key: part[:kept] if part.shape[0] == rows else part for key, part in parts.items()}


# Bytes of the weight files a pass reads before it drops their pages, lest it hold the whole file resident.
RELEASE_BYTES = 64 << 20


def check_cast_and_release(weights, source, dtype=None, files=()):
    """Every float tensor free of NaN and infinities (which would make every output garbage without an error;
    its minimum or maximum is one if any value is) and cast to `dtype` in place, the files' pages dropped."""
    read = 0
    for name, tensor in weights.items():
        if tensor.is_floating_point() and tensor.numel() and not all(end.isfinite() for end in torch.aminmax(tensor)):
            raise CheckpointError(f"{source}: tensor {name} holds NaN or infinite values")
        if dtype is not None and tensor.is_floating_point():
            weights[name] = tensor.to(dtype)
        read += tensor.nbytes
        if read >= RELEASE_BYTES:
            release_file_pages(files)
            read = 0


def check_checkpoint(directory):
    """A conversion read and checked as load_model reads it, its quantized weights rewritten in the kernels' layout."""
    if read_checkpoint(directory).stored:
        release_freed_memory()  # the fused copies that reading made, before a load makes them again
        from .packed import pack_stored  # quantized checkpoints only
        pack_stored(directory, load_model(directory))
        release_freed_memory()
        read_checkpoint(directory)


@functools.cache
def default_threads():
    """Once a process, at its first load: torch's threads cut to the CPUs other processes left free (cpus.py),
    unless the user chose them (OMP_NUM_THREADS, --threads; torch.set_num_threads after the load)."""
    free = None if cpus.chosen or "OMP_NUM_THREADS" in os.environ else cpus.free_cpus()
    if free is not None and free < torch.get_num_threads():
        log(f"other processes keep some of its CPUs busy: {free} thread{'s' * (free > 1)} (--threads to choose)")
        torch.set_num_threads(free)


def load_model(name_or_path, device="cpu", dtype=None, compile=False, quantize=None, group_size=None, tp=None):
    """A checkpoint loaded into its minispec model, tokenizer and special token ids attached. quantize="int8"
    or "int4" quantizes the weights (int4 in groups of `group_size` columns; a GGUF file keeps its own).
    tp=N: this process is one of N ranks (launched by torchrun) over which the model is sharded."""
    if quantize is not None or group_size is not None:
        from ..models import quant  # read only when a load quantizes
        group_size = quant.DEFAULT_GROUP_SIZE if group_size is None else group_size
        quant.check_settings(quantize, group_size)
    default_threads()
    if os.environ.get("MINISPEC_NATIVE", "1") == "0":  # PyTorch's operations, not minispec's native CPU kernels
        backend.use(backend.PYTORCH)
    else:
        from .. import native  # the layer above models that plugs into models/backend.py
        native.install(compile)
    world = None
    if tp is not None:  # before check_device: NCCL without GPUs gets its own message
        from . import parallel  # sharding: read only by a tensor-parallel load
        world, device = parallel.launch(tp, device)
    device = check_device(device)
    directory = resolve_checkpoint(name_or_path, keep_quantized=quantize is not None)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    # Quantizing takes the weights as stored (rounding each chunk through `dtype`): a cast copy would double memory.
    keep = quantize is None and tp is None and can_pack(dtype, device)  # packed: read once, then dropped
    model, weights, stored, tokenizer, files = read_checkpoint(directory, world, None if quantize else dtype, keep)
    if stored:
        from .packed import unpacked_unless_taken  # quantized checkpoints only
        stored = unpacked_unless_taken(model, stored, device, tp)
    model.load_state_dict(weights, assign=True, strict=not stored)
    del weights  # the model holds them now: quantizing frees each float weight as its layer is done
    mapped = any("packed_weight" in parts for parts in stored.values())  # read from the file every step
    if tp is not None:  # the rank's slices, before quantizing them and before moving to the device
        parallel.join(device).shard(model, stored)
    if quantize or stored:
        from ..models import quant  # read only when a load quantizes
        # the file pages each replaced module read are read no more: dropped as quantizing goes
        layer_done = None if mapped else partial(release_load_memory, files)
        try:
            notes = quant.quantize_model(model, quantize, group_size or quant.DEFAULT_GROUP_SIZE, dtype, stored,
                                         device, layer_done)
        except ValueError as error:  # quantized tensors for a module that takes none (a position table)
            raise CheckpointError(f"{directory}: {error}") from error
        # What stays float (norms, biases) is views of the checkpoint file: copies let the whole file go.
        for parameter in model.parameters():
            parameter.data = parameter.data.to(dtype, copy=True)
        release_freed_memory()
        for note in notes:
            log(f"{name_or_path}: {note}")
    model = model.to(device=device).eval().requires_grad_(False)
    if not mapped:  # each weight's pages come back as packing reads it, and go once it is packed
        release_file_pages(files)
    model = pack_linears(model, None if mapped else partial(release_file_pages, files))
    if not mapped:
        release_file_pages(files)
    model.name = str(name_or_path) if not Path(name_or_path).expanduser().is_dir() else Path(directory).name
    model.fingerprint = fingerprint(directory, quantize, group_size, tp)
    model.directory = Path(directory).resolve()
    model.tokenizer = tokenizer
    return model.compile() if compile else model


def release_load_memory(files):
    release_file_pages(files)
    release_freed_memory()


def fingerprint(directory, quantize, group_size, tp=None):
    """The checkpoint as it is on disk and as it was quantized: what stored costs are kept for (decoding.profiles)."""
    files = sorted(file for file in Path(directory).iterdir() if file.is_file() and file.name != SOURCE_STAMP)
    identities = "|".join(file_identity(file) for file in files)
    sharded = f"|tp{tp}" if tp is not None else ""  # a rank's costs are not a whole model's
    return hashlib.sha256(f"{identities}|{quantize}|{group_size if quantize else ''}{sharded}".encode()).hexdigest()[:20]


def attach_special_tokens(model, hf_config, source):
    """The config's eos, bos and pad ids on the model, once checked against its vocabulary."""
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        value = hf_config.get(key)
        outside = [i for i in (value if isinstance(value, list) else [value]) if i is not None and i >= model.vocab_size]
        if outside:
            raise CheckpointError(f"{source}: {key} {outside[0]} is outside the vocabulary of {model.vocab_size} tokens")
    eos = hf_config.get("eos_token_id")
    model.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    model.bos_token_id = hf_config.get("bos_token_id")
    model.pad_token_id = hf_config.get("pad_token_id")
