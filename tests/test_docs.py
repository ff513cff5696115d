"""The docs tell the truth about the code: every module they name exists, no reader is sent to the dated
history, and every Python example in the README runs as written and prints what it says it prints."""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minispec.loading import builtin
from minispec.loading.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parent.parent
HISTORY = "docs/history.md"  # the dated lab notebook: kept, but out of readers' way
# A dotted name starting with minispec, not part of a path or a longer name (weights/minispec.x is not one).
DOTTED = re.compile(r"(?<![\w./-])minispec(?:\.[A-Za-z_]\w*)+")
SOURCE_PATH = re.compile(r"(?<![\w./-])minispec/[\w/]+\.(?:py|cpp)\b")


def code_files():
    return sorted(p for p in (ROOT / "minispec").rglob("*") if p.suffix in (".py", ".cpp")) + [ROOT / "run.py"]


def doc_files():
    return [ROOT / "README.md"] + sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != Path(HISTORY).name)


def resolves(name):
    """Whether a dotted name is a module, or an attribute reached from the longest module it starts with."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for part in parts[i:]:
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True
    return False


def mentions(pattern, files):
    for path in files:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in pattern.finditer(line):
                yield f"{path.relative_to(ROOT)}:{number}", match.group(0)


def test_every_module_named_exists():
    missing = [f"{where}: {name}" for where, name in mentions(DOTTED, code_files() + doc_files())
               if not resolves(name)]
    assert not missing, "names of modules that do not exist:\n" + "\n".join(missing)


def test_every_source_file_named_exists():
    missing = [f"{where}: {path}" for where, path in mentions(SOURCE_PATH, code_files() + doc_files())
               if not (ROOT / path).exists()]
    assert not missing, "source files that do not exist:\n" + "\n".join(missing)


def test_nothing_cites_the_history():
    readers = code_files() + [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "docs" / "results.md"]
    cites = re.compile(r"performance\.md|history\.md")
    found = [f"{where}: {text}" for where, text in mentions(cites, readers)]
    assert not found, f"cites of {HISTORY} (or the performance.md it was):\n" + "\n".join(found)


def readme_python_blocks():
    return re.findall(r"^```python\n(.*?)^```$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M | re.S)


# Runs a block as a script, watching its print() calls: each call that has something to print must print
# visible text at least once (the README's stream example once printed nothing: a question sent without
# the chat template, which the model answered with an end of turn at once).
RUNNER = """
import ast, builtins, runpy, sys
path = sys.argv[1]
sites = [(c.lineno, c.end_lineno) for c in ast.walk(ast.parse(open(path).read()))
         if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "print" and (c.args or c.keywords)]
printed = {site: "" for site in sites}
real_print = builtins.print
def watching_print(*args, **kwargs):
    frame = sys._getframe(1)
    if frame.f_code.co_filename == path:
        for first, last in sites:
            if first <= frame.f_lineno <= last:
                printed[first, last] += kwargs.get("sep", " ").join(map(str, args))
    real_print(*args, **kwargs)
builtins.print = watching_print
runpy.run_path(path, run_name="__main__")
silent = [first for (first, last), text in printed.items() if not text.strip()]
if silent:
    sys.exit(f"the print() on line(s) {silent} of the example printed nothing")
"""


@pytest.fixture(scope="module")
def builtin_model():
    try:
        builtin.resolve_builtin("smollm2-135m-instruct")  # fetched once, as the examples' first line would
    except CheckpointError as error:
        pytest.skip(f"the built-in model cannot be fetched here: {error}")


README_LINES = 250  # a newcomer's five-minute read: figures and history belong in docs/


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines, more than {README_LINES}"


def test_the_readme_has_python_examples():
    assert readme_python_blocks()


@pytest.mark.parametrize("block", readme_python_blocks(), ids=lambda block: block.splitlines()[-1][:40])
def test_readme_python_example_runs_as_written(block, builtin_model, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(block, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", RUNNER, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the README example failed:\n{block}\n{result.stderr[-3000:]}"
    assert result.stdout.strip(), f"the README example printed nothing:\n{block}"
