"""One rank of tests/test_tp.py's checks, launched by `torchrun --nproc-per-node 2 tests/tp_worker.py
CHECKPOINTS.json`: every rank runs every check (a sharded target is used by all ranks in step), and a
failed assert fails the launch. CHECKPOINTS.json: {"families": {kind: [target dir, draft dir]},
"quantizable": dir} of tiny checkpoints that tests/test_tp.py builds. Each rank prints an "ok ..."
line per check passed and a "seconds ..." line per group of checks (time since its start).

With --fail-rank-1 RUN.PY-ARGS instead: run.py, its target made to fail on rank 1 mid-decoding.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import minispec
from minispec.models import tp as tensor_parallel

PROMPTS = [[5, 17, 33, 8, 5, 17], [9, 3, 41, 3, 9, 3, 41, 3, 9], [60, 2, 7]]
NEW = 20


def agree(value):
    """Every rank's value (a JSON-able object), to check that they are all the same."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def same_on_every_rank(value, what):
    values = agree(value)
    assert all(v == values[0] for v in values), f"{what} differs across ranks: {values}"


def logits_of(model, prompt, steps):
    """Prefill `prompt`, then decode `steps` (a list of token lists), one forward each: their logits."""
    ids = torch.tensor([prompt])
    prefix = model.encode(ids)
    model.ensure_caches(1, 64)
    out = [model.prefill(prefix)]
    for step in steps:
        out.append(model.decode(torch.tensor([step])))
    return torch.cat(out, dim=1)


def check_family(kind, target_dir, draft_dir):
    sharded = minispec.load(target_dir, tp=2)
    whole = minispec.load(target_dir)
    draft = minispec.load(draft_dir)  # replicated: every rank holds it whole
    assert sharded.tp.world == 2 and whole.tp is None

    # Parity with one process: logits within float tolerance, the same greedy tokens.
    steps = [[4], [11, 12, 13], [7]]
    ours, theirs = logits_of(sharded, PROMPTS[0], steps), logits_of(whole, PROMPTS[0], steps)
    scale = theirs.abs().max().item()
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-5 * max(scale, 1.0)), \
        f"{kind}: logits differ by {(ours - theirs).abs().max().item():.3g} (scale {scale:.3g})"
    same_on_every_rank(ours.flatten().tolist(), f"{kind} logits")  # bit for bit
    for prompt in PROMPTS:
        plain = minispec.generate(sharded, prompt, max_new_tokens=NEW, ignore_eos=True)
        assert plain.tokens == minispec.generate(whole, prompt, max_new_tokens=NEW, ignore_eos=True).tokens, kind
        # Speculative greedy = plain greedy under the same TP degree, with a replicated draft model and lookup,
        # at a fixed gamma and with gamma="auto" (which then chooses from rank 0's timings)
        for drafter, gamma in ((draft, 3), (draft, "auto"), ("lookup", "auto")):
            spec = minispec.generate(sharded, prompt, draft=drafter, gamma=gamma, max_new_tokens=NEW, ignore_eos=True)
            assert spec.tokens == plain.tokens, (kind, gamma, spec.tokens, plain.tokens)
            same_on_every_rank(spec.stats["guesses_histogram" if gamma == "auto" else "accepted_lengths"],
                               f"{kind} steps")
    print(f"ok {kind}: parity, speculative = plain", flush=True)

    # Row invariance per rank: a token's logits are the same bits decoded alone or verified among others.
    sharded.ensure_caches(1, 64)
    prefix = sharded.encode(torch.tensor([PROMPTS[1]]))
    sharded.prefill(prefix)
    length = sharded.length
    together = sharded.decode(torch.tensor([[4, 11, 12, 13]]))
    sharded.rollback(length)
    alone = torch.cat([sharded.decode(torch.tensor([[t]])) for t in (4, 11, 12, 13)], dim=1)
    assert torch.equal(together, alone), f"{kind}: a 4-token forward differs from 4 one-token forwards"
    print(f"ok {kind}: row invariance", flush=True)
    return sharded, whole, draft


