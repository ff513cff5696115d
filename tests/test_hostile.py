"""A corpus of hostile inputs (issue 30), each met as a user meets it, through the command line:
malformed checkpoint folders, weights, GGUF files and tokenizers, and bad flags. Every one must end in
one line, `error: ...`, naming the file or flag and what is wrong with it, with exit status 2 and
nothing left behind in the weights folder (where a GGUF file's conversion would go). The modules' own tests check each error in detail; this
corpus checks that none of them escapes as a traceback, a hang or a silent load."""

import json
import os
import shutil
import struct
import sys
from pathlib import Path

import pytest
from gguf import GGUFValueType  # test-only: the GGUF files' writer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import make_reference, save_reference

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402

PROMPT = ["--prompt-ids", "5,17,33"]
U32, I32, STR = GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.STRING


def truncated(argv):
    path = Path(argv[1])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return argv


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {kind: save_reference(make_reference(kind), tmp_path_factory.mktemp(kind))
            for kind in ("llama", "gpt2", "t5_v1_1")}


def edited_config(kind, **changes):
    """A copy of the tiny `kind` checkpoint whose config.json has `changes` (None deletes a key)."""
    def make(checkpoints, folder):
        shutil.copytree(checkpoints[kind], folder)
        config = json.loads((folder / "config.json").read_text())
        for key, value in changes.items():
            config.pop(key) if value is None else config.__setitem__(key, value)
        (folder / "config.json").write_text(json.dumps(config))
        return ["--target", str(folder), *PROMPT]
    return make


def replaced_file(kind, name, content):
    """A copy of the tiny `kind` checkpoint with file `name` replaced by `content` (bytes)."""
    def make(checkpoints, folder):
        shutil.copytree(checkpoints[kind], folder)
        (folder / name).write_bytes(content)
        return ["--target", str(folder), *PROMPT]
    return make


def integer_tensor(kind, name):
    """A copy of the tiny `kind` checkpoint with tensor `name` stored as int32."""
    def make(checkpoints, folder):
        from safetensors.torch import load_file, save_file

        shutil.copytree(checkpoints[kind], folder)
        weights = load_file(folder / "model.safetensors")
        weights[name] = weights[name].int()
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
        return ["--target", str(folder), *PROMPT]
    return make


def prompts_file(content):
    def make(checkpoints, folder):
        folder.mkdir()
        (folder / "prompts.txt").write_bytes(content)
        return ["--target", str(checkpoints["llama"]), "--prompts-file", str(folder / "prompts.txt")]
    return make


def gguf_file(metadata=(), replace=None):
    """A GGUF of the tiny llama (written as llama.cpp does, tests/test_gguf.py) with `metadata` values
    ({key: (value, type)}) and bytes `replace` = (old, new) swapped in."""
    def make(checkpoints, folder):
        from test_gguf import model_to_gguf

        folder.mkdir()
        path = model_to_gguf(make_reference("llama"), folder / "model.gguf", metadata=metadata)
        if replace:
            path.write_bytes(path.read_bytes().replace(*replace))
        return ["--target", str(path), *PROMPT]
    return make


def tokenizer_file(content):
    """A copy of the tiny llama with a tokenizer.json of `content`."""
    def make(checkpoints, folder):
        shutil.copytree(checkpoints["llama"], folder)
        (folder / "tokenizer.json").write_text(json.dumps(content))
        return ["--target", str(folder), "--prompt", "hello"]
    return make


def flags(*argv, kind="llama"):
    def make(checkpoints, folder):
        return ["--target", str(checkpoints[kind]), *argv]
    return make


