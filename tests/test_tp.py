"""Tensor parallelism (minispec/models/tp.py, minispec/loading/parallel.py): a target sharded over 2
gloo processes on the CPU, launched by torchrun from these tests, each launch bounded in time.

tests/tp_worker.py runs the checks inside the launch: for each family (Llama multi-head and
grouped-query, Qwen2, Qwen3, GPT-2, T5 v1.0 and v1.1), logits against one process (within float tolerance,
bit for bit the same on every rank), the same greedy tokens, speculative greedy = plain greedy under
TP (a replicated draft model, lookup, fixed and adaptive gamma), row invariance per rank; then
batches, streaming, beam search, sampling, the sums of more than 2 ranks, quantized targets and
self-drafts, and a compiled forward holding the sums. Here: the command line under torchrun, a rank
that fails mid-decoding, input every rank refuses, setups refused with one line before anything is
joined, and slicing a checkpoint's quantized weights.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import TINY_CONFIGS, VOCAB, make_reference, noisy_copy, save_reference, spread_init

import minispec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402

LAUNCH_TIMEOUT = 120  # seconds for one torchrun launch (about 30 s for the worker's checks here)
PROMPT = [5, 17, 33, 8, 5, 17]


def tiny_t5_v1_1():
    """conftest's T5 v1.1 with a feed-forward width of 64, not 48: a rank's 32 columns are whole
    vectors of the CPU's elementwise kernels, whose scalar tail loop rounds GELU's tanh otherwise
    (docs/design.md, "Tensor parallelism"), which would break row invariance per rank."""
    config = TINY_CONFIGS["t5_v1_1"]()
    config.d_ff = 64
    torch.manual_seed(2)
    return spread_init(transformers.T5ForConditionalGeneration(config).eval(), seed=2, gain=2.0)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"families": {kind: [target dir, noisy-copy draft dir]}, "quantizable": dir}, and the JSON file."""
    families = {}
    for kind in ("llama", "llama_gqa", "qwen2", "qwen3", "gemma3", "gpt2", "t5_v1_0", "t5_v1_1"):
        reference = tiny_t5_v1_1() if kind == "t5_v1_1" else make_reference(kind)
        families[kind] = [str(save_reference(reference, tmp_path_factory.mktemp(kind))),
                          str(save_reference(noisy_copy(reference, seed=1, scale=0.05),
                                             tmp_path_factory.mktemp(f"{kind}_draft")))]
    # Widths the int4 kernel takes on a rank's slices (out_features a multiple of 16, groups of 32)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    quantizable = spread_init(transformers.LlamaForCausalLM(config).eval(), seed=0)
    out = {"families": families, "quantizable": str(save_reference(quantizable, tmp_path_factory.mktemp("quant")))}
    path = tmp_path_factory.mktemp("tp") / "checkpoints.json"
    path.write_text(json.dumps(out))
    return out, path


