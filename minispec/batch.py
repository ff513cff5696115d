"""Many requests at once: a batch whose rows each keep their own length in the static KV caches, with
continuous batching (a finished request's cache row goes to the next waiting request), decoded plainly
or speculatively: with a model-free drafter (lookup, ngram) per row, or a draft model that keeps a
cache row per request too and guesses for all rows in the same forwards.

    every step:  each row verifies its guesses against its logits     Algorithm 1, the row's own
                 (no guesses: picks its next token)                   sampling and generator
                 rows that end (EOS, stop, max tokens) leave; waiting requests take their cache rows
                 each row guesses (its own policy); one target forward over all rows, each row's
                 tokens at its own positions, rows with fewer guesses padded to the widest

T5 runs its encoder once per request, into the request's row of the cross-attention memory.
A row's numbers do not depend on the other rows or on the padding (row-invariant forwards,
models/base.py), so each request's output is what it gives decoded alone: the same tokens when greedy,
and when sampling the same tokens for the same seed (with a fixed γ: "auto" may choose other
lengths in a batch, whose forwards cost otherwise; the distribution is the target's either way).
"""

import time
from collections import deque

import torch

from .drafters import confidence
from .policy import GAMMA_MAX
from .sampling import adjust, sample
from .speculative import accept_and_resample, accept_greedy, one_hot, record_step


class Row:
    """A request in the batch: its settings, its output so far, and its cache row's length."""

    def __init__(self, index, request):
        self.index, self.request = index, request
        self.drafter, self.policy = request.drafter, request.policy
        self.generator = torch.Generator(device=request.target.device).manual_seed(request.seed)
        self.tokens = []
        self.logits = None  # [k + 1, vocab]: the target's logits at the row's last k guesses and one beyond
        self.drafts, self.q = None, None  # the k guesses those logits verify, and the q they came from
        self.fresh = True  # admitted since the last verification: its logits are its prefill's
        self.length = 0  # positions its cache row holds (its last token is not among them: it is fed next)
        self.stats = {"target_calls": 1, "first_call_tokens": 1, "seed": request.seed}
        if self.drafter:
            self.stats.update(target_calls=0, proposed=0, accepted=0, verified=0,
                              accepted_lengths=[0] * (self.policy.k_max + 1))
        self.started = self.step_started = time.perf_counter()
        self.draft_seconds = 0.0
        # with a draft model (BatchDraft): its logits for the next guess, its cache row's length, the
        # accepted tokens it has not seen, and how many of the last guesses went through it
        self.draft_model = False
        self.draft_logits, self.draft_length, self.draft_unseen, self.draft_fed, self.draft_calls = None, 0, [], 0, 0

    def guess(self):
        """The row's guesses for its next verification (none without a drafter)."""
        if not self.drafter:
            return []
        start = time.perf_counter()
        k = min(self.policy.guesses(), self.request.max_new_tokens - len(self.tokens) - 1)
        self.drafts, self.q = self.drafter.propose(k, self.request.sampling, self.generator, self.policy.keep_guessing)
        self.draft_seconds = time.perf_counter() - start
        return self.drafts.tolist()

    def verify(self):
        """Algorithm 1 on the row's logits: (n accepted guesses, the target's token), on the device."""
        sampling = self.request.sampling
        if not self.drafter:  # plain decoding, drawn as generate.autoregressive draws it
            token = self.logits.argmax(-1) if sampling.greedy else sample(adjust(self.logits, sampling), self.generator)
            return torch.zeros(1, dtype=torch.long, device=token.device), token
        if sampling.greedy and self.request.lenience == 1:
            return accept_greedy(self.logits, self.drafts)
        p = adjust(self.logits, sampling)
        q = one_hot(self.drafts, p.shape[-1]) if self.q is None else self.q
        greedy_p = self.logits.float().softmax(-1) if sampling.greedy else None
        return accept_and_resample(p, q, self.drafts, self.request.lenience, self.generator, greedy_p)


def kv_cache_bytes_per_row(model, max_seq_len):
    """Bytes one cache row of `max_seq_len` positions takes (every layer's keys and values)."""
    model.ensure_caches(1, max_seq_len)  # the caches' shapes give the bytes per position
    return model.kv_bytes_per_position() * model.cache_length_for(max_seq_len)