CASES = {
    # config.json
    "config is a list": (replaced_file("llama", "config.json", b"[1, 2]"), "config.json"),
    "config is not JSON": (replaced_file("llama", "config.json", b"{model_type"), "config.json"),
    "hidden_size is a string": (edited_config("llama", hidden_size="32"), "hidden_size"),
    "no attention heads": (edited_config("llama", num_attention_heads=0), "num_attention_heads"),
    "negative intermediate_size": (edited_config("llama", intermediate_size=-4), "intermediate_size"),
    "rope_scaling is a string": (edited_config("llama", rope_scaling="yarn"), "rope_scaling"),
    "a billion layers": (edited_config("llama", num_hidden_layers=10**9), "num_hidden_layers"),
    "negative sliding_window": (edited_config("llama", model_type="mistral", sliding_window=-1),
                                "sliding_window"),
    "eos_token_id is a string": (edited_config("llama", eos_token_id="2"), "eos_token_id"),
    "gpt2 n_head is a float": (edited_config("gpt2", n_head=4.5), "n_head"),
    "t5 num_layers negative": (edited_config("t5_v1_1", num_layers=-2), "num_layers"),
    "unknown model_type": (edited_config("llama", model_type="mamba"), "model_type"),
    # weights
    "weights truncated": (replaced_file("llama", "model.safetensors", b"\x10\x00\x00"), "model.safetensors"),
    "weights header past the end": (replaced_file("llama", "model.safetensors", struct.pack("<Q", 10**6) + b"{}"),
                                    "model.safetensors"),
    "weights header not JSON": (replaced_file("llama", "model.safetensors", struct.pack("<Q", 4) + b"abcd"),
                                "model.safetensors"),
    "integer weights": (integer_tensor("llama", "model.embed_tokens.weight"), "model.embed_tokens.weight"),
    "index names a file outside": (replaced_file("llama", "model.safetensors.index.json", json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}).encode()), "outside"),
    # GGUF files
    "gguf head_count 0": (gguf_file({"llama.attention.head_count": (0, U32)}), "head_count"),
    "gguf embedding_length a string": (gguf_file({"llama.embedding_length": ("32", STR)}), "embedding_length"),
    "gguf 2^31-1 blocks": (gguf_file({"llama.block_count": (2**31 - 1, U32)}), "block_count"),
    "gguf eos -1": (gguf_file({"tokenizer.ggml.eos_token_id": (-1, I32)}), "eos_token_id"),
    "gguf a tensor twice": (gguf_file(replace=(b"blk.1.attn_norm.weight", b"blk.0.attn_norm.weight")), "twice"),
    "gguf truncated": (lambda checkpoints, folder: truncated(gguf_file()(checkpoints, folder)), "model.gguf"),
    # tokenizer files
    "tokenizer.json a list": (tokenizer_file([1]), "tokenizer.json"),
    "tokenizer without a vocabulary": (tokenizer_file({"model": {"type": "BPE", "merges": []}}), "vocab"),
    "tokenizer merges of integers": (tokenizer_file({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [1]}}),
                                     "merges"),
    "catastrophic split regex": (tokenizer_file({
        "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(a+)+$"}, "behavior": "Isolated"}}), "tokenizer.json"),
    # flags
    "seed too large": (flags(*PROMPT, "--seed", str(2**70), "--temperature", "1"), "seed"),
    "threads beyond the machine": (flags(*PROMPT, "--threads", "100000"), "--threads"),
    "beams beyond memory": (flags(*PROMPT, "--beams", "100000"), "GiB free"),
    "t5 asked for 10^12 tokens": (flags(*PROMPT, "--max-new-tokens", str(10**12), kind="t5_v1_1"), "GiB free"),
    "prompt id beyond the vocabulary": (flags("--prompt-ids", "5,96"), "[0, 96)"),
    "text prompt without a tokenizer": (flags("--prompt", "hello"), "tokenizer"),
    "prompt not UTF-8": (flags("--prompt", "caf\udce9"), "--prompt is not UTF-8"),
    "several prompts with --show": (flags("--prompt", "a", "--prompt", "b", "--show"), "--show"),
    "JSON booleans as token ids": (prompts_file(b"[true, false]\n"), "token ids"),
    # numbers at their edges, and sizes from outside (issue 66)
    "gamma a billion": (flags(*PROMPT, "--draft", "lookup", "--gamma", "1000000000"), "gamma"),
    "temperature 1e-300": (flags(*PROMPT, "--temperature", "1e-300"), "temperature must be"),
    "temperature a denormal": (flags(*PROMPT, "--temperature", "5e-324"), "temperature must be"),
    "temperature inf": (flags(*PROMPT, "--temperature", "inf"), "temperature must be"),
    "top-p NaN": (flags(*PROMPT, "--temperature", "1", "--top-p", "nan"), "top_p must be"),
    "lenience inf": (flags(*PROMPT, "--draft", "lookup", "--lenience", "inf"), "lenience must be"),
    "stop token id beyond the vocabulary": (flags(*PROMPT, "--stop-token-ids", "96"), "stop_token_ids"),
    "prompts file /dev/zero": (flags("--prompts-file", "/dev/zero"), "--prompts-file /dev/zero: not a regular file"),
    "prompts file not UTF-8": (prompts_file(b"ok\n\xff\n"), "line 2"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_hostile_input_ends_in_one_line_naming_it(case, checkpoints, tmp_path, monkeypatch, capsys):
    weights = tmp_path / "weights"
    weights.mkdir()
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(weights))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make, message = CASES[case]
    argv = make(checkpoints, tmp_path / "input")
    try:
        status = run.main(["--device", "cpu", "--max-new-tokens", "4", *argv])  # argv's own flags win
    except SystemExit as exit:  # argparse's own refusals
        status = exit.code
    out, err = capsys.readouterr()
    assert status == 2, f"{case}: exit {status}, stderr {err[-300:]!r}"
    *notes, last = err.splitlines()  # progress notes ("minispec: converting ...") may come first
    assert (last.startswith("error: ") or err.startswith("usage:")) and "Traceback" not in err, f"{case}: {err!r}"
    assert all(note.startswith("minispec: ") for note in notes) or err.startswith("usage:"), f"{case}: {err!r}"
    assert message in err, f"{case}: {err!r}"
    assert list(weights.iterdir()) == [], f"{case} left {list(weights.iterdir())}"


