"""CUDA only (skipped elsewhere, so CI never runs these): compiled decoding with CUDA graphs must give
the tokens eager decoding gives, for plain, speculative and beam-search decoding. CUDA graphs reuse
their output buffers on every replay, so any logits read after a later replay would show up here.
Written in a session without a GPU: they have not run yet (the first GPU session should run them).
"""

import json

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
