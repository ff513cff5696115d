"""What tensor parallelism costs per decode step:

    torchrun --standalone --nproc-per-node 2 -m minispec.tools.bench.tp --target CKPT --device cpu  # sharded
    python -m minispec.tools.bench.tp --target CKPT --device cpu --threads 2                       # one process

Rank 0 prints one JSON object: decode steps of 1 and 9 tokens and, sharded, the median time of one sum
(the all-reduce ending a layer's attention and MLP), of agreeing gamma="auto"'s timings, and of
broadcasting a draft's q for 3 guesses; the steps without their sums.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

from minispec import load
from minispec.loading.weights import DTYPES

from .timing import decode_steps, median_times


def median_seconds(work, repeats, model):
    return median_times({"work": work}, model.device, repeats, warmup=5)["work"]


def decode_seconds(model, widths, repeats):
    """{width: median seconds of a decode step of that many tokens after a 32-token prompt}."""
    prompt = model.encode(torch.arange(1, 33, device=model.device).view(1, -1))
    return median_times(decode_steps(model, prompt, widths), model.device, repeats, warmup=5)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sharded = dist.is_torchelastic_launched()
    world = int(os.environ["WORLD_SIZE"]) if sharded else None
    model = load(args.target, device=args.device, dtype=DTYPES.get(args.dtype), tp=world)
    with torch.inference_mode():
        steps = decode_seconds(model, (1, 9), args.repeats)
        report = {"processes": world or 1, "threads": torch.get_num_threads(),
                  "step_ms": {w: s * 1e3 for w, s in steps.items()}}
        if sharded:
            tp, dim = model.tp, next(p for p in model.parameters() if p.dim() == 2).shape[1]
            # the modules whose output is summed (models/tp.py), each once a forward (decoder-only models)
            per_step = sum(1 for module in model.modules() if module._forward_hooks)
            sums, plain = {}, {}
            for rows in (1, 9):
                partial = torch.randn(1, rows, dim, dtype=model.dtype, device=model.device)
                sums[rows] = median_seconds(lambda: tp.sum(partial) + 0, args.repeats * 4, model)  # + 0: waits for it
                # the same through torch.distributed's in-place all_reduce: what the functional form adds
                plain[rows] = median_seconds(lambda: dist.all_reduce(partial.clone(), group=tp.group),
                                             args.repeats * 4, model)
            # the same steps with every sum skipped (wrong numbers, same work otherwise): a rank's own compute
            tp.sum = lambda partial: partial
            alone = decode_seconds(model, (1, 9), args.repeats)
            del tp.sum
            dist.barrier()
            q = torch.rand(3, model.vocab_size, device=model.device)
            report.update(
                step_ms_without_sums={w: s * 1e3 for w, s in alone.items()},
                sum_us={rows: s * 1e6 for rows, s in sums.items()},
                all_reduce_us={rows: s * 1e6 for rows, s in plain.items()}, sums_per_step=per_step,
                sums_ms_per_step={rows: per_step * s * 1e3 for rows, s in sums.items()},
                agree_timings_us=median_seconds(lambda: tp.first_numbers([0.1, 0.2]), args.repeats * 4, model) * 1e6,
                broadcast_q_us=median_seconds(lambda: dist.broadcast(q, tp.first, group=tp.group), args.repeats,
                                              model) * 1e6)
        if not sharded or model.tp.rank == 0:
            print(json.dumps(report), flush=True)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
