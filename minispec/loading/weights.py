"""Checkpoint files, the bottom of the loading layer: a directory's config.json and safetensors weights,
safetensors files written, and the weights folder that conversions and stored costs are kept in."""

import ctypes
import hashlib
import json
import mmap
import os
import struct
import sys
import threading
from contextlib import contextmanager, suppress
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..models.checks import INDEX, TABLE, TOKEN_IDS, check
from ..settings import DTYPE_NAMES


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched to a model; the message says why."""


def weights_dir():
    if os.environ.get("MINISPEC_WEIGHTS"):
        return Path(os.environ["MINISPEC_WEIGHTS"]).expanduser()
    root = Path(__file__).resolve().parents[2]  # minispec/loading/weights.py -> the checkout
    if (root / "weights").is_dir() and (root / "pyproject.toml").is_file():  # a checkout
        return root / "weights"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "minispec"


def log(message):
    print(f"minispec: {message}", file=sys.stderr, flush=True)


def file_identity(path):
    """A short hash of a file's absolute path, size and mtime, which a rewrite changes (unless of the same both)."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]


# The --dtype names the command lines accept.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}


def read_json(file):
    """A JSON file holding an object, as a dict: a list where its keys should be would fail later with a
    traceback. RecursionError: JSON nested thousands deep; ValueError: also invalid UTF-8."""
    try:
        value = json.loads(Path(file).read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"cannot read {file}: {error}") from error
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error
    try:
        return TABLE("its top level", value)
    except ValueError as error:
        raise CheckpointError(f"{file}: {error}") from None


def read_config(directory):
    """config.json, with generation_config.json's token ids in place of its own. The ids are checked to
    be ids here, where the file they come from is known; load_model checks them against the vocabulary."""
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    config = read_config_file(config_file)
    generation_file = Path(directory) / "generation_config.json"
    if generation_file.is_file():  # eos/bos ids there override the model config's, as in the reference
        generation = read_config_file(generation_file)
        config.update({k: v for k, v in generation.items() if k.endswith("token_id") and v is not None})
    return config


def read_config_file(file):
    """A config file's JSON, the token ids minispec reads from it checked to be ids."""
    config = read_json(file)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        try:  # eos may be a list: generation stops at any of them
            check(config, key, TOKEN_IDS if key == "eos_token_id" else INDEX, None)
        except ValueError as error:
            raise CheckpointError(f"{file}: {error}") from None
    return config


def weight_files(directory):
    """The safetensors files of a checkpoint: model.safetensors, or the shards listed in its index."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        # a path elsewhere ("../other/x", "/etc/shadow") would read, or probe for, files not the checkpoint's
        outside = [shard for shard in shards if Path(shard).name != shard or shard in (".", "..")]
        if outside:
            raise CheckpointError(f"{index} names a shard outside its folder: {outside[0]!r}")
        files = [directory / shard for shard in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors weights")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} listed in {index.name} is missing from {directory}")
    return files


@contextmanager
def reading(file):
    """safetensors' errors for a malformed file (truncated, a bad header...) as one CheckpointError naming it."""
    try:
        yield
    except Exception as error:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"cannot read weights from {file}: {error}") from error


def read_dtypes(files):
    """{tensor name: safetensors dtype name} from the files' headers alone, before any tensor is read."""
    dtypes = {}
    for file in files:
        with reading(file), safe_open(file, "pt") as opened:
            header = {name: opened.get_slice(name).get_dtype() for name in opened.keys()}
        repeated = sorted(header.keys() & dtypes.keys())
        if repeated:  # which copy would load depends on the order the files are read in
            raise CheckpointError(f"tensor {repeated[0]} of {file} is also in another shard")
        dtypes.update(header)
    return dtypes


def read_weights(files):
    weights = {}
    for file in files:
        with reading(file):
            weights.update(load_file(file))
    return weights


MADV_DONTNEED = 4  # linux/mman.h
SOURCE_STAMP = "source-stamp.json"  # in a GGUF file's conversion: the file's stamp when last found its own


