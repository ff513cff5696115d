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
from minispec.settings import DTYPE_NAMES

from .timing import decode_steps, median_times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPE_NAMES)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sharded = dist.is_torchelastic_launched()
    world = int(os.environ["WORLD_SIZE"]) if sharded else None
    model = load(args.target, device=args.device, dtype=args.dtype, tp=world)

    def us(work, repeats=args.repeats * 4):  # median microseconds
        return median_times({"work": work}, model.device, repeats, warmup=5)["work"] * 1e6

    def step_ms():  # {width: median ms of a decode step of that many tokens after a 32-token prompt}
        prompt = model.encode(torch.arange(1, 33, device=model.device).view(1, -1))
        steps = median_times(decode_steps(model, prompt, (1, 9)), model.device, args.repeats, warmup=5)
        return {width: seconds * 1e3 for width, seconds in steps.items()}

    with torch.inference_mode():
        report = {"processes": world or 1, "threads": torch.get_num_threads(), "step_ms": step_ms()}
        if sharded:
            tp, dim = model.tp, next(p for p in model.parameters() if p.dim() == 2).shape[1]
            # the modules whose output is summed (models/tp.py), each once a forward (decoder-only models)
            per_step = sum(1 for module in model.modules() if module._forward_hooks)
            partials = {rows: torch.randn(1, rows, dim, dtype=model.dtype, device=model.device) for rows in (1, 9)}
            sums = {rows: us(lambda: tp.sum(partial) + 0) for rows, partial in partials.items()}  # + 0: waits for it
            # the same through torch.distributed's in-place all_reduce: what the functional form adds
            plain = {rows: us(lambda: dist.all_reduce(partial.clone(), group=tp.group))
                     for rows, partial in partials.items()}
            tp.sum = lambda partial: partial  # every sum skipped (wrong numbers, same work): a rank's own compute
            alone = step_ms()
            del tp.sum
            dist.barrier()
            q = torch.rand(3, model.vocab_size, device=model.device)
            report.update(step_ms_without_sums=alone, sum_us=sums, all_reduce_us=plain, sums_per_step=per_step,
                          sums_ms_per_step={rows: per_step * s / 1e3 for rows, s in sums.items()},
                          agree_timings_us=us(lambda: tp.first_numbers([0.1, 0.2])),
                          broadcast_q_us=us(lambda: dist.broadcast(q, tp.first, group=tp.group), args.repeats))
        if not sharded or model.tp.rank == 0:
            print(json.dumps(report), flush=True)
    if sharded:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
