"""What the command lines (run.py, minispec.bench and minispec.serve) share: argument types, the flags
that choose and load the models, and loading a target with the draft that --draft names."""

import argparse
import json
import os
from pathlib import Path

import torch

from .decoding.drafters import MODEL_FREE, SELF_DRAFT_MODES
from .heads import is_head_dir, load_draft_head
from .loading.checkpoint import load_model
from .loading.weights import DTYPES
from .models import quant


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


def tree_setting(text):
    """--tree: "auto", "off" (None: chains) or the most guesses a step's tree holds."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'off' or an integer, got {text!r}") from None


def add_model_flags(parser, draft_default, tensor_parallel=False):
    """The flags that say which models to load, and how (run.py's and the server's); load_models reads them.
    tensor_parallel: also --tp (run.py's)."""
    parser.add_argument("--target", required=True,
                        help="checkpoint directory, .gguf file, built-in name (smollm2-135m-instruct) or Hugging "
                             "Face hub id")
    parser.add_argument("--draft", default=draft_default,
                        help="a smaller model (as --target), a draft head's folder (python -m minispec.heads "
                             "train), 'ngram', 'lookup', 'int8' or 'int4' (the target itself, "
                             f"quantized), or 'none' (plain autoregressive decoding with the target); default "
                             f"{draft_default}")
    parser.add_argument("--quantize", choices=quant.MODES,
                        help="weight-only quantization of the target at load (a .gguf file keeps its own quantized "
                             "tensors as they are)")
    parser.add_argument("--draft-quantize", choices=quant.MODES, help="the same for a draft model")
    parser.add_argument("--group-size", type=int, choices=quant.GROUP_SIZES, default=quant.DEFAULT_GROUP_SIZE,
                        help="columns per int4 scale")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decode steps (CUDA graphs on cuda); the first run compiles")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    if tensor_parallel:
        parser.add_argument("--tp", type=int, metavar="N",
                            help="shard the target over N processes (tensor parallelism), launched with torchrun "
                                 "--nproc-per-node N: NCCL on cuda (a GPU each), gloo on cpu; the draft is "
                                 "replicated on every rank")


def load_models(args):
    """(target, draft as generate() takes it), as add_model_flags' flags say; --threads is checked first."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cpus:
        raise ValueError(f"--threads must be between 1 and this machine's {cpus} CPUs, got {args.threads}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_target_and_draft(args.target, args.draft, args.device, DTYPES.get(args.dtype), args.compile,
                                 args.quantize, args.draft_quantize, args.group_size, getattr(args, "tp", None))


def load_target_and_draft(target, draft, device="cpu", dtype=None, compile=False, quantize=None, draft_quantize=None,
                          group_size=quant.DEFAULT_GROUP_SIZE, tp=None):
    """The target model, and the draft as generate() takes it: None for "none", "ngram"/"lookup" and
    "int8"/"int4" (the target's own quantized copy, sharded as the target is) as they are, or a model
    loaded like the target (same device, dtype; whole on every rank when the target is sharded over
    `tp` processes), quantized as `draft_quantize` says."""
    target = load_model(target, device=device, dtype=dtype, compile=compile, quantize=quantize, group_size=group_size,
                        tp=tp)
    return target, load_draft(draft, target, compile, draft_quantize, group_size)


def load_draft(draft, target, compile=False, draft_quantize=None, group_size=quant.DEFAULT_GROUP_SIZE):
    """--draft for a loaded target, as load_target_and_draft says (a head folder: the head, for it)."""
    if draft in (None, "none") or draft in MODEL_FREE or draft in SELF_DRAFT_MODES:
        if draft_quantize is not None:
            raise ValueError(f"--draft-quantize quantizes a draft model; --draft {draft} loads none")
        return None if draft == "none" else draft
    if is_head_dir(draft):  # a draft head trained for this target (minispec/heads)
        return load_draft_head(draft, target, draft_quantize or "auto")
    return load_model(draft, device=target.device, dtype=target.dtype, compile=compile, quantize=draft_quantize,
                      group_size=group_size)


def tp_rank(args):
    """This process's rank with --tp (torchrun's RANK), else 0."""
    rank = os.environ.get("RANK", "0") if getattr(args, "tp", None) else "0"
    return int(rank) if rank.isdigit() else 0  # a bad RANK: loading says so


def is_token_id(value):
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not token 1


def read_prompts_file(path, flag):
    """A prompts file, as both command lines read it (`flag` names their option in errors): JSON lines
    when every line parses as a string or a list of token ids, else one text prompt a line."""
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        line = error.object[:error.start].count(b"\n") + 1
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {error.object[error.start]:#04x} on line {line})") from None
    if not lines:
        raise ValueError(f"{flag} {path} holds no prompt")
    try:
        prompts = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return lines
    if not all(isinstance(p, str) or isinstance(p, list) and all(is_token_id(t) for t in p) for p in prompts):
        raise ValueError(f"{flag} {path}: a JSON line must be a string or a list of token ids")
    return prompts
