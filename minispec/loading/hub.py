"""The Hugging Face hub: fetch the files of a checkpoint that minispec reads, into the hub cache."""

import sys
from pathlib import Path

from .weights import CheckpointError

HUB_FILES = [
    "config.json", "generation_config.json", "model*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "spiece.model",
    "chat_template.jinja",
]


def download_from_hub(repo_id):
    """Fetch only the files minispec needs (honouring the hub cache, HF_HOME and HF_HUB_OFFLINE), with progress
    bars on a terminal only: in a log they are lines of redraws."""
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
