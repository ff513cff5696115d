"""The command lines' shared flags and prompts file, free of torch so that --help and a bad flag answer at once
(minispec/loaders.py loads what the flags name)."""

import atexit
import contextlib
import json
import os
import signal
import stat
import sys
from dataclasses import fields

from .models.checks import DEFAULT_GROUP_SIZE, GROUP_SIZES, QUANT_MODES, Check, is_integer
from .settings import DTYPE_NAMES, Settings


def add_setting_flags(parser, names=None):
    """A flag for each of Settings' fields with help (or each of `names`): --max-new-tokens sets max_new_tokens."""
    for spec in fields(Settings):
        if spec.metadata["help"] is not None and (names is None or spec.name in names):
            parser.add_argument("--" + spec.name.replace("_", "-"), help=spec.metadata["help"],
                                **{"default": spec.default, **spec.metadata["flag"]})


def settings_of(args):
    """The settings add_setting_flags' flags give, as generate() takes them."""
    return {spec.name: getattr(args, spec.name) for spec in fields(Settings) if spec.metadata["help"] is not None}


def exit_status(main):
    """main()'s exit status: Ctrl-C ends it with 130 and one line, a closed stdout (`| head`) quietly."""
    try:
        return main()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout's reader has gone: Python's last flush of stdout at exit must not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def exit_now(status):
    """Ends the process with `status` once the atexit handlers ran and stdout and stderr are flushed, skipping the
    interpreter's teardown: freeing a loaded model object by object took half a second of a one-shot call."""
    if "torch" not in sys.modules:  # --help, a bad flag: nothing heavy to tear down
        sys.exit(status)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a reader gone, or a stream closed
            stream.flush()
    os._exit(status)


def add_model_flags(parser, draft_default, tensor_parallel=False, **draft):
    """The flags loaders.load_models reads; tensor_parallel: also --tp; draft: --draft's own argparse options."""
    parser.add_argument("--target", required=True,
                        help="checkpoint directory, .gguf file, built-in name (smollm2-135m-instruct) or Hugging "
                             "Face hub id")
    parser.add_argument("--draft", default=draft_default, **draft,
                        help="a smaller model (as --target), a draft head's folder (python -m "
                             "minispec.tools.train_heads), 'ngram', 'lookup', 'suffix' (lookup over earlier requests "
                             "too), 'int8' or 'int4' (the target itself, quantized), one of those and 'lookup' or "
                             "'suffix' joined by a comma (D,suffix: both guess in one token tree), or 'none' (plain "
                             "autoregressive decoding with the target)" + (f"; default {draft_default}" if draft_default
                                                                           else "; several: those drafters side by side"))
    parser.add_argument("--quantize", choices=QUANT_MODES,
                        help="weight-only quantization of the target at load (a .gguf file keeps its own quantized "
                             "tensors as they are)")
    parser.add_argument("--draft-quantize", choices=QUANT_MODES,
                        help="the same for a draft model (int4: its output head and a .gguf file's layers too)")
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE,
                        help="columns per int4 scale")
    parser.add_argument("--device", help="default: cuda where a GPU is, else cpu")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the decode steps (CUDA graphs on cuda); the first run compiles")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, help="default: bfloat16 on cuda, float32 on cpu")
    if tensor_parallel:
        parser.add_argument("--tp", type=int, metavar="N",
                            help="shard the target over N processes (tensor parallelism), launched with torchrun "
                                 "--nproc-per-node N: NCCL on cuda (a GPU each), gloo on cpu; the draft is "
                                 "replicated on every rank")


def check_threads(args):
    """--threads: at least one, and no more than the CPUs this process may run on."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cpus:
        raise ValueError(f"--threads must be between 1 and this machine's {cpus} CPUs, got {args.threads}")


AT_LEAST_ONE = Check(lambda v: v >= 1, "must be >= 1")


def check_values(args, rules):
    """Each of these flags (--batch-size: args.batch_size), where given, checked by its Check."""
    for flag, rule in rules.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            rule(flag, value)


def tp_rank(args):
    rank = os.environ.get("RANK", "0") if getattr(args, "tp", None) else "0"
    return int(rank) if rank.isdigit() else 0  # a bad RANK: loading says so


# A prompts file's bounds, checked before it is read.
PROMPTS_FILE_MAX_BYTES = 64 * 2**20
PROMPTS_MAX = 10_000


def read_prompts_file(path, flag):
    """A prompts file (`flag` names the option in errors): JSON lines when every line parses as a string or
    a list of token ids, else one text prompt a line."""
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)  # before opening: a FIFO's open would wait for a writer
        if regular:
            with open(path, "rb") as file:
                data = file.read(PROMPTS_FILE_MAX_BYTES + 1)
    except OSError as error:
        raise ValueError(f"{flag} {path}: {error.strerror}") from None
    if not regular:
        raise ValueError(f"{flag} {path}: not a regular file")
    if len(data) > PROMPTS_FILE_MAX_BYTES:
        raise ValueError(f"{flag} {path}: larger than {PROMPTS_FILE_MAX_BYTES // 2**20} MiB")
    try:
        lines = [line for line in data.decode("utf-8").splitlines() if line.strip()]
    except UnicodeDecodeError as error:
        line = error.object[:error.start].count(b"\n") + 1
        raise ValueError(f"{flag} {path}: not UTF-8 text (byte {error.object[error.start]:#04x} on line {line})") from None
    if not lines:
        raise ValueError(f"{flag} {path} holds no prompt")
    if len(lines) > PROMPTS_MAX:
        raise ValueError(f"{flag} {path}: {len(lines)} prompts, more than the {PROMPTS_MAX} a run takes")
    try:
        prompts = [json.loads(line) for line in lines]
    except json.JSONDecodeError:
        return lines
    if not all(isinstance(p, str) or isinstance(p, list) and all(is_integer(t) for t in p) for p in prompts):
        raise ValueError(f"{flag} {path}: a JSON line must be a string or a list of token ids")
    return prompts
