"""python -m minispec.serve --target T [--draft D] ...: the OpenAI API over one target (and its draft), with
uvicorn; sharded: torchrun --nproc-per-node N -m minispec.serve --tp N ... (rank 0 serves: group.py)."""

import argparse
import logging
import math
import os
import sys

from ..cli import AT_LEAST_ONE, add_model_flags, add_setting_flags, check_values, tp_rank
from ..heads import is_head_dir
from ..models.checks import Check
from ..loaders import load_models
from .scheduler import Scheduler

try:
    import uvicorn

    from .app import build_app
except ImportError as missing:  # the optional extra is not installed
    print(f"error: the server needs {missing.name.split('.')[0]}: pip install -e '.[serve]' (in a checkout of "
          "minispec)", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m minispec.serve",
                                     description="An OpenAI-compatible HTTP server, speculative by default.")
    add_model_flags(parser, draft_default="suffix", tensor_parallel=True)
    add_setting_flags(parser, ("gamma", "tree"))
    parser.add_argument("--batch-size", type=int, default=4, help="requests decoded together (cache rows); default 4")
    parser.add_argument("--max-model-len", type=int,
                        help="positions per request, prompt and completion together (default: the target's context, "
                             "or the draft's when shorter); the caches hold --batch-size rows of this many")
    parser.add_argument("--max-queue", type=int, default=64,
                        help="requests that may wait for a free row; more are refused with 429 (default 64)")
    parser.add_argument("--prefix-cache-mb", type=float, default=512,
                        help="MiB of CPU memory for the keys and values of earlier requests' tokens, which a prompt "
                             "beginning with them reuses (least recently used evicted; default 512, 0: off)")
    parser.add_argument("--learn-head", metavar="DIR",
                        help="keep training the draft head (--draft, a head's folder) on the states the target "
                             "computes for the requests: between steps while training has taken at most a quarter of "
                             "the time, and while idle; the latest 256 MiB of states kept; the head drafts in float "
                             "and is saved into DIR (a head's folder) when the server stops")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this "
                                                            "machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="the model's name in the API (default: --target as given)")
    parser.add_argument("--api-key", default=os.environ.get("MINISPEC_API_KEY"),
                        help="a key every request must carry as 'Authorization: Bearer KEY' (default: "
                             "$MINISPEC_API_KEY, which keeps it out of the process list; unset: none needed)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM or Ctrl-C, seconds the running requests may take to finish before they "
                             "are cancelled (default 30)")
    parser.add_argument("--tp-timeout", type=float, default=30.0,
                        help="with --tp: seconds a rank waits for the others in a collective; a rank that dies or "
                             "stalls for longer fails every request (503) and the server exits, within 2.5 times "
                             "this and 5 s (default 30)")
    return parser.parse_args(argv)


class Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM or Ctrl-C drains the scheduler: the requests under way get
    `shutdown_timeout` seconds, then a 503 their clients can read before uvicorn drops their connections."""

    def __init__(self, app, scheduler, shutdown_timeout, **options):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=shutdown_timeout + 5, **options))
        self.scheduler, self.shutdown_timeout = scheduler, shutdown_timeout

    def handle_exit(self, sig, frame):
        self.scheduler.drain(self.shutdown_timeout)
        super().handle_exit(sig, frame)


def check_flags(args):
    check_values(args, {**dict.fromkeys(("--batch-size", "--max-queue", "--max-model-len"), AT_LEAST_ONE),
                        "--prefix-cache-mb": Check(lambda v: 0 <= v < math.inf, "must be a number of MiB >= 0"),
                        "--shutdown-timeout": Check(lambda v: 0 <= v < math.inf, "must be a number of seconds >= 0"),
                        "--tp-timeout": Check(lambda v: 0 < v < 1e6, "must be a number of seconds in (0, 1e6)"),
                        "--port": Check(lambda v: 0 <= v <= 65535, "must be between 0 and 65535")})
    if args.learn_head is not None and not is_head_dir(args.draft):
        raise ValueError(f"--learn-head trains a draft head: --draft {args.draft} is not a head's folder")
    if args.learn_head is not None and args.draft_quantize is not None:
        raise ValueError("--learn-head drafts with the float head it trains: drop --draft-quantize")


def main(argv=None):
    args = parse_args(argv)
    try:
        check_flags(args)  # bad flags fail before loading weights
        target, draft = load_models(args)
        learner = None
        if args.learn_head is not None:
            from ..heads.learn import Learner  # only a server whose head learns reads the trainer
            learner = Learner(target, args.draft, args.learn_head)
            draft = learner.head  # its own float copy of the head
        scheduler = Scheduler(target, draft, args.gamma, args.batch_size, args.max_model_len, args.max_queue,
                              args.tree, args.prefix_cache_mb, learner)
        app = build_app(scheduler, args.served_model_name or args.target, args.draft, args.api_key,
                        args.shutdown_timeout)
    except ValueError as error:  # includes CheckpointError: a problem with the input, not a bug
        if not tp_rank(args):  # with --tp every rank refuses alike: rank 0 says so
            print(f"error: {error}", file=sys.stderr)
        return 2
    if target.tp is not None:
        from . import group  # a tensor-parallel server only
        if target.tp.rank:
            return group.follow(scheduler.models, args.tp_timeout)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(name)s: %(message)s")
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("minispec.serve").warning("listening on %s without --api-key: whoever reaches it can "
                                                    "use it", args.host)
    server = Server(app, scheduler, args.shutdown_timeout, host=args.host, port=args.port)
    if target.tp is not None:  # a fault of the group closes the scheduler with its reason
        group.Leader(scheduler, args.tp_timeout, on_failure=lambda _: setattr(server, "should_exit", True))
    server.run()  # on SIGTERM, the scheduler's stop also stops the other ranks (group.Leader.stop)
    if scheduler.failure is not None:
        print(f"error: {scheduler.failure}", file=sys.stderr)
        return 1
    return 0 if server.started else 1  # uvicorn has logged why it could not start


if __name__ == "__main__":
    sys.exit(main())
