"""The process group a tensor-parallel target runs in (tp=N), checked before anything is loaded, then joined:
one process per rank, started by torchrun; NCCL on CUDA, gloo on the CPU. The sharding is models/tp.py's."""

import atexit
import gc
import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ..models.tp import TensorParallel

BACKENDS = {"cuda": "nccl", "cpu": "gloo"}
# Seconds a rank waits for the others (MINISPEC_TP_TIMEOUT): torch's default, for ranks that load a large checkpoint
JOIN_TIMEOUT = 600


def env_int(name):
    value = os.environ.get(name)
    try:
        return None if value is None else int(value)
    except ValueError:
        raise ValueError(f"tp: the environment variable {name}={value!r} is not an integer") from None


def join_timeout():
    value = os.environ.get("MINISPEC_TP_TIMEOUT", str(JOIN_TIMEOUT))
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < 1e6:
        raise ValueError(f"tp: MINISPEC_TP_TIMEOUT={value!r} must be a number of seconds in (0, 1e6)")
    return seconds


def launch(tp, device):
    """(world size, this rank's device: "cuda" is the local rank's GPU), or a one-line ValueError; none joined yet."""
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1):
        raise ValueError(f"tp must be an integer >= 1 (the number of processes the target is sharded over), got {tp!r}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {str(device)!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    backend = BACKENDS.get(device.type)
    if backend is None:
        raise ValueError(f"tp={tp} on {device.type}: tensor parallelism runs on cuda (NCCL) or cpu (gloo)")
    if dist.is_initialized():
        rank, world, local_rank = dist.get_rank(), dist.get_world_size(), env_int("LOCAL_RANK")
        if dist.get_backend() != backend:
            raise ValueError(f"tp={tp} on {device.type} needs the {backend} backend, but this process group "
                             f"runs {dist.get_backend()}")
    else:
        rank, world, local_rank = env_int("RANK"), env_int("WORLD_SIZE"), env_int("LOCAL_RANK")
        if rank is None or world is None:
            raise ValueError(f"tp={tp} needs one process per rank: launch with torchrun --nproc-per-node {tp} "
                             "(RANK and WORLD_SIZE are not set)")
    if world != tp:
        raise ValueError(f"tp={tp} but {world} processes were launched (WORLD_SIZE); they must be equal")
    join_timeout()
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"tp={tp} on cuda runs over NCCL, which needs GPUs, and CUDA is not available on "
                             "this machine; use --device cpu (gloo)")
        count = torch.cuda.device_count()
        if device.index is None:  # each process its own GPU
            # checked against the processes on this machine, so that every rank stops with the same message
            local = env_int("LOCAL_WORLD_SIZE") or world
            if local > count:
                raise ValueError(f"tp={tp}: {local} processes on this machine need a GPU each, but it has {count}")
            device = torch.device("cuda", local_rank if local_rank is not None else rank)
        elif device.index >= count:
            raise ValueError(f"tp={tp}: rank {rank} was given {device}, but this machine has {count} GPU(s)")
    return world, device


def join(device):
    """This process's TensorParallel: the default group (joined if not yet), under NCCL a gloo one for host values."""
    global host_group
    # Reference cycles holding the collectives' objects, destroyed in the interpreter's teardown, can
    # abort the process (std::terminate in gloo) after its work is done; collected before, they do not.
    atexit.unregister(gc.collect)  # registered once, however often the process joins
    atexit.register(gc.collect)
    backend = BACKENDS[device.type]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        seconds = join_timeout()
        try:
            dist.init_process_group(backend, timeout=timedelta(seconds=seconds), **kwargs)
        except dist.DistError as error:  # the store's own words say how many ranks came
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(f"tp: rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} waited "
                             f"{seconds:g} s (MINISPEC_TP_TIMEOUT) at {os.environ.get('MASTER_ADDR')}:"
                             f"{os.environ.get('MASTER_PORT')} for ranks that did not join: {reason}") from None
    if backend == "gloo":
        return TensorParallel(dist.group.WORLD)
    if host_group is None:
        host_group = dist.new_group(backend="gloo")
    return TensorParallel(dist.group.WORLD, host_group)


host_group = None


def leave():
    """Leave the process group after a barrier, so that no rank closes its connections while a peer receives."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def lost_peer(error):
    """Whether `error` is a collective's failure because another rank has gone (which that rank reports)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        sign in text for sign in ("closed by peer", "reset by peer", "Broken pipe", "remote worker"))
