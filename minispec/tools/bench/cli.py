"""The bench's command line: `python -m minispec.tools.bench --help`."""

import argparse
import json
import shutil
import sys

from minispec.cli import add_model_flags, add_setting_flags
from minispec.settings import Settings, gamma_setting, token_ids

from . import llamacpp
from .benchmarks import batch_benchmark, beam_benchmark, benchmark, features_benchmark
from .drafters import drafters_benchmark
from .oneshot import one_shot_benchmark, threads_benchmark
from .report import markdown_table
from .served import serve_load_benchmark, tp_serve_benchmark
from .workloads import WORKLOADS, workloads_benchmark

# The benchmarks that replace the main table, each with its own table and a flag (its docstring the flag's
# help): the first flag given picks one (a beam search's requests may run in fresh processes: --one-shot --beams).
OWN_TABLES = {"workloads": (workloads_benchmark, dict(nargs="*", choices=list(WORKLOADS))),
              "tp_serve": (tp_serve_benchmark, dict(type=int, metavar="N")),
              "serve_load": (serve_load_benchmark, dict(action="store_true")),
              "features": (features_benchmark, dict(action="store_true")),
              "batch_sizes": (batch_benchmark, dict(type=int, nargs="+", metavar="B")),
              "threads_under_load": (threads_benchmark, dict(action="store_true")),
              "one_shot": (one_shot_benchmark, dict(action="store_true")),
              "beams": (beam_benchmark, dict(type=int, metavar="W"))}


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m minispec.tools.bench",
                                     description="Autoregressive vs speculative decoding, against Theorem 3.8.")
    add_model_flags(parser, None, nargs="+", required=True)
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", metavar="FILE",
                         help="a prompts file as run.py's --prompts-file reads it, or a built-in set: 'open', 'code' "
                              "or 'partial' (a summary and a code edit; default: 'open' and 'code')")
    prompts.add_argument("--prompt-ids", type=token_ids, action="append",
                         help="a prompt as comma-separated token ids; repeat the flag for several prompts")
    parser.add_argument("--gamma", type=gamma_setting, nargs="+", default=["auto"],
                        help="one table row per value: a number of guesses per step, or 'auto' (chosen per step)")
    add_setting_flags(parser, ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "tree", "draft_beams"))
    parser.set_defaults(max_new_tokens=128, tree=None)  # chains unless --tree says otherwise
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="always generate --max-new-tokens tokens (default on: equal-length runs)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="generate each prompt with seeds --seed .. --seed+N-1 (sampled runs average N samples)")
    parser.add_argument("--compare-reference", action="store_true",
                        help="also time the reference implementation (transformers) and compare its outputs")
    parser.add_argument("--chat", action="store_true",
                        help="wrap text prompts in the checkpoint's chat template (instruct models)")
    parser.add_argument("--memory-tokens", type=int, default=0, metavar="N",
                        help="also compare peak memory of a 16-token and an N-token speculative generation")
    parser.add_argument("--row-invariance-price", action="store_true",
                        help="also time 1-, 4- and 9-token target forwards without row invariance")
    parser.add_argument("--llama-cpp", metavar="DIR", nargs="?", const="",
                        help="also run llama.cpp's plain, speculative and prompt-lookup decoding of the same GGUF "
                             "--target and text prompts (with --one-shot: llama-completion, one call a request): "
                             "its binaries in DIR, or on PATH without DIR (skipped where none is)")
    for name, (run, options) in OWN_TABLES.items():
        parser.add_argument("--" + name.replace("_", "-"), **options,
                            help=" ".join(run.__doc__.split()).rstrip(".") + " (instead of the main table)")
    parser.add_argument("--cache-off", choices=["all", "best"], default="all",
                        help="--workloads: the drafters also run with the prefix cache off: all, or only 'none' and "
                             "the fastest with it on (default all; a pass's servers are up at once: 'best' "
                             "holds fewer)")
    parser.add_argument("--learn-head", action="store_true",
                        help="--workloads: each draft head among --draft also serves as it learns from the traffic "
                             "(the server's --learn-head), in a pass of its own")
    parser.add_argument("--max-model-len", type=int, metavar="N",
                        help="--workloads, --serve-load, --tp-serve: each server's context (default the model's): "
                             "servers up at once each hold KV cache for it")
    parser.add_argument("--requests", type=int, default=8,
                        help="--workloads: requests per workload; --tp-serve: requests per client (default 8)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8],
                        help="--tp-serve, --serve-load: concurrent clients")
    parser.add_argument("--json-out", default="bench.json", metavar="PATH")
    args = parser.parse_args(argv)
    check(args)
    return args