@torch.inference_mode()
def decode_batch(target, requests, rows):
    """Decode checked requests (generate.Request, all with the same kind of drafter, or none), at most
    `rows` at a time. Yields (request index, new tokens) as they come; returns each request's (tokens,
    stats)."""
    waiting = deque(enumerate(requests))
    batch = []  # batch[i] lives in cache row i
    drafter = requests[0].drafter
    draft = BatchDraft(drafter.model) if drafter and drafter.model is not None else None
    results = [None] * len(requests)

    def admit(slot):
        """The request's prefill, which verifies its first guesses as a lone request's does."""
        index, request = waiting.popleft()
        row = Row(index, request)
        prompt = request.prompt_ids
        if row.drafter:
            if draft is None:
                row.drafter.start(prompt, request.max_new_tokens, request.sampling)
            row.policy.start(target, row.drafter, prompt)
        if draft is not None:
            draft.admit(slot, row)
            guesses = draft.guess([row], [row], first_row=slot)[0]
        else:
            guesses = row.guess()
        start = target.encode_row(slot, prompt)  # T5: the encoder's run for this request, into its row
        tokens = torch.cat([start, torch.tensor([guesses], dtype=torch.long, device=prompt.device)], dim=1)
        row.logits = target.prefill_row(slot, tokens, logits_for=len(guesses) + 1)[0]
        row.length = tokens.shape[1]
        return row

    while waiting and len(batch) < rows:
        batch.append(admit(len(batch)))
    while batch:
        verdicts = [row.verify() for row in batch]
        host = torch.cat([torch.cat([n, t]) for n, t in verdicts]).view(-1, 2).tolist()  # the step's one sync
        finished = []
        for slot, (row, (n, t)) in enumerate(zip(batch, host)):
            finished += [slot] if step_done(row, n, t) else []
            yield row.index, row.new_tokens
        for slot in finished:
            row = batch[slot]
            row.stats.update(seconds=time.perf_counter() - row.started)
            if row.drafter:
                finish_stats(row)
            results[row.index] = row.tokens, row.stats
            batch[slot] = admit(slot) if waiting else None  # a waiting request takes the cache row
        while None in batch:  # the last row moves into a gap
            hole, last = batch.index(None), len(batch) - 1
            if batch[last] is not None and hole < last:
                for model in (target, draft and draft.model):
                    if model is not None:
                        model.move_row(last, hole)
                batch[hole] = batch[last]
            batch.pop()
        if batch:
            forward_rows(target, batch, draft)
    return results


def step_done(row, n, t):
    """Emit a verified step's tokens: the accepted guesses and the target's token, up to a stop. True
    when the request has ended."""
    k = 0 if row.drafts is None else len(row.drafts)
    guesses = row.drafts.tolist() if k else []
    new_tokens, stopped = row.request.stop.cut(guesses[:n] + [t])
    row.new_tokens = new_tokens
    if row.drafter:
        now = time.perf_counter()
        row.policy.observe(k, n, new_tokens, row.draft_seconds, None if row.fresh else now - row.step_started)
        record_step(row.stats, guesses, n, new_tokens)
        row.step_started = now
        row.length -= k - n  # the rejected guesses leave its cache; t is fed next
        if not stopped and not row.draft_model:  # a model-free drafter
            row.drafter.accept(new_tokens, torch.tensor(guesses[:n] + [t], device=row.logits.device))
        elif not stopped:  # the draft's cache keeps the guesses it saw that were accepted
            keep = min(n, row.draft_fed)
            row.draft_length -= row.draft_fed - keep
            row.draft_unseen += (guesses[:n] + [t])[keep:]
            row.draft_logits = None
    row.fresh = False
    row.tokens += new_tokens
    return stopped or len(row.tokens) >= row.request.max_new_tokens


def finish_stats(row):
    stats = row.stats
    stats["draft_calls"] = row.draft_calls if row.draft_model else row.drafter.calls
    stats["acceptance_rate"] = stats["accepted"] / stats["verified"] if stats["verified"] else 0.0
    stats["tokens_per_target_call"] = len(row.tokens) / max(stats["target_calls"], 1)
    stats.update(row.policy.finish())


