"""minispec: a minimal, fast PyTorch inference engine for speculative decoding.

    import minispec
    target = minispec.load("path/or/hub-id", device="cpu")
    draft = minispec.load("smaller/checkpoint")           # or "ngram" / "lookup"
    out = minispec.generate(target, "Once upon a time", draft=draft, gamma=5, max_new_tokens=64)
    out.tokens, out.text, out.stats
"""

from .chat import chat_prompt
from .checkpoint import CheckpointError, load_model as load
from .api import Chunk, Generation, generate, stream
from .sampling import Sampling

__all__ = ["load", "generate", "stream", "chat_prompt", "Generation", "Chunk", "Sampling", "CheckpointError"]
