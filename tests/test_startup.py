"""What a run costs before its first token: `import minispec` loads nothing until a name is used, the
command line answers --help and a bad flag without torch, the core never imports the compiler (or the
hub's HTTP stack) until asked, and OpenMP's threads wait passively unless the user chose."""

import io
import json
import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import minispec
from minispec import cpus

ROOT = Path(__file__).resolve().parents[1]


def in_fresh_python(code, **env):
    """What `code` prints in a new interpreter, run from the repository root (this checkout's minispec)."""
    environment = {key: value for key, value in os.environ.items() if key not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    environment.update(PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environment, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


RUN = """
import json, runpy, sys
sys.argv = ["run.py", *{argv!r}]
try:
    runpy.run_path("run.py", run_name="__main__")
except SystemExit as exit:
    code = exit.code
print(json.dumps({{"code": code, "torch": "torch" in sys.modules}}))
"""


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["--target", "x"],  # no prompt: argparse's error
    ["--target", "x", "--prompt-ids", "1", "--quantize", "int3"],
    ["--target", "x", "--prompt-ids", "1", "--temperature", "-1"],  # Settings' check
    ["--target", "x", "--prompt-ids", "1", "--threads", "100000"],
    ["--target", "x", "--prompt-ids", "1", "--compare", "--repeats", "0"],
])
def test_help_and_bad_flags_answer_before_torch_is_imported(argv):
    done = in_fresh_python(RUN.format(argv=argv))
    assert done == {"code": 0 if argv == ["--help"] else 2, "torch": False}


def test_import_minispec_loads_nothing_until_a_name_is_used():
    loaded = in_fresh_python("import json, sys, minispec; print(json.dumps(sorted(sys.modules)))")
    assert "torch" not in loaded and "minispec.api" not in loaded


def test_the_core_never_imports_the_compiler_or_the_hub_until_asked():
    code = ("import json, sys, minispec; minispec.generate, minispec.load, minispec.load_draft_head; "
            "print(json.dumps(sorted(sys.modules)))")
    loaded = in_fresh_python(code)
    assert "torch" in loaded and "minispec.api" in loaded
    assert [name for name in ("torch._dynamo", "torch._inductor", "huggingface_hub") if name in loaded] == []


def test_public_names_come_from_import_and_dir():
    for name in minispec.__all__:
        assert getattr(minispec, name) is not None and name in dir(minispec)
    from minispec import Settings, generate  # noqa: F401
    assert minispec.api.generate is minispec.generate  # a submodule, as before the names were lazy
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        minispec.nothing  # noqa: B018


