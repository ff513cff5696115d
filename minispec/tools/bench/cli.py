"""The bench's command line: `python -m minispec.tools.bench --help`."""

import argparse
import json
import sys

import torch

from minispec.settings import gamma_setting, token_ids, tree_setting
from minispec.loading.weights import DTYPES
from minispec.models import quant

from .benchmarks import batch_benchmark, beam_benchmark, benchmark, sampling_of
from . import llamacpp
from .drafters import drafters_benchmark
from .oneshot import one_shot_benchmark
from .threads import threads_benchmark
from .report import markdown_table


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m minispec.tools.bench",
                                     description="Autoregressive vs speculative decoding, against Theorem 3.8.")
    parser.add_argument("--target", required=True, help="checkpoint directory or Hugging Face hub id")
    parser.add_argument("--draft", required=True, nargs="+",
                        help="checkpoint directory or hub id, a draft head's folder, 'ngram', 'lookup', or 'int8' / "
                             "'int4' (the target quantized); several: those drafters side by side (bench/drafters.py)")
    parser.add_argument("--quantize", choices=quant.MODES, help="weight-only quantization of the target (run.py's)")
    parser.add_argument("--draft-quantize", choices=quant.MODES, help="the same for a draft model")
    parser.add_argument("--group-size", type=int, choices=quant.GROUP_SIZES, default=quant.DEFAULT_GROUP_SIZE,
                        help="columns per int4 scale")
    prompts = parser.add_mutually_exclusive_group()
    prompts.add_argument("--prompts", metavar="FILE",
                         help="a prompts file as run.py's --prompts-file reads it (one text prompt a line, or JSON "
                              "lines: strings or lists of token ids), or a built-in set: 'open', 'code' or "
                              "'partial' (a summary and a code edit; default: 'open' and 'code')")
    prompts.add_argument("--prompt-ids", type=token_ids, action="append",
                         help="a prompt as comma-separated token ids; repeat the flag for several prompts")
    parser.add_argument("--gamma", type=gamma_setting, nargs="+", default=["auto"],
                        help="one table row per value: a number of guesses per step, or 'auto' (chosen per step)")
    parser.add_argument("--tree", type=tree_setting, metavar="off|auto|N",
                        help="verify token trees of up to N guesses, or 'auto' (run.py's)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="sampling: keep the most likely tokens of this mass")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, metavar="N",
                        help="generate each prompt with seeds --seed .. --seed+N-1: sampled runs then average "
                             "over N samples per prompt instead of timing one sample again and again")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="always generate --max-new-tokens tokens (default on: equal-length runs)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--compile", action="store_true", help="torch.compile the models (minispec.load(compile=True))")
    parser.add_argument("--compare-reference", action="store_true",
                        help="also time the reference implementation (transformers) and compare its outputs")
    parser.add_argument("--chat", action="store_true",
                        help="wrap text prompts in the checkpoint's chat template (instruct models)")
    parser.add_argument("--memory-tokens", type=int, default=0, metavar="N",
                        help="also compare peak memory of a 16-token and an N-token speculative generation "
                             "(the first γ, the first prompt): it must not grow with the number of steps")
    parser.add_argument("--row-invariance-price", action="store_true",
                        help="also time 1-, 4- and 9-token target forwards without row invariance (BLAS "
                             "linears, unpadded attention rows) beside the usual ones")
    parser.add_argument("--batch-sizes", type=int, nargs="+", metavar="B",
                        help="instead of the table above: total new tokens/s of B requests decoded together "
                             "(the prompts repeated to B), plain and speculative (the first --gamma), per B")
    parser.add_argument("--beams", type=int, metavar="W",
                        help="instead of the table above: beam search of width W, plain against speculative "
                             "(each --gamma) per prompt, wall clock")
    parser.add_argument("--draft-beams", type=int, metavar="U", help="the draft's beam width (default: W)")
    parser.add_argument("--one-shot", action="store_true",
                        help="instead of the table above: every request in a fresh process, as run.py runs it, "
                             "plain against each --gamma (with --beams: beam search), per prompt")
    parser.add_argument("--threads-under-load", action="store_true",
                        help="instead of the table above: tokens/s with the default threads and with each --threads "
                             "setting while another process keeps one core busy, each request in a fresh process "
                             "(the first --gamma)")
    parser.add_argument("--llama-cpp", metavar="DIR",
                        help="also run llama.cpp's plain, speculative (a GGUF --draft) and prompt-lookup decoding "
                             "on the same GGUF --target and text prompts: its binaries in DIR (never a dependency)")
    parser.add_argument("--json-out", default="bench.json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.memory_tokens and args.memory_tokens <= 16:
        raise ValueError(f"--memory-tokens must be more than 16, got {args.memory_tokens}")
    if any(g != "auto" and g < 1 for g in args.gamma):
        raise ValueError(f"--gamma values must be >= 1 or 'auto', got {args.gamma}")
    if args.beams is not None and args.beams < 1:
        raise ValueError(f"--beams must be >= 1, got {args.beams}")
    if args.batch_sizes and (args.beams or args.one_shot):
        raise ValueError("--batch-sizes is a benchmark of its own: without --beams and --one-shot")
    if args.batch_sizes and min(args.batch_sizes) < 1:
        raise ValueError(f"--batch-sizes must be >= 1, got {args.batch_sizes}")
    if len(args.draft) > 1 and (args.batch_sizes or args.beams or args.one_shot):
        raise ValueError("several --draft values are a benchmark of their own: without --batch-sizes, --beams and "
                         "--one-shot")
    if args.threads_under_load and (args.batch_sizes or args.beams or args.one_shot or len(args.draft) > 1):
        raise ValueError("--threads-under-load is a benchmark of its own: one --draft, without --batch-sizes, "
                         "--beams and --one-shot")
    if len(args.draft) == 1:
        args.draft = args.draft[0]
    if args.llama_cpp:
        if args.batch_sizes or args.beams or args.one_shot or isinstance(args.draft, list):
            raise ValueError("--llama-cpp goes with the main table: one --draft, without --batch-sizes, --beams "
                             "and --one-shot")
        if args.prompt_ids or args.temperature != 0:
            raise ValueError("--llama-cpp compares greedy decoding of text prompts: without --prompt-ids and "
                             "--temperature")
        llamacpp.check_files(args.target, args.draft)
        llamacpp.find_programs(args.llama_cpp)
    if isinstance(args.tree, int) and args.tree < 1:
        raise ValueError(f"--tree must be >= 1, got {args.tree}")
    if args.repeats < 1 or args.max_new_tokens < 1 or args.seeds < 1:
        raise ValueError("--repeats, --max-new-tokens and --seeds must be >= 1")
    sampling_of(args)  # bad sampling settings fail before loading weights
    return args


def main(argv=None):
    try:
        args = parse_args(argv)
        if args.one_shot:
            result, table = one_shot_benchmark(args)
        elif args.threads_under_load:
            result, table = threads_benchmark(args)
        elif args.batch_sizes:
            result, table = batch_benchmark(args)
        elif args.beams:
            result, table = beam_benchmark(args)
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
