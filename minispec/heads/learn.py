"""A draft head that keeps learning while the server uses it (online distillation, Liu et al. 2024): a float
copy trains on the target's states of recent requests between the engine's steps, its weights copied into
the drafting head after each step, so a step's guesses and q come from one set of weights (exact)."""

import logging
import time
from collections import deque

import torch

from ..loading.weights import read_config
from . import load_draft_head, save_draft_head
from .training import eagle_loss, medusa_loss, padded_batch, training, update

log = logging.getLogger("minispec.serve")

# EAGLE and Medusa heads read the last states, which give the target's p (the label); EAGLE-3's do not
LOSSES = {"eagle": eagle_loss, "medusa": medusa_loss}
SEQUENCE = 1024  # a request's last tokens kept: a one-layer head learns from recent context
TOKENS_PER_BATCH = 512
PENDING = 1024  # requests under way whose states are kept (more: a lost request's are dropped)


class Learner:
    """Trains the head in folder `source` for `target` on serving's states, saving into folder `out`."""

    def __init__(self, target, source, out, share=0.25, buffer_mb=256, lr=1e-3, passes=4, window=100, seed=0):
        if target.quantization is not None or target.dtype == torch.float16 or target.tp is not None:
            # labels need the float output head; float16 gradients overflow; shards' heads would differ
            raise ValueError("--learn-head trains on a float32 or bfloat16 target, whole in one process: load it "
                             "without --quantize, float16 or --tp")
        self.head = load_draft_head(source, target, quantize=None)  # float: its weights change as it learns
        if self.head.kind not in LOSSES:
            raise ValueError(f"{source}: an {self.head.kind} head does not learn while serving (eagle and medusa "
                             "heads do: their states give the target's distribution)")
        self.student = load_draft_head(source, target, quantize=None)
        for module in self.student.modules():
            if getattr(module, "packed", False):
                module.packed = False  # the packed products have no backward
        self.hf, self.out, self.share, self.passes, self.window = read_config(source), out, share, passes, window
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=lr, betas=(0.9, 0.95))
        self.generator = torch.Generator().manual_seed(seed)
        self.budget = int(buffer_mb * 2**20)
        self.pending, self.kept, self.bytes = {}, deque(), 0
        self.credit = self.steps = 0  # tokens still to learn from; training steps taken
        self.started, self.seconds = time.monotonic(), 0.0
        self.counts = [0, 0, 0]  # this window's requests, accepted and verified guesses
        self.rates = deque(maxlen=100)  # the last windows' acceptance rates; the first window's stays
        self.first = None

    def record(self, index, tokens, states):
        """Request `index`'s on_states: the tokens the target kept this step and its states at them."""
        pieces = self.pending.setdefault(index, deque())
        pieces.append((tokens.cpu(), states.cpu()))
        while sum(len(t) for t, _ in pieces) - len(pieces[0][0]) >= SEQUENCE:
            pieces.popleft()
        if len(self.pending) > PENDING:
            self.pending.pop(next(iter(self.pending)))

    def finish(self, index, stats=None):
        """Request `index` ended (stats None: cancelled): its sequence is kept."""
        pieces = self.pending.pop(index, None)
        if pieces:
            self.keep(torch.cat([t for t, _ in pieces]), torch.cat([s for _, s in pieces]))
        if stats is not None and "verified" in stats:
            self.counts = [self.counts[0] + 1, self.counts[1] + stats["accepted"], self.counts[2] + stats["verified"]]
            if self.counts[0] == self.window:
                self.rates.append(self.counts[1] / max(self.counts[2], 1))
                self.first = self.rates[0] if self.first is None else self.first
                self.counts = [0, 0, 0]
                log.info("learning head: acceptance %.3f over the last %d requests (first window %.3f), %d training "
                         "steps", self.rates[-1], self.window, self.first, self.steps)

    def keep(self, tokens, states):
        per_token = tokens.element_size() + states.shape[-1] * states.element_size()
        length = min(SEQUENCE, self.budget // per_token)
        # copies: a cut sequence's whole states would stay alive beside the budget's
        tokens, states = tokens[max(len(tokens) - length, 0):].clone(), states[max(len(states) - length, 0):].clone()
        if len(tokens) < 2:
            return
        self.kept.append((tokens, states))
        self.bytes += len(tokens) * per_token
        self.credit += self.passes * len(tokens)
        while self.bytes > self.budget:
            old, _ = self.kept.popleft()
            self.bytes -= len(old) * per_token

    def between_steps(self, idle):
        """A training step while training has taken at most `share` of the time, more while idle()."""
        if self.credit > 0 and self.seconds <= self.share * (time.monotonic() - self.started):
            self.step()
        while self.credit > 0 and idle():
            self.step()

    def step(self):
        """One step of the float copy on a random batch of kept sequences, then its weights into the head."""
        start, picked, size = time.monotonic(), [], 0
        for i in torch.randperm(len(self.kept), generator=self.generator).tolist():
            picked.append(self.kept[i])
            size += len(self.kept[i][0])
            if size >= TOKENS_PER_BATCH:
                break
        device, every = self.head.target.device, range(len(picked))
        with torch.inference_mode(False), torch.enable_grad():  # the engine decodes in inference mode
            batch = [t.to(device) for t in padded_batch([(t, 0) for t, _ in picked], [s for _, s in picked], every)]
            with training(self.student, batch[0].shape[1] + 32):
                update(self.student, self.optimizer, LOSSES[self.head.kind], batch, self.generator)
            with torch.no_grad():
                for serving, learnt in zip(self.head.parameters(), self.student.parameters()):
                    serving.copy_(learnt)
        self.credit -= size
        self.steps += 1
        self.seconds += time.monotonic() - start

    def report(self):
        """For /health: acceptance per window, training's share of the time and its buffer."""
        rates, (requests, accepted, verified) = list(self.rates), self.counts  # read once: the scheduler writes them
        elapsed = max(time.monotonic() - self.started, 1e-9)
        return {"acceptance": [round(rate, 4) for rate in rates], "first_acceptance": self.first, "window": self.window,
                "this_window": {"requests": requests, "acceptance": round(accepted / max(verified, 1), 4)},
                "training_steps": self.steps, "training_share": round(self.seconds / elapsed, 4),
                "buffer_mb": round(self.bytes / 2**20, 3)}

    def save(self):
        save_draft_head(self.student, self.hf, self.out)
        log.info("learning head: saved into %s after %d training steps", self.out, self.steps)
