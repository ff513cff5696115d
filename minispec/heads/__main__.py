"""python -m minispec.heads train --target T --out DIR [--kind eagle|eagle3|medusa] [--prompts FILE] ...

Trains a draft head for a target by self-distillation (heads/train.py) and writes it into DIR, where
`--draft DIR` and `minispec.load_draft_head(DIR, target)` find it. Run again to resume."""

import argparse
import sys

import torch

from ..cli import read_prompts_file
from ..loading.checkpoint import load_model
from ..loading.weights import DTYPES, CheckpointError
from .train import DRAFT_VOCAB, EPOCHS, train


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m minispec.heads", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("train", help="train a draft head for a target (resumes an interrupted run)")
    command.add_argument("--target", required=True, help="the target, as run.py's --target")
    command.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    command.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    command.add_argument("--out", required=True, help="the head's folder (made if missing)")
    command.add_argument("--kind", choices=("eagle", "eagle3", "medusa"), default="eagle")
    command.add_argument("--prompts", help="a file of prompts, one per line (default: templates, and for a chat "
                         "target prompts it writes itself)")
    command.add_argument("--epochs", type=int, help=f"default: {EPOCHS['eagle']} (eagle3: {EPOCHS['eagle3']})")
    command.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers")
    command.add_argument("--heads", type=int, default=4, help="Medusa: how many heads")
    command.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, metavar="N",
                         help="EAGLE, EAGLE-3: the head guesses among the target's N most said tokens (0: all)")
    command.add_argument("--lr", type=float, default=2e-3)
    command.add_argument("--no-chat", action="store_true", help="answer the prompts as raw text, not chat turns")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    # train(epochs=0) only returns the untrained head: nothing would be written
    if args.epochs is not None and args.epochs < 1:
        print(f"minispec: --epochs must be >= 1, got {args.epochs}", file=sys.stderr)
        return 2
    try:
        prompts = read_prompts_file(args.prompts, "--prompts") if args.prompts else None
        target = load_model(args.target, device=args.device, dtype=DTYPES.get(args.dtype))
        train(target, args.out, args.kind, prompts, args.epochs, args.max_new_tokens, args.lr, args.heads,
              chat=not args.no_chat, draft_vocab=args.draft_vocab)
    except (ValueError, OSError, CheckpointError) as error:
        print(f"minispec: {error}", file=sys.stderr)
        return 2
    print(f"minispec: the head is in {args.out}; use it with --draft {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