def forward_rows(target, batch, draft):
    """One target forward over every row that has a token to feed: its last token and its guesses, at
    its own positions, padded to the widest row (padding lands past the row's length, where the next
    forward overwrites it). Rows admitted this step already have their prefill's logits."""
    room = min(target.cache_max_seq_len - row.length for row in batch)  # every row's feed, padding included
    guessing = [row for row in batch if not row.fresh]
    if draft is not None:
        guessed = dict(zip(map(id, guessing), draft.guess(batch, guessing)))
    feeds = []
    for row in batch:
        if row.fresh:  # admitted this step: a placeholder, whose logits are not read
            feeds.append([0])
            continue
        guesses = (guessed[id(row)] if draft is not None else row.guess())[:room - 1]
        if row.drafter:
            row.drafts = row.drafts[:len(guesses)]
            row.q = None if row.q is None else row.q[:len(guesses)]
        feeds.append([row.tokens[-1]] + guesses)
    width = max(map(len, feeds))
    tokens = torch.tensor([feed + feed[-1:] * (width - len(feed)) for feed in feeds], device=target.device)
    logits = target.decode_rows(tokens, [row.length for row in batch])
    for slot, (row, feed) in enumerate(zip(batch, feeds)):
        if row.fresh:
            continue
        row.logits = logits[slot, :len(feed)]
        row.length += len(feed)
        if not row.drafter:  # speculative rows count their calls per verified step (record_step)
            row.stats["target_calls"] += 1


CATCH_UP = GAMMA_MAX + 1  # tokens a catch-up forward feeds a row at most


class BatchDraft:
    """A draft model guessing for a batch: a cache row per request, each at its own length, and the
    rows' guesses made in the same forwards (a row not guessing is fed placeholders past its length).
    Per row it does what drafters.ModelDrafter does for a lone request, in the same order, so a row's
    guesses and random draws are the lone request's."""

    def __init__(self, model):
        self.model = model

    def admit(self, slot, row):
        start = self.model.encode_row(slot, row.request.prompt_ids.to(self.model.device))
        row.draft_logits = self.model.prefill_row(slot, start, logits_for=1)[0, -1]
        row.draft_model, row.draft_length, row.draft_unseen, row.draft_calls = True, start.shape[1], [], 1

    def feed(self, rows, feeds, first_row):
        """One draft forward over the cache rows from `first_row`: feeds[i] (host ids, maybe none) at
        rows[i]'s length. Sets the fed rows' logits for their next guess and advances their lengths."""
        width = max(map(len, feeds))
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in feeds], device=self.model.device)
        logits = self.model.decode_rows(tokens, [row.draft_length for row in rows], first_row)
        for i, (row, f) in enumerate(zip(rows, feeds)):
            if f:
                row.draft_logits = logits[i, len(f) - 1]
                row.draft_length += len(f)
                row.draft_calls += 1

    def guess(self, rows, guessing, first_row=0):
        """The guesses (host ids) of each row of `guessing`, its policy choosing how many; `rows` are
        the cache rows from `first_row` on, in order. Sets row.drafts and row.q."""
        start = time.perf_counter()
        wanted = {id(row): min(row.policy.guesses(), row.request.max_new_tokens - len(row.tokens) - 1)
                  for row in guessing}
        # Catch up on the tokens accepted since each guessing row last went through the draft, a few at
        # a time: the rows fed fewer get placeholders, which must stay within their cache rows.
        while any(row.draft_unseen and wanted.get(id(row)) for row in rows):
            feeds = [row.draft_unseen[:CATCH_UP] if wanted.get(id(row)) else [] for row in rows]
            self.feed(rows, feeds, first_row)
            for row, f in zip(rows, feeds):
                row.draft_unseen = row.draft_unseen[len(f):]
        guesses, qs = {id(row): [] for row in guessing}, {id(row): [] for row in guessing}
        for row in guessing:
            row.draft_fed = 0
        going = [row for row in guessing if wanted[id(row)]]
        while going:
            still = []
            for row in going:
                sampling, logits, q = row.request.sampling, row.draft_logits, qs[id(row)]
                if sampling.greedy:
                    guess = logits.argmax(-1)
                else:
                    q.append(adjust(logits, sampling))
                    guess = sample(q[-1], row.generator)
                guesses[id(row)].append(guess)
                keep = row.policy.keep_guessing
                if keep and not keep(len(guesses[id(row)]), confidence(logits, q, guess, sampling)):
                    continue
                if len(guesses[id(row)]) < wanted[id(row)]:  # the last guess is never fed
                    still.append(row)
            going = still
            if going:
                self.feed(rows, [[int(guesses[id(row)][-1])] if row in going else [] for row in rows], first_row)
                for row in going:
                    row.draft_fed += 1
        seconds = time.perf_counter() - start
        for row in guessing:
            g = guesses[id(row)]
            row.drafts = torch.stack(g) if g else torch.zeros(0, dtype=torch.long, device=self.model.device)
            row.q = torch.stack(qs[id(row)]) if qs[id(row)] else None
            row.draft_seconds = seconds / len(guessing)
        return [row.drafts.tolist() for row in guessing]
