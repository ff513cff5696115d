"""Find a checkpoint (local directory or Hugging Face hub id), read its config and safetensors
weights, and build the matching minispec model.

A family module (minispec/models/<family>.py) provides three things, registered in FAMILIES:
a config class with `from_hf(config_json: dict)`, the model class (a CachedLM) built from that
config, and `convert_hf_weights(state_dict, config)` renaming checkpoint keys to the model's own.
"""

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .drafters import MODEL_FREE
from .models import gpt2, llama, t5
from .tokenizer import load_tokenizer

FAMILIES = {
    "gpt2": (gpt2.GPT2Config, gpt2.GPT2, gpt2.convert_hf_weights),
    "llama": (llama.LlamaConfig, llama.Llama, llama.convert_hf_weights),
    "mistral": (llama.LlamaConfig, llama.Llama, llama.convert_hf_weights),
    "qwen2": (llama.LlamaConfig, llama.Llama, llama.convert_hf_weights),
    "t5": (t5.T5Config, t5.T5, t5.convert_hf_weights),
}

# What a checkpoint directory needs from the hub: configs, weights, tokenizer files.
HUB_FILES = [
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "spiece.model",
    "chat_template.jinja",
]


class CheckpointError(ValueError):
    """A checkpoint that cannot be found, read or matched to a model; the message says why."""


def resolve_checkpoint(name_or_path):
    """A local checkpoint directory for `name_or_path`: an existing directory, a .gguf file (converted
    once into the weights folder), a built-in name (minispec.builtin), or a hub id to fetch."""
    from . import builtin  # it imports this module

    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.suffix == ".gguf":
        if not path.is_file():
            raise CheckpointError(f"GGUF file {path} does not exist")
        return builtin.import_gguf(path)
    if path.exists():
        raise CheckpointError(f"{path} is a file; a checkpoint is a directory with config.json and *.safetensors, "
                              "or a .gguf file")
    if str(name_or_path) in builtin.BUILTINS:
        return builtin.resolve_builtin(str(name_or_path))
    # Hub ids look like "name" or "owner/name"; anything else is a local path that is missing.
    if str(name_or_path).startswith((".", "/", "~")) or str(name_or_path).count("/") > 1:
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    return download_from_hub(str(name_or_path))


def download_from_hub(repo_id):
    """Fetch only the files minispec needs; honours the hub cache, HF_HOME and HF_HUB_OFFLINE."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

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


def read_json(file):
    try:
        return json.loads(Path(file).read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {file}: {error}") from error


def read_config(directory):
    config_file = Path(directory) / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{directory} has no config.json")
    config = read_json(config_file)
    generation_file = Path(directory) / "generation_config.json"
    if generation_file.is_file():  # eos/bos ids there override the model config's, as in the reference
        generation = read_json(generation_file)
        config.update({k: v for k, v in generation.items() if k.endswith("token_id") and v is not None})
    return config


def read_weights(directory):
    """All tensors of a checkpoint: model.safetensors, or the shards listed in its index."""
    directory = Path(directory)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        shards = sorted(set(weight_map.values()))
        files = [directory / shard for shard in shards]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} has no *.safetensors weights")
    weights = {}
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"shard {file.name} listed in {index.name} is missing from {directory}")
        try:
            weights.update(load_file(file))
        except Exception as error:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"cannot read weights from {file}: {error}") from error
    return weights


def check_shapes(model, weights, source):
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise CheckpointError(f"{source}: weights lack tensor(s) {', '.join(missing[:5])}")
    unexpected = sorted(set(weights) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensor(s) {', '.join(unexpected[:5])}")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(tensor.shape)} in the checkpoint but the config "
                f"implies {tuple(expected[name].shape)}"
            )


def check_device(device):
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device {str(device)!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device}: CUDA is not available on this machine")
    return device


# The --dtype names the command lines accept.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def token_ids(text):
    """The command lines' --prompt-ids: '1,2,3' -> [1, 2, 3]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def default_dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_model(name_or_path, device="cpu", dtype=None, compile=False):
    """Load a checkpoint into its minispec model, with tokenizer and special token ids attached.
    compile=True compiles the decode forward (see CachedLM.compile)."""
    device = check_device(device)
    directory = resolve_checkpoint(name_or_path)
    hf_config = read_config(directory)
    model_type = hf_config.get("model_type")
    if model_type not in FAMILIES:
        raise CheckpointError(
            f"{directory}: unknown model_type {model_type!r}; minispec supports {', '.join(sorted(FAMILIES))}"
        )
    config_class, model_class, convert = FAMILIES[model_type]
    try:
        config = config_class.from_hf(hf_config)
    except KeyError as error:
        raise CheckpointError(f"{directory}/config.json lacks the key {error} for model_type {model_type}") from error
    except ValueError as error:
        raise CheckpointError(f"{directory}/config.json: {error}") from error
    with torch.device("meta"):
        model = model_class(config)
    weights = convert(read_weights(directory), config)
    check_shapes(model, weights, directory)
    dtype = dtype or default_dtype(device)
    model.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, assign=True, strict=True)
    model = model.to(device=device).eval().requires_grad_(False)
    model.name = str(name_or_path) if not Path(name_or_path).expanduser().is_dir() else Path(directory).name
    attach_special_tokens(model, hf_config)
    model.tokenizer = load_tokenizer(directory, model_type)
    return model.compile() if compile else model


def load_target_and_draft(target, draft, device="cpu", dtype=None, compile=False):
    """For the command lines: the target model, and the draft as generate() takes it — None for
    "none", "ngram"/"lookup" as they are, or a model loaded like the target (same device, dtype)."""
    target = load_model(target, device=device, dtype=dtype, compile=compile)
    if draft in (None, "none") or draft in MODEL_FREE:
        return target, None if draft == "none" else draft
    return target, load_model(draft, device=target.device, dtype=target.dtype, compile=compile)


def attach_special_tokens(model, hf_config):
    eos = hf_config.get("eos_token_id")
    model.eos_token_ids = tuple(eos if isinstance(eos, list) else [] if eos is None else [eos])
    model.bos_token_id = hf_config.get("bos_token_id")
    model.pad_token_id = hf_config.get("pad_token_id")
