"""minispec: a minimal, fast PyTorch inference engine for speculative decoding (README.md shows its use)."""

import importlib.util
import os
import warnings

# Both before torch's first import. minispec never uses numpy, so torch's warning without it would only puzzle.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
# OpenMP's idle threads spin 300,000 turns before sleeping, slowing decoding where other processes hold cores;
# sleeping at once costs each of a step's many short parallel regions a wake-up. A short spin catches the next
# region on a free core and soon yields a busy one, unless the user chose.
if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
    os.environ["GOMP_SPINCOUNT"] = "2000"

from . import cpus  # its clock starts here: how busy other processes keep the CPUs is judged at the first load

# Each public name and the module it lives in, imported on first use: `import minispec` alone loads no
# torch, so that the command lines answer --help and a bad flag at once.
PUBLIC = {"load": "api", "generate": "api", "stream": "api", "Generation": "api", "Chunk": "api",
          "Settings": "settings", "Sampling": "decoding.sampling", "SettingError": "models.checks",
          "load_draft_head": "heads", "chat_prompt": "loading.chat", "CheckpointError": "loading.checkpoint"}
__all__ = list(PUBLIC)


def __getattr__(name):
    """A public name (PEP 562), or a submodule (minispec.api), imported the first time it is asked for."""
    if name in PUBLIC:
        value = getattr(importlib.import_module(f"{__name__}.{PUBLIC[name]}"), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(PUBLIC))
