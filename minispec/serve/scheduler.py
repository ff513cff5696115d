"""The server's one decoding loop: a thread that holds the models for the server's life and runs the engine over
requests as they arrive, each in a free cache row from the next step until it ends, fails, or its client goes;
each row computes as it would alone (minispec.generate's output). A Job gets a News per step, or a Failed."""

import ctypes
import logging
import threading
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import NamedTuple

from .. import api
from ..decoding import engine
from ..decoding.drafters import make_drafter
from ..decoding.prefix import PrefixCache

MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere

log = logging.getLogger("minispec.serve")


class QueueFull(Exception):
    """The waiting queue holds --max-queue requests already."""


class ShuttingDown(Exception):
    """The server is stopping: it takes no new requests. Its message says why."""


@dataclass
class Outcome:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (EOS, a stop token or string) or "length" (max_tokens)
    stats: dict
    logprobs: list | None = None  # every token's TokenLogprob, when the request asks


class News(NamedTuple):
    """A step's text, its tokens' TokenLogprobs (None unless asked), and at the job's last step its Outcome."""
    piece: str
    logprobs: list | None
    outcome: Outcome | None = None


class Failed(NamedTuple):
    """A job's end without an outcome: the HTTP status and why."""
    status: int
    message: str


class Job:
    """One request in the engine; `deliver(event)`, called on the scheduler's thread, must be thread-safe."""

    def __init__(self, request, deliver):
        self.request, self.deliver = request, deliver
        self.text = api.TextStream(request)
        self.cancelled = False  # its client went, or it failed: its row leaves at the next step

    def advance(self, tokens, logprobs, generation):
        """A step's news (an engine.Update's), read before the engine's next step (the text pieces depend on it)."""
        piece = self.text.push(tokens)
        if generation is None:
            if piece or logprobs:
                self.deliver(News(piece, logprobs))
            return
        tokens, text, stop = generation.tokens, generation.text, self.request.stop
        stopped = stop.text_end is not None or tokens[-1] in stop.token_ids
        outcome = Outcome(text, len(tokens), "stop" if stopped else "length", generation.stats, generation.logprobs)
        self.deliver(News(piece + self.text.rest(text), logprobs, outcome))

    def fail(self, status, message):
        self.cancelled = True
        self.deliver(Failed(status, message))


