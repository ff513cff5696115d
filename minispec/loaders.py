"""Loading what the command lines' flags (cli.py) name: a target, with the draft that --draft names."""

import torch

from . import cpus
from .cli import check_threads
from .decoding.drafters import MODEL_FREE_NAMES, SELF_DRAFT_MODES
from .heads import is_head_dir, load_draft_head
from .loading.checkpoint import kept_int4_draft, load_model
from .loading.weights import DTYPES, release_freed_memory, release_tensor_pages
from .models import quant


def load_models(args):
    """(target, draft as generate() takes it), as add_model_flags' flags say; --threads is checked first."""
    check_threads(args)
    if args.threads is not None:
        cpus.chosen = True
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_model(args.target, device=device, dtype=DTYPES.get(args.dtype), compile=args.compile,
                        quantize=args.quantize, group_size=args.group_size, tp=getattr(args, "tp", None))
    return target, load_draft(args.draft, target, args.compile, args.draft_quantize, args.group_size)


def loads_model(draft):
    """Whether --draft names a model to load (alone, or as a part of "D,suffix"): what --draft-quantize is for."""
    return any(part not in ("none", *MODEL_FREE_NAMES, *SELF_DRAFT_MODES) for part in draft.split(","))


def load_draft(draft, target, compile=False, draft_quantize=None, group_size=quant.DEFAULT_GROUP_SIZE):
    """The draft as generate() takes it: None for "none", a name as it is, a head folder's head, "D,suffix" both
    (decoding/mixed.py), or a model loaded like the target (whole on every rank), quantized as `draft_quantize` says."""
    if isinstance(draft, str) and "," in draft:
        return [load_draft(part, target, compile, None if part in MODEL_FREE_NAMES else draft_quantize, group_size)
                for part in draft.split(",")]
    if draft in (None, "none", *MODEL_FREE_NAMES, *SELF_DRAFT_MODES):
        if draft_quantize is not None:
            raise ValueError(f"--draft-quantize quantizes a draft model; --draft {draft} loads none")
        return None if draft == "none" else draft
    if is_head_dir(draft):  # a draft head trained for this target (minispec/heads)
        return load_draft_head(draft, target, draft_quantize or "auto")
    model = load_model(draft, device=target.device, dtype=target.dtype, compile=compile, quantize=draft_quantize,
                       group_size=group_size)
    if draft_quantize == "int4":
        replaced = kept_int4_draft(model)
        for module in replaced:  # the int8 layers' file pages, read to requantize them, and the temporaries
            release_tensor_pages(module.buffers())
        if replaced:
            release_freed_memory()
    return model
