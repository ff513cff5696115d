"""What the command lines (run.py and minispec.bench) share: argument types, and loading a target
with the draft that --draft names."""

import argparse

from .checkpoint import load_model
from .drafters import MODEL_FREE


def token_ids(text):
    """The command lines' --prompt-ids: '1,2,3' -> [1, 2, 3]."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def gamma_setting(text):
    """--gamma: "auto" or a number of guesses per step."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer, got {text!r}") from None


def load_target_and_draft(target, draft, device="cpu", dtype=None, compile=False):
    """The target model, and the draft as generate() takes it: None for "none", "ngram"/"lookup" as
    they are, or a model loaded like the target (same device, dtype)."""
    target = load_model(target, device=device, dtype=dtype, compile=compile)
    if draft in (None, "none") or draft in MODEL_FREE:
        return target, None if draft == "none" else draft
    return target, load_model(draft, device=target.device, dtype=target.dtype, compile=compile)
