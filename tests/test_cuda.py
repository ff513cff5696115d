"""CUDA only (skipped elsewhere, so CI never runs these): compiled decoding with CUDA graphs must give
the tokens eager decoding gives, for plain, speculative and beam-search decoding. CUDA graphs reuse
their output buffers on every replay, so any logits read after a later replay would show up here.
A speculative step must make one host sync, counted by torch's own sync debug mode.
Written in a session without a GPU: they have not run yet (the first GPU session should run them).
"""

import json
import warnings

import pytest
import torch

import minispec
from conftest import make_reference, noisy_copy, save_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [5, 17, 33, 8, 90, 41, 2, 63, 12, 77, 3, 54]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    reference = make_reference("llama_gqa")
    return (save_reference(reference, tmp_path_factory.mktemp("cuda_target")),
            save_reference(noisy_copy(reference, seed=1, scale=0.01), tmp_path_factory.mktemp("cuda_noisy")))


def load_pair(checkpoints, compile):
    target, draft = checkpoints
    options = dict(device="cuda", dtype=torch.float32, compile=compile)
    return minispec.load(target, **options), minispec.load(draft, **options)


@pytest.mark.parametrize("settings", [
    {"max_new_tokens": 40, "ignore_eos": True},
    {"max_new_tokens": 40, "ignore_eos": True, "gamma": 4},
    {"max_new_tokens": 40, "ignore_eos": True, "gamma": 3, "temperature": 1.0, "top_p": 0.9, "seed": 2},
    {"max_new_tokens": 16, "ignore_eos": True, "gamma": 3, "beams": 2, "draft_beams": 4},
])
def test_cuda_graphs_give_eager_tokens(checkpoints, settings):
    eager_target, eager_draft = load_pair(checkpoints, compile=False)
    target, draft = load_pair(checkpoints, compile=True)
    with_draft = "gamma" in settings
    expected = minispec.generate(eager_target, PROMPT, draft=eager_draft if with_draft else None, **settings)
    for _ in range(3):  # the first run compiles and records; later ones replay the graphs
        out = minispec.generate(target, PROMPT, draft=draft if with_draft else None, **settings)
        assert out.tokens == expected.tokens
        assert out.sequences == expected.sequences
    if with_draft and "beams" not in settings:
        assert out.stats["accepted"] == expected.stats["accepted"]


@pytest.mark.parametrize("compile", [False, True])
def test_one_sync_per_speculative_step(checkpoints, compile):
    """torch's sync debug mode flags every operation that makes the host wait for the GPU: a
    speculative step with a model draft has exactly one (its .tolist()); the rest are per request."""
    target, draft = load_pair(checkpoints, compile)

    def steps_and_syncs(new_tokens):
        settings = dict(draft=draft, gamma=3, max_new_tokens=new_tokens, ignore_eos=True)
        minispec.generate(target, PROMPT, **settings)  # compiles and records graphs outside the count
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = minispec.generate(target, PROMPT, **settings)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return out.stats["target_calls"], sum("synchroniz" in str(w.message) for w in caught)

    (short_steps, short_syncs), (long_steps, long_syncs) = steps_and_syncs(8), steps_and_syncs(40)
    assert long_steps > short_steps
    assert long_syncs - short_syncs == long_steps - short_steps


def test_bench_reports_bandwidth_on_cuda(checkpoints, tmp_path):
    from minispec import bench

    report = tmp_path / "bench.json"
    assert bench.main(["--target", str(checkpoints[0]), "--draft", str(checkpoints[1]), "--device", "cuda",
                       "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "32", "--repeats", "1",
                       "--memory-tokens", "64", "--json-out", str(report)]) == 0
    result = json.loads(report.read_text())
    bandwidth = result["memory_bandwidth"]
    assert bandwidth["achieved_bytes_per_s"] > 0
    assert abs(result["memory"]["growth"]) < 0.01
