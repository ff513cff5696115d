"""minispec: a minimal, fast PyTorch inference engine for speculative decoding.

    import minispec
    target = minispec.load("path/or/hub-id", device="cpu")
    draft = minispec.load("smaller/checkpoint")           # or "ngram" / "lookup"
    draft = minispec.load_draft_head("head/dir", target)  # or a draft head trained for the target
    out = minispec.generate(target, "Once upon a time", draft=draft, gamma=5, max_new_tokens=64)
    out.tokens, out.text, out.stats
"""

import warnings

# Importing torch without numpy warns "Failed to initialize NumPy"; minispec never uses numpy (no
# dependency of it), so on a fresh machine the warning would only puzzle. It must be filtered before
# torch's first import: run.py imports minispec first.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

from .api import Chunk, Generation, Settings, generate, load, stream  # noqa: E402
from .decoding.sampling import Sampling  # noqa: E402
from .models.checks import SettingError  # noqa: E402
from .loading.checkpoint import CheckpointError  # noqa: E402

__all__ = ["load", "load_draft_head", "generate", "stream", "chat_prompt", "Generation", "Chunk", "Sampling", "Settings",
           "SettingError", "CheckpointError"]


def __getattr__(name):
    """What only some calls need, read when first asked for: a float model's generate reads neither the
    draft heads nor the chat templates (and jinja2)."""
    if name == "load_draft_head":
        from .heads import load_draft_head
        return load_draft_head
    if name == "chat_prompt":
        from .loading.chat import chat_prompt
        return chat_prompt
    raise AttributeError(f"module 'minispec' has no attribute {name!r}")