def check(args):
    """A ValueError naming the flags that cannot go together or are out of range, before loading weights."""
    own = [name for name in OWN_TABLES if getattr(args, name) not in (None, False)]  # []: every workload
    args.own, several = next(iter(own), None), len(args.draft) > 1
    flag = f"--{args.own}".replace("_", "-")
    alone = "without --batch-sizes, --beams, --one-shot, --features, --workloads and --tp-serve"
    problems = [
        (len(own) > 1 and own != ["one_shot", "beams"],
         ("--workloads, --tp-serve and --serve-load are benchmarks of their own" if args.own in list(OWN_TABLES)[:3]
          else f"{flag} is a benchmark of its own") + ": without the other benchmarks' flags"),
        (args.tp_serve is not None and args.tp_serve < 2, f"--tp-serve must be >= 2, got {args.tp_serve}"),
        (args.workloads is not None and args.requests < 2,
         f"--workloads needs --requests >= 2 (two halves), got {args.requests}"),
        (min(args.requests, *args.clients) < 1, "--requests and --clients must be >= 1"),
        (args.learn_head and args.workloads is None, "--learn-head goes with --workloads"),
        (args.max_model_len is not None and args.max_model_len < 1,
         f"--max-model-len must be >= 1, got {args.max_model_len}"),
        (args.memory_tokens and args.memory_tokens <= 16,
         f"--memory-tokens must be more than 16, got {args.memory_tokens}"),
        (any(g != "auto" and g < 1 for g in args.gamma), f"--gamma values must be >= 1 or 'auto', got {args.gamma}"),
        (args.beams is not None and args.beams < 1, f"--beams must be >= 1, got {args.beams}"),
        (args.batch_sizes and min(args.batch_sizes) < 1, f"--batch-sizes must be >= 1, got {args.batch_sizes}"),
        (several and args.own not in (None, "workloads"),
         f"several --draft values are a benchmark of their own: {alone}"),
        (args.llama_cpp is not None and (own not in ([], ["one_shot"]) or several),
         f"--llama-cpp goes with the main table or --one-shot: one --draft, {alone}"),
        (args.llama_cpp is not None and (args.prompt_ids or args.temperature != 0),
         "--llama-cpp compares greedy decoding of text prompts: without --prompt-ids and --temperature"),
        (isinstance(args.tree, int) and args.tree < 1, f"--tree must be >= 1, got {args.tree}"),
        (min(args.repeats, args.max_new_tokens, args.seeds) < 1,
         "--repeats, --max-new-tokens and --seeds must be >= 1"),
    ]
    message = next((message for wrong, message in problems if wrong), None)
    if message is not None:
        raise ValueError(message)
    args.draft = args.draft if several or args.workloads is not None else args.draft[0]
    if args.llama_cpp is not None:
        llamacpp.check_files(args.target, args.draft)
        if args.llama_cpp == "" and shutil.which(llamacpp.PROGRAMS["plain"]) is None:
            print(f"--llama-cpp: no {llamacpp.PROGRAMS['plain']} on PATH: llama.cpp skipped", file=sys.stderr)
            args.llama_cpp = None
        else:
            llamacpp.find_programs(args.llama_cpp)
    Settings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)  # bad sampling fails before loading


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.own is not None:
            result, table = OWN_TABLES[args.own][0](args)
        elif isinstance(args.draft, list):
            result, table = drafters_benchmark(args)
        else:
            result = benchmark(args)
            table = markdown_table(result)
    except ValueError as error:  # includes CheckpointError: a problem with the input, not a bug
        print(f"error: {error}", file=sys.stderr)
        return 2
    with open(args.json_out, "w") as f:
        json.dump(result, f, indent=1)
    print(table)
    print(f"\nwrote {args.json_out}", file=sys.stderr)
    return 0