def test_openmp_spins_briefly_unless_the_user_chose():
    code = ("import json, os, minispec; "
            "print(json.dumps([os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT')]))")
    assert in_fresh_python(code) == [None, "2000"]
    assert in_fresh_python(code, OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", None]
    assert in_fresh_python(code, GOMP_SPINCOUNT="100") == [None, "100"]


def test_other_processes_busy_cores_are_judged_from_the_time_since_import(monkeypatch):
    """cpus.free_cpus: this process's CPUs less those other processes held more than half the time since
    `start`, its own time not counted; none for too short a time to tell."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    start = (100.0, 5.0, 10.0)  # busy seconds of the CPUs, this process's CPU seconds, the clock

    def after(others, own=1.0, seconds=1.0):
        return cpus.free_cpus(start, (start[0] + others + own, start[1] + own, start[2] + seconds))
    assert [after(x) for x in (0.0, 0.4, 0.5, 0.6, 1.4, 1.6, 9.0)] == [4, 4, 4, 3, 3, 2, 1]
    assert after(1.0, own=3.0) == 3 and after(1.0, seconds=2.0) == 4  # its own threads; averaged over the time
    assert after(1.0, seconds=0.1) is None and cpus.free_cpus(None, start) is None


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs: one held, one free")
def test_a_core_another_process_spins_on_is_not_free():
    cpu = max(os.sched_getaffinity(0))
    spin = f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nend = time.time() + 1.0\nwhile time.time() < end:\n    pass"
    start = cpus.sample()
    subprocess.run([sys.executable, "-c", spin], check=True, timeout=60)
    assert cpus.free_cpus(start) <= len(os.sched_getaffinity(0)) - 1


def test_the_first_load_takes_the_free_cpus_unless_the_user_chose(monkeypatch, reference_dirs):
    import torch

    from minispec.loading import checkpoint

    directory, threads = reference_dirs["llama"][1], torch.get_num_threads()  # the suite's own: one
    monkeypatch.setattr(cpus, "free_cpus", lambda: 1)
    try:
        for chosen, env, expected in [(False, None, 1), (True, None, 2), (False, "2", 2)]:
            torch.set_num_threads(2)
            checkpoint.default_threads.cache_clear()
            monkeypatch.setattr(cpus, "chosen", chosen)
            if env is None:
                monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
            else:
                monkeypatch.setenv("OMP_NUM_THREADS", env)
            minispec.load(directory)
            minispec.load(directory)
            assert torch.get_num_threads() == expected, (chosen, env)
    finally:
        torch.set_num_threads(threads)
        checkpoint.default_threads.cache_clear()


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_kernel_build_says_how_long_it_takes_and_shows_progress_on_a_terminal(monkeypatch, tmp_path, caplog):
    """The first build here gives the usual range; later ones the last build's time. On a terminal a bar
    counts its seconds; elsewhere (a log) the one line alone."""
    from minispec import native

    pause = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    monkeypatch.setattr(native, "build_command", lambda cxx, out: pause)
    path = tmp_path / "kernels.so"
    with caplog.at_level(logging.WARNING, logger="minispec"):
        native.build("c++", path)
    low, high = native.FIRST_BUILD_SECONDS
    assert caplog.messages == [f"minispec: building its CPU kernels, once per machine: {low}-{high} s"]
    took = float(native.build_seconds_file(path).read_text())
    assert 1.5 <= took < 60 and path.exists()
    caplog.clear()
    monkeypatch.setattr(sys, "stderr", Terminal())
    with caplog.at_level(logging.WARNING, logger="minispec"):
        native.build("c++", path)
    assert caplog.messages == [f"minispec: building its CPU kernels, once per machine: about {took:.0f} s, as the "
                               "last build here"]
    assert "minispec: building CPU kernels: 1 of about" in sys.stderr.getvalue()


def test_compiling_marks_the_attention_kernels_choice_constant(monkeypatch):
    """The mark that lets compiled graphs hold whichever attention kernel eager runs is set when a model
    compiles (marking imports the compiler, which the package's import must not)."""
    import torch

    from minispec.models import kernels
    from minispec.models.base import CachedLM

    marked = []
    monkeypatch.setattr(torch.compiler, "assume_constant_result", lambda function: marked.append(function) or function)
    model = types.SimpleNamespace(forward=lambda tokens: tokens, device=torch.device("cpu"))
    CachedLM.compile(model)
    assert marked == [kernels.native_attention] and model.compiled_forward is not None


@pytest.mark.parametrize("terminal", [False, True])
def test_the_hubs_progress_bars_show_on_a_terminal_only(monkeypatch, tmp_path, terminal):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import utils

    from minispec.loading import builtin

    seen = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo_id, **options: seen.append(
        utils.are_progress_bars_disabled()) or str(tmp_path))
    monkeypatch.setattr(sys, "stderr", Terminal() if terminal else io.StringIO())
    disabled = utils.are_progress_bars_disabled()  # other tests' libraries may have turned them off
    utils.enable_progress_bars()
    try:
        assert builtin.download_from_hub("someone/model") == tmp_path
        assert seen == [not terminal] and not utils.are_progress_bars_disabled()  # as they were after
    finally:
        if disabled:
            utils.disable_progress_bars()