def release_file_pages(files):
    """Drop this process's resident pages of the files' mappings: what a load copied it reads no more, and a
    page still read comes back from the page cache. Linux only; elsewhere nothing happens."""
    names = {str(Path(file).resolve()) for file in files}
    drop_pages(lambda path, start, end: [(start, end)] if path in names else [])


def release_tensor_pages(tensors):
    """Drop the resident pages of tensors mapped from a file (what a replaced module read): as
    release_file_pages, for the whole pages inside each tensor. Memory not mapped from a file is left alone."""
    spans = [(t.data_ptr(), t.data_ptr() + t.untyped_storage().nbytes()) for t in tensors]

    def inside(path, start, end):
        if not path.startswith("/"):  # anonymous: dropping its pages would zero them
            return []
        page = mmap.PAGESIZE
        overlaps = [(max(start, -(-low // page) * page), min(end, high // page * page)) for low, high in spans]
        return [(low, high) for low, high in overlaps if low < high]

    drop_pages(inside)


def drop_pages(spans_of):
    """madvise(MADV_DONTNEED) the spans that spans_of(path, start, end) gives for each mapping (Linux only)."""
    try:
        with open("/proc/self/maps") as maps:
            mappings = [line.split() for line in maps]
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for fields in mappings:
        start, end = (int(x, 16) for x in fields[0].split("-"))
        for low, high in spans_of(fields[-1] if len(fields) > 5 else "", start, end):
            libc.madvise(low, high - low, MADV_DONTNEED)


def release_freed_memory():
    """Hand freed heap memory back to the system: glibc keeps it for reuse, and the small tensors quantizing
    leaves between freed float temporaries would keep it resident. Other C libraries: nothing to do."""
    with suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


# torch dtype -> the safetensors header's name for it
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


ALIGN = 64  # bytes of a cache line


PARTIAL = ".partial"  # write_whole's files: <name>.<process id>.<thread id>.partial


def abandoned_partials(folder):
    """write_whole's partial files in `folder` whose writing process was killed before it could remove them."""
    for partial in Path(folder).glob(f"*.*.*{PARTIAL}"):
        with suppress(ValueError):
            if not running(int(partial.name.split(".")[-3])):
                yield partial


def running(pid):
    """Whether process `pid` exists (another user's too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return pid > 0


def write_whole(file, write, sync=False):
    """write(path) into a partial file of the writing thread's own beside `file` (writers may race), then renamed
    over it (`sync`: once on the disk): never half a file under its name, nothing left of it when write fails."""
    Path(file).parent.mkdir(parents=True, exist_ok=True)
    partial = Path(file).with_name(f"{Path(file).name}.{os.getpid()}.{threading.get_ident()}{PARTIAL}")
    try:
        write(partial)
        if sync:
            with open(partial, "rb+") as written:
                os.fsync(written.fileno())
        os.replace(partial, file)
    finally:  # what an error or Ctrl-C left of it (once renamed there is none)
        with suppress(OSError):
            partial.unlink()


def save_safetensors(tensors, file, metadata=None, sync=False):
    """Write {name: tensor} as a safetensors file, one tensor at a time from its own memory, whole (write_whole)
    or not at all. The header is padded, and tensors of whole cache lines come first, so that a load mapping
    the file gets them on cache lines, as the kernels read them best."""
    if sys.byteorder != "little":  # the format is little-endian; torch's memory here would not be
        raise OSError("writing safetensors files needs a little-endian machine")
    tensors = dict(sorted(tensors.items(), key=lambda item: item[1].nbytes % ALIGN != 0))
    header = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"cannot write tensor {name}: dtype {tensor.dtype} has no safetensors name")
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % ALIGN)

    def write(path):
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for tensor in tensors.values():
                tensor = tensor.detach().to("cpu").contiguous()
                if tensor.numel():  # a view of the tensor's memory as bytes: no copy
                    out.write((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))

    write_whole(file, write, sync)
