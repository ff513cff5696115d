"""The server on a tensor-parallel target: rank 0 runs the HTTP side, the scheduler and every drafter; the other
ranks run, in lockstep, each call rank 0 makes on the sharded models (MIRRORED), broadcast as a Call record
before it runs. What rank 0 decides on the host (admissions, drafts, verdicts, draws) crosses nothing.

Faults: every collective waits at most `timeout` seconds (--tp-timeout) and an idle rank 0 beats every third of
that, so a lost rank is found within 4/3 `timeout`; followers count beats in the group's store, so that rank 0
can name the lost ranks. Rank 0 then fails every request (503) and exits."""

import logging
import os
import signal
import sys
import threading
import time
from contextlib import suppress
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from ..loading import parallel
from ..models.tp import TensorParallel
from .scheduler import ShuttingDown

log = logging.getLogger("minispec.serve")

# The calls on a model that run its forwards or change its caches: everything its shards must follow.
MIRRORED = ("prefill", "decode", "decode_rows", "rollback", "move_row", "keep", "encode_row", "prepare_batch",
            "ensure_caches")
FORWARDS = ("prefill", "decode", "decode_rows", "encode_row")  # the mirrored calls that run a sharded forward
STORE_BEAT_SECONDS = 0.5  # how often a follower counts itself alive in the store
BEATS = "minispec/serve/beats/"  # + a follower's rank: the store's key of its beats


class Call(NamedTuple):
    """`method` of sharded model `model` with these arguments (tensors on the CPU), or "beat" or "stop"."""
    method: str
    model: int = 0
    args: tuple = ()
    kwargs: dict = {}


class Deciding(TensorParallel):
    """Rank 0's place in a served group: it alone decides what the engine would otherwise agree on with the
    other ranks (seeds, profiles, timings): they do not run the engine."""

    def __init__(self, tp):
        self.__dict__.update(tp.__dict__)

    def from_first(self, *values):
        return list(values)

    def first_numbers(self, numbers):
        return list(numbers)


def sharded(models):
    return [model for model in models if model.tp is not None]


def bound_collectives(tp, timeout):
    """Once every rank is ready (loading may take long), every collective fails after `timeout` seconds."""
    dist.barrier(group=tp.host_group)
    for group in {tp.group, tp.host_group}:
        distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), group)