def torchrun(*argv):
    """2 processes on this machine (a free rendezvous port), bounded in time."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *map(str, argv)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, cwd=ROOT, env=env)


def test_sharded_checks(checkpoints):
    _, path = checkpoints
    result = torchrun(ROOT / "tests" / "tp_worker.py", path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    kinds = ("llama", "llama_gqa", "qwen2", "qwen3", "gemma3", "gpt2", "t5_v1_0", "t5_v1_1")
    expected = [f"ok {kind}: parity, speculative = plain" for kind in kinds]
    expected += [f"ok {kind}: row invariance" for kind in kinds]
    expected += ["ok engine: batches, streaming, beam search, sampling", "ok sums in rank order",
                 "ok quantized: int8, int4, self-drafts", "ok compiled: fullgraph"]
    for line in expected:
        assert result.stdout.count(line) == 2, (line, result.stdout)  # once per rank


def test_command_line(checkpoints):
    """run.py --tp 2 under torchrun: one JSON object on stdout (rank 0's), the single process's tokens."""
    families = checkpoints[0]["families"]
    target, draft = families["llama_gqa"]
    flags = ["--target", target, "--draft", draft, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens",
             "16", "--ignore-eos", "--device", "cpu", "--json"]
    result = torchrun("run.py", *flags, "--tp", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)  # fails unless stdout is exactly one JSON object
    assert out["tokens"] == minispec.generate(minispec.load(target), PROMPT, max_new_tokens=16, ignore_eos=True).tokens


def test_a_failing_rank_stops_every_rank(checkpoints):
    """A fault on rank 1 mid-decoding: every process exits (no hang), with one line saying what failed."""
    families = checkpoints[0]["families"]
    target, _ = families["llama"]
    result = torchrun(ROOT / "tests" / "tp_worker.py", "--fail-rank-1", "--target", target, "--prompt-ids",
                      ",".join(map(str, PROMPT)), "--max-new-tokens", "16", "--device", "cpu", "--tp", "2")
    assert result.returncode != 0
    # stderr: that line, then torchrun's own report of the processes it stopped
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower() and "rank" in line
              and "elastic" not in line and "ChildFailedError" not in line]
    assert errors == ["error: rank 1: RuntimeError: injected fault on rank 1"], result.stderr[-3000:]
    assert "Traceback" not in result.stdout  # stdout: the tokens rank 0 printed before it stopped


def test_bad_input_under_torchrun(checkpoints):
    """Input every rank refuses alike (here after the group is joined: too many new tokens for the
    context): one line, from rank 0; the processes exit with status 2 (torchrun stops a slower one)."""
    families = checkpoints[0]["families"]
    result = torchrun("run.py", "--target", families["gpt2"][0], "--prompt-ids", "1,2,3", "--max-new-tokens", "500",
                      "--device", "cpu", "--tp", "2")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "exceeds the target" in errors[0], result.stderr[-3000:]
    assert result.returncode != 0 and "exitcode  : 2" in result.stderr  # torchrun's report of the processes


@pytest.mark.parametrize("env, flags, message", [
    ({}, ["--tp", "2"], "launch with torchrun --nproc-per-node 2"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, ["--tp", "2"], "tp=2 but 1 processes were launched"),
    ({"RANK": "0", "WORLD_SIZE": "3"}, ["--tp", "3"], "tp=3 does not divide the target's 4 attention heads"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ["--tp", "0"], "tp must be an integer >= 1"),
    pytest.param({"RANK": "0", "WORLD_SIZE": "2"}, ["--tp", "2", "--device", "cuda"], "NCCL, which needs GPUs",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without GPUs")),
])
def test_bad_setups(checkpoints, monkeypatch, capsys, env, flags, message):
    """Refused with one line and status 2 before any process group is joined (which would wait for
    ranks that never come)."""
    families = checkpoints[0]["families"]
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert run.main(["--target", families["llama"][0], "--prompt-ids", "1,2", "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not torch.distributed.is_initialized()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without GPUs")
def test_nccl_without_gpus(checkpoints, monkeypatch):
    families = checkpoints[0]["families"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="NCCL, which needs GPUs, and CUDA is not available"):
        minispec.load(families["gpt2"][0], device="cuda", tp=2)


def test_stored_slices_dequantize_to_the_float_slices():
    """A checkpoint's quantized weights (a GGUF file kept quantized) are sliced in their stored form:
    int8 per row or in groups, int4 packed two a byte; each rank's slice dequantizes to its slice of
    the whole weight, along rows (with fused parts) and columns."""
    from minispec.models import quant
    from minispec.models.tp import take, take_stored

    weight = torch.randn(48, 128)
    forms = {"int8 per row": quant.quantize_int8(weight), "int8 groups": quant.quantize_int8(weight, 32),
             "int4": quant.quantize_int4(weight, 32)}
    for name, parts in forms.items():
        whole = quant.dequantize(parts)
        for rank in range(2):
            for dim, sizes in ((0, [16, 32]), (1, None)):
                sliced = take_stored(parts, dim, sizes, rank, 2, "w")
                assert torch.equal(quant.dequantize(sliced), take(whole, dim, sizes, rank, 2)), (name, rank, dim)
    with pytest.raises(ValueError, match="its 4 groups of 32 columns do not split evenly over tp=3"):
        take_stored(forms["int4"], 1, None, 0, 3, "w")


def test_a_rank_that_never_joins_is_a_bounded_wait(checkpoints, tmp_path):
    """Rank 0 of 2 launched alone (rank 1 never comes): it waits MINISPEC_TP_TIMEOUT seconds, then
    exits 2 with one line naming the wait, the setting and the ranks that came; no hang, no traceback."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "MINISPEC_TP_TIMEOUT": "3"}
    result = subprocess.run([sys.executable, "run.py", "--target", checkpoints[0]["families"]["llama"][0],
                             "--prompt-ids", "1,2", "--device", "cpu", "--tp", "2"], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env=env)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2 and len(errors) == 1, result.stderr[-3000:]
    assert "waited 3 s (MINISPEC_TP_TIMEOUT)" in errors[0] and "1/2" in errors[0], errors
    assert "Traceback" not in result.stderr


def test_a_bad_join_timeout_is_refused_before_joining(checkpoints, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MINISPEC_TP_TIMEOUT", "never")
    assert run.main(["--target", checkpoints[0]["families"]["llama"][0], "--prompt-ids", "1,2", "--device", "cpu",
                     "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "MINISPEC_TP_TIMEOUT='never' must be a number of seconds" in err, err
    assert not torch.distributed.is_initialized()