class Scheduler:
    """Owns the target and draft, their caches sized once for `rows` requests of up to `max_length` positions,
    and decodes every request in one engine.decode loop on its own thread. `prefix_cache_mb`: MiB of earlier
    requests' keys and values (0: none); `learner`: a heads/learn.py Learner whose head is `draft`."""

    def __init__(self, target, draft, gamma="auto", rows=4, max_model_len=None, max_waiting=64, tree="auto",
                 prefix_cache_mb=512, learner=None):
        self.settings = api.Settings(draft=draft, gamma=gamma, tree=tree)  # every request's, with its own fields
        self.target, self.rows, self.max_waiting, self.learner = target, rows, max_waiting, learner
        self.prefixes = PrefixCache(prefix_cache_mb) if prefix_cache_mb else None
        draft_model = make_drafter(draft, target).model if self.settings.drafting else None  # an int8/int4 copy once
        self.models = [target] + ([draft_model] if draft_model is not None else [])
        self.max_length = checked_length(self.models, max_model_len)
        self.max_text = text_bound(target.tokenizer, self.max_length)
        for model in self.models:
            api.check_memory(model, rows, self.max_length, remedy="lower --batch-size or --max-model-len")
            model.ensure_caches(rows, self.max_length)
            model.prepare_batch(rows, self.max_length)
        self.waiting = deque()
        self.running = {}  # engine index -> Job, for the jobs in the batch
        self.live = set()  # every job not ended, failed or cancelled: what a stop must not leave waiting
        self.indices = count()
        self.changed = threading.Condition()  # guards `waiting`, `live` and `stopping`
        self.stopping = False
        self.failure = None  # why the server stops on its own (a tensor-parallel group's fault), if it does
        self.group = None  # group.Leader, on a tensor-parallel target
        self.thread = threading.Thread(target=self.serve, name="minispec-scheduler", daemon=True)

    def start(self):
        api.release_openmp_workers()  # the loading thread's: from now on the scheduler's thread decodes
        self.thread.start()

    def submit(self, *jobs):
        """Queue a request's jobs for the next free rows, all or none (any thread)."""
        with self.changed:
            if self.stopping:
                raise ShuttingDown(self.failure or "the server is shutting down")
            if len(self.waiting) + len(jobs) > self.max_waiting:
                raise QueueFull
            self.waiting.extend(jobs)
            self.live.update(jobs)
            self.changed.notify()

    def cancel(self, *jobs):
        """End jobs (any thread): a waiting one leaves the queue now, a running one its row at the next step."""
        with self.changed:
            for job in jobs:
                job.cancelled = True
                self.live.discard(job)
                if job in self.waiting:
                    self.waiting.remove(job)

    def drain(self, timeout):
        """Shutting down: take no new jobs; those under way have `timeout` seconds to end, then fail (503)."""
        with self.changed:
            self.stopping = True
            self.changed.notify()
        deadline = threading.Timer(timeout, self.close)
        deadline.daemon = True
        deadline.start()

    def stop(self, timeout=None):
        """Fail (503) the jobs not ended yet (uvicorn's grace period is over), wait for the thread at most
        `timeout` seconds, and stop a tensor-parallel group's other ranks."""
        self.close()
        if self.thread.is_alive():
            self.thread.join(timeout)
        if self.group is not None:
            self.group.stop()

    def close(self, failure=None):
        """No new jobs, and every job not ended fails (503, `failure` the reason if given)."""
        with self.changed:
            self.stopping = True
            self.failure = self.failure or failure
            for job in self.live:
                job.fail(503, self.failure or "the server is shutting down")
            self.live.clear()
            self.waiting.clear()
            self.changed.notify()

    @property
    def load(self):
        group = {} if self.group is None else {"tp": self.group.state}
        learning = {} if self.learner is None else {"learning": self.learner.report()}
        return {"running": len(self.running), "waiting": len(self.waiting), **group, **learning}

    def serve(self):
        try:
            with api.exclusive(*self.models):  # for the server's life: nothing else touches their caches
                self.decode()
        except Exception:
            log.exception("the scheduler failed")
        finally:  # however the thread ends, no request is left waiting for it
            self.close()
            if self.learner is not None:  # on this thread: no training step is under way
                self.learner.save()

    def decode(self):
        """Run the engine until the server stops; when it fails, the batch's requests fail (their state unknown)
        and the others go on in a new batch."""
        while True:
            try:
                for update in engine.decode(self.target, self, self.rows, self.cancelled, self.prefixes):
                    self.advance(update)
                return
            except ShuttingDown:  # the tensor-parallel group failed, and close() has failed every job
                return
            except Exception:
                log.exception("decoding failed; failing the %d request(s) in the batch", len(self.running))
                for job in self.running.values():
                    self.forget(job)
                    job.fail(500, "the server failed while decoding this request (logged)")
                self.running.clear()

    def take(self, free, wait):
        """engine.decode's source: up to `free` waiting jobs as (index, request); while the batch is
        empty (`wait`), blocks until one comes or the server stops. A learning head trains here, between steps."""
        if self.learner is not None:
            self.learner.between_steps(idle=lambda: wait and not self.waiting and not self.stopping)
        with self.changed:
            if wait and not self.waiting and MALLOC_TRIM is not None:
                MALLOC_TRIM(0)  # idle: the pages the batch's requests freed go back to the system
            while wait and not self.waiting and not self.stopping:
                self.changed.wait()
            jobs = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        taken = {next(self.indices): job for job in jobs}
        self.running.update(taken)
        if self.learner is not None:  # the head's states at the request's tokens, which the target computes
            for job in jobs:
                job.request.on_states = self.learner.record
        return [(index, job.request) for index, job in taken.items()]

    def forget(self, job):
        with self.changed:
            self.live.discard(job)

    def cancelled(self, index):
        """engine.decode's check before each step: a cancelled job's row leaves now."""
        job = self.running[index]
        gone = job.cancelled  # read once: a handler may set it meanwhile
        if gone:
            del self.running[index]
            if self.learner is not None:
                self.learner.finish(index)
        return gone

    def advance(self, update):
        job = self.running[update.index]
        if update.generation is not None:
            del self.running[update.index]
            self.forget(job)
            if self.learner is not None:
                self.learner.finish(update.index, update.generation.stats)
        if job.cancelled:
            return  # nobody waits for its news; its row leaves before the next step
        try:
            job.advance(update.tokens, update.logprobs, update.generation)
        except Exception:  # this request's own processing: it fails alone
            log.exception("request %d failed", update.index)
            self.forget(job)
            job.fail(500, "the server failed while processing this request (logged)")


def text_bound(tokenizer, max_length):
    """The most characters a text of `max_length` tokens can have: the longest token's each, 4x for a normalizer
    that composes characters (None: no tokenizer)."""
    return None if tokenizer is None else 4 * max(map(len, tokenizer.id_to_token.values())) * max_length


def checked_length(models, max_model_len):
    """The positions a request may fill: --max-model-len, or the shortest of the models' contexts."""
    model = min((m for m in models if m.context_length is not None), key=lambda m: m.context_length, default=None)
    if max_model_len is None and model is None:
        raise ValueError(f"--max-model-len is needed: {models[0].name} has no context limit")
    if max_model_len is None:
        return model.context_length
    if model is not None and max_model_len > model.context_length:
        raise ValueError(f"--max-model-len {max_model_len} exceeds {model.name}'s context of {model.context_length}")
    return max_model_len