def moved(value, device):
    """A call's arguments with every tensor on `device` (records travel with their tensors on the CPU)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a Feed
        return type(value)(*(moved(part, device) for part in value))
    if isinstance(value, (list, tuple)):
        return type(value)(moved(part, device) for part in value)
    if isinstance(value, dict):
        return {key: moved(part, device) for key, part in value.items()}
    return value


class Leader:
    """Rank 0: mirrors the scheduler's calls on its sharded models to the other ranks, beats while idle, and on a
    fault closes the scheduler and calls `on_failure(message)`."""

    def __init__(self, scheduler, timeout, on_failure):
        self.scheduler, self.timeout, self.on_failure = scheduler, timeout, on_failure
        self.models = sharded(scheduler.models)
        self.tp = self.models[0].tp
        self.lock = threading.Lock()  # one record and its call at a time, in the order the followers see
        self.inside = False  # within a mirrored call (prefill calls decode): nested calls are not sent again
        self.sent = time.monotonic()
        self.failure = None  # the fault's message, once the group has failed
        self.stopped = False  # the followers have been told to stop
        self.broadcasts = {"calls": 0, "forwards": 0, "seconds": 0.0}  # the calls mirrored, for /health
        deciding = Deciding(self.tp)
        for index, model in enumerate(self.models):
            model.tp = deciding
            for name in MIRRORED:
                setattr(model, name, self.mirror(index, getattr(model, name)))
        scheduler.group = self
        bound_collectives(self.tp, timeout)
        threading.Thread(target=self.beat, name="minispec-tp-beat", daemon=True).start()

    @property
    def state(self):
        return {"ranks": self.tp.world, "state": "ok" if self.failure is None else f"failed: {self.failure}",
                "broadcasts": dict(self.broadcasts)}

    def mirror(self, index, method):
        def call(*args, **kwargs):
            if self.inside:
                return method(*args, **kwargs)
            with self.lock:
                self.inside = True
                try:
                    self.send(Call(method.__name__, index, moved(args, "cpu"), moved(kwargs, "cpu")))
                    return method(*args, **kwargs)
                except Exception as error:
                    if not collective_failed(error):
                        raise
                    self.fail(error)
                    raise ShuttingDown(self.failure) from error
                finally:
                    self.inside = False
        return call

    def send(self, record):
        if self.failure is not None:
            raise ShuttingDown(self.failure)
        start = time.monotonic()
        dist.broadcast_object_list([record], src=self.tp.first, group=self.tp.host_group)
        self.sent = time.monotonic()
        if record.method not in ("beat", "stop"):
            self.broadcasts["calls"] += 1
            self.broadcasts["forwards"] += record.method in FORWARDS
            self.broadcasts["seconds"] += self.sent - start

    def beat(self):
        """A beat whenever no call has gone for a third of the timeout, so that a lost follower is found idle too."""
        while self.failure is None and not self.stopped:
            time.sleep(self.timeout / 3)
            with self.lock:
                if time.monotonic() - self.sent >= self.timeout / 3 and self.failure is None and not self.stopped:
                    try:
                        self.send(Call("beat"))
                    except Exception as error:
                        self.fail(error)

    def fail(self, error):
        """The group has lost a rank: no more collectives; every request fails (503), and so do new ones."""
        if self.failure is not None:
            return
        self.failure = f"tp: {lost_ranks(self.tp)} (the collective failed: {first_line(error)})"
        log.error("%s; stopping the server", self.failure)
        self.scheduler.close(self.failure)
        self.on_failure(self.failure)

    def stop(self):
        """The followers stop too (after a fault, or while the scheduler is still in a call, their wait ends them)."""
        if self.failure is None and self.lock.acquire(timeout=self.timeout):
            try:
                self.send(Call("stop"))
                self.stopped = True
            finally:
                self.lock.release()
            parallel.leave()


def lost_ranks(tp):
    """Which ranks stopped counting their beats in the store (dead or stalled), in words."""
    store = distributed_c10d._get_default_store()
    ranks = range(1, tp.world)
    try:
        before = [store.add(f"{BEATS}{rank}", 0) for rank in ranks]
        time.sleep(3 * STORE_BEAT_SECONDS)
        after = [store.add(f"{BEATS}{rank}", 0) for rank in ranks]
    except Exception as error:  # the store went with rank 0's launcher
        return f"a rank was lost (the group's store failed too: {first_line(error)})"
    lost = [rank for rank, old, new in zip(ranks, before, after) if old == new]
    if not lost:
        return "a collective failed while every rank still runs"
    return f"rank{'s' * (len(lost) > 1)} {', '.join(map(str, lost))} of {tp.world} stopped responding (died or stalled)"


def collective_failed(error):
    """Whether `error` is a collective's failure: a rank gone, or one that did not answer in time."""
    return parallel.lost_peer(error) or "timed out" in str(error).lower() or "timeout" in str(error).lower()


def first_line(error):
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def follow(models, timeout):
    """A follower's life: run each call rank 0 mirrors, until it says stop (0) or the group fails (1)."""
    models = sharded(models)
    tp, device = models[0].tp, models[0].device
    for sig in (signal.SIGINT, signal.SIGTERM):  # torchrun's or a terminal's, sent to every rank: rank 0 decides
        signal.signal(sig, signal.SIG_IGN)
    bound_collectives(tp, timeout)
    stopped = threading.Event()
    threading.Thread(target=count_beats, args=(tp.rank, stopped), name="minispec-tp-beat", daemon=True).start()
    with torch.inference_mode():  # as the engine's calls on rank 0
        while True:
            record = [None]
            try:
                dist.broadcast_object_list(record, src=tp.first, group=tp.host_group)
                call = record[0]
                if call.method == "stop":
                    break
                if call.method != "beat":
                    getattr(models[call.model], call.method)(*moved(call.args, device), **moved(call.kwargs, device))
            except Exception as error:
                if not collective_failed(error):  # failed alike on rank 0, which fails its batch and goes on
                    log.exception("rank %d: a call rank 0 mirrored failed", tp.rank)
                    continue
                print(f"error: tp: rank {tp.rank} lost rank 0 or a peer: {first_line(error)}", file=sys.stderr,
                      flush=True)
                os._exit(1)  # not a normal exit: the group's teardown would wait for ranks that are gone
    stopped.set()  # before rank 0, which holds the store, ends
    parallel.leave()
    return 0


def count_beats(rank, stopped):
    """A follower's sign of life in the store, for rank 0 to read when a collective fails."""
    store = distributed_c10d._get_default_store()
    with suppress(Exception):  # the store has gone, with rank 0's launcher: the main loop's wait fails soon too
        while not stopped.wait(STORE_BEAT_SECONDS):
            store.add(f"{BEATS}{rank}", 1)