# Issue 66, class 4: config values read unlike the reference reads them (tests/test_mutations.py has the
# comparisons with the reference), met through the command line like the corpus above.
CONFIG_CASES = {
    "qwen2 use_sliding_window 'yes'": (edited_config("llama", model_type="qwen2", use_sliding_window="yes"),
                                       "use_sliding_window"),
    "qwen2 max_window_layers -1": (edited_config("llama", model_type="qwen2", use_sliding_window=True,
                                                 max_window_layers=-1), "max_window_layers"),
    "t5 relative_attention_max_distance 1": (edited_config("t5_v1_1", relative_attention_max_distance=1),
                                             "relative_attention_max_distance"),
}


@pytest.mark.parametrize("case", CONFIG_CASES)
def test_a_config_read_unlike_the_reference_ends_in_one_line(case, checkpoints, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(CASES, case, CONFIG_CASES[case])
    test_a_hostile_input_ends_in_one_line_naming_it(case, checkpoints, tmp_path, monkeypatch, capsys)


# The command line's setting flags under any values (issue 66: the property search over the flags, as
# test_api.py's over generate's settings): each run answers, or ends in one line with status 2.
FLAG_VALUES = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e999", "5e-324", "-1", "0", "1", "2", "64", "65",
                                         "auto", "off", "", " ", "x", "1,2", "-1,5", "96", "2**63", "0.5", "1e-300"]),
                        st.integers(-3, 100).map(str), st.floats().map(repr), st.text(max_size=4))
FLAGS = ["--gamma", "--tree", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed",
         "--lenience", "--beams", "--draft-beams", "--stop", "--stop-token-ids", "--logprobs", "--presence-penalty",
         "--frequency-penalty", "--repetition-penalty", "--draft", "--threads", "--batch-size", "--n", "--coupling"]


@pytest.mark.parametrize("flag", FLAGS)
@given(value=st.one_of(st.integers(-3, 100).map(str), FLAG_VALUES),
       others=st.lists(st.tuples(st.sampled_from(FLAGS), FLAG_VALUES), max_size=2))
@settings(max_examples=int(os.environ.get("MINISPEC_HOSTILE_EXAMPLES", "15")), deadline=None, database=None,
          derandomize=True, suppress_health_check=list(HealthCheck))
def test_any_flag_values_answer_or_end_in_one_line(checkpoints, capsys, flag, value, others):
    argv = ["--target", str(checkpoints["llama"]), "--device", "cpu", *PROMPT, "--max-new-tokens", "4"]
    argv += [f"{name}={text}" for name, text in [(flag, value), *others]]  # "=": a value may start with "-"
    try:
        status = run.main(argv)
    except SystemExit as exit:  # argparse's own refusals
        status = exit.code
    out, err = capsys.readouterr()
    assert status in (0, 2, None), (argv, status, err[-300:])
    assert "Traceback" not in err, (argv, err)
    if status == 2:
        assert "error: " in err.splitlines()[-1], (argv, err)