def check_engine(sharded, whole, draft):
    """Batches, streaming, beam search, sampling, seeds and the sums of more than 2 ranks, on one family."""
    # Batches: each prompt what it gives alone, plainly and speculatively.
    alone = [minispec.generate(sharded, p, max_new_tokens=NEW, ignore_eos=True).tokens for p in PROMPTS]
    for drafter in (None, draft):
        batch = minispec.generate(sharded, PROMPTS, draft=drafter, gamma=3, max_new_tokens=NEW, ignore_eos=True,
                                  batch_size=2)
        assert [out.tokens for out in batch] == alone
    # Streaming: chunks join to the whole output.
    chunks = list(minispec.stream(sharded, PROMPTS[0], draft=draft, gamma="auto", max_new_tokens=NEW, ignore_eos=True))
    assert sum((chunk.tokens for chunk in chunks), []) == alone[0] == chunks[-1].generation.tokens
    # Beam search, plain and speculative: the single process's hypotheses.
    expected = minispec.generate(whole, PROMPTS[1], beams=2, max_new_tokens=8, ignore_eos=True)
    for drafter, extra in ((None, {}), (draft, dict(draft_beams=4, gamma=2))):
        beams = minispec.generate(sharded, PROMPTS[1], beams=2, draft=drafter, max_new_tokens=8, ignore_eos=True,
                                  **extra)
        assert beams.sequences == expected.sequences
        assert max(abs(a - b) for a, b in zip(beams.scores, expected.scores)) < 1e-4
    # Sampling without a seed: rank 0's seed, so every rank draws the same tokens, with gamma="auto" too.
    for drafter in (draft, "ngram"):
        sampled = minispec.generate(sharded, PROMPTS[2], draft=drafter, temperature=1.0, max_new_tokens=NEW,
                                    ignore_eos=True)
        same_on_every_rank([sampled.tokens, sampled.stats["seed"]], "sampled tokens")
    # With a seed, the single process's tokens (logits equal within rounding: the same draws, barring a
    # draw that falls within rounding of a boundary)
    sampled = minispec.generate(sharded, PROMPTS[2], draft=draft, gamma=3, temperature=1.0, seed=5, max_new_tokens=NEW)
    assert sampled.tokens == minispec.generate(whole, PROMPTS[2], draft=draft, gamma=3, temperature=1.0, seed=5,
                                               max_new_tokens=NEW).tokens
    print("ok engine: batches, streaming, beam search, sampling", flush=True)

    # The partials gathered and added in rank order (as for more than 2 ranks): the same bits as the all-reduce.
    steps = [[4], [11, 12, 13]]
    reduced = logits_of(sharded, PROMPTS[0], steps)
    saved, tensor_parallel.ALL_REDUCE_MAX_RANKS = tensor_parallel.ALL_REDUCE_MAX_RANKS, 1
    try:
        gathered = logits_of(sharded, PROMPTS[0], steps)
    finally:
        tensor_parallel.ALL_REDUCE_MAX_RANKS = saved
    assert torch.equal(reduced, gathered)
    print("ok sums in rank order", flush=True)


def check_quantized(target_dir):
    for mode in ("int8", "int4"):
        sharded = minispec.load(target_dir, tp=2, quantize=mode)
        whole = minispec.load(target_dir, quantize=mode)
        ours, theirs = logits_of(sharded, PROMPTS[0], [[4], [11, 12]]), logits_of(whole, PROMPTS[0], [[4], [11, 12]])
        # Quantized layers compute in bfloat16 and round each rank's partial sum to it, so the logits differ
        # by bfloat16 rounding (2% of their range here), where quantizing itself moves these tiny models'
        # logits by 11% (int8: a scale per row of a rank's slice, not per whole row) and 59% (int4).
        error = ((ours - theirs).abs().max() / theirs.abs().max()).item()
        assert error < 0.05, (mode, error)
        plain = minispec.generate(sharded, PROMPTS[0], max_new_tokens=NEW, ignore_eos=True)
        spec = minispec.generate(sharded, PROMPTS[0], draft="lookup", gamma=3, max_new_tokens=NEW, ignore_eos=True)
        assert spec.tokens == plain.tokens, mode
    float_target = minispec.load(target_dir, tp=2)
    plain = minispec.generate(float_target, PROMPTS[1], max_new_tokens=NEW, ignore_eos=True)
    for mode in ("int8", "int4"):  # self-drafts of a sharded float target: its quantized copy, sharded alike
        spec = minispec.generate(float_target, PROMPTS[1], draft=mode, gamma=3, max_new_tokens=NEW, ignore_eos=True)
        assert spec.tokens == plain.tokens, mode
    print("ok quantized: int8, int4, self-drafts", flush=True)


def check_compile(target_dir):
    """The sums stay inside a compiled forward's graph (fullgraph: a graph break would raise)."""
    sharded = minispec.load(target_dir, tp=2)
    sharded.compiled_forward = torch.compile(sharded.forward, fullgraph=True, dynamic=False, backend="eager")
    plain = minispec.generate(sharded, PROMPTS[0], max_new_tokens=8, ignore_eos=True)
    spec = minispec.generate(sharded, PROMPTS[0], draft="lookup", gamma=3, max_new_tokens=8, ignore_eos=True)
    assert spec.tokens == plain.tokens
    print("ok compiled: fullgraph", flush=True)


def run_with_a_failing_rank(argv):
    """run.py's main, its target made to fail on rank 1 at its third forward: a fault mid-decoding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import run
    from minispec import loaders

    load = loaders.load_models

    def load_models(args):
        target, draft = load(args)
        if dist.get_rank() == 1:
            calls = []

            def fail(module, args):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("injected fault on rank 1")

            target.layers[0].register_forward_pre_hook(fail)  # (a llama: forwards call its layers)
        return target, draft

    run.load_models = load_models
    sys.exit(run.main(argv))


def main():
    if sys.argv[1] == "--fail-rank-1":
        return run_with_a_failing_rank(sys.argv[2:])
    checkpoints = json.loads(open(sys.argv[1]).read())
    torch.manual_seed(0)
    kept, started = {}, time.perf_counter()

    def timed(what, check, *args):
        result = check(*args)
        print(f"seconds {what} {time.perf_counter() - started:.1f}", flush=True)
        return result

    for kind, (target_dir, draft_dir) in checkpoints["families"].items():
        kept[kind] = timed(kind, check_family, kind, target_dir, draft_dir)
    timed("engine", check_engine, *kept["llama_gqa"])
    timed("quantized", check_quantized, checkpoints["quantizable"])
    timed("compiled", check_compile, checkpoints["families"]["llama"][0])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
