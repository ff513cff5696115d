"""The package's import graph flows one way: models at the bottom, the native kernels above them (a
backend for models/backend.py's interface), loading above those, decoding above loading, the library's
front door (api) above decoding, the command lines (and the server) above it, and the tools (bench,
head training) apart on top, over the public API. Read from the source with ast, so a cycle hidden in a
function body (an import placed there to dodge it) is caught too. And what the package reads besides
its modules is installed with it."""

import ast
import os
import subprocess
import sys
from fnmatch import fnmatch
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "minispec"

LAYERS = {  # by the top-level module or subpackage
    "models": 0,
    "native": 1,  # implements models/backend.py's interface; loading installs it
    "loading": 2,
    "settings": 0,  # torch-free: the command lines check flags before loading torch
    "cpus": 0,  # torch-free: `import minispec` starts its clock
    "decoding": 3,
    "api": 4,
    "__init__": 5, "cli": 5, "convert": 5, "heads": 5, "loaders": 5,
    "serve": 6,
    "tools": 7,  # the bench and head training: over the public API, apart from the engine
}
# What tools may import besides the package's front door (`import minispec`): the command lines' flags
# and loaders, the forwards, drafters and weight formats the bench times one by one (the suffix drafter's
# store, emptied before each timed pass), and the heads' modules and the target's layers training builds
# a head from.
TOOL_API = {"api", "cli", "loaders", "settings", "decoding.drafters", "decoding.suffix", "heads.__init__",
            "heads.eagle", "heads.eagle3", "heads.medusa", "heads.training", "loading.chat", "loading.checkpoint",
            "loading.weights", "models.__init__", "models.base", "models.kernels", "models.llama", "models.quant"}
# Modules the core reaches only when a call asks for what they do (a head, beam search, quantized or sharded
# weights, a GGUF file, a built-in model, a chat template, the native kernels, a model-free drafter),
# imported inside the function that needs them so that a float model's generate never reads them.
# Families are imported by name (checkpoint.FAMILIES).
LAZY = {"heads.__init__", "decoding.beam", "models.quant", "models.tp", "loading.parallel", "loading.gguf",
        "loading.builtin", "loading.chat", "native.__init__", "decoding.lookup",
        "decoding.suffix", "decoding.prefix", "decoding.noise", "decoding.grammar", "loading.packed", "models.compiled", "loading.spm", "serve.group", "heads.learn",
        "decoding.mixed", "decoding.batched"}
CORE_LINES = 6000  # what `import minispec` and one float model's speculative generate read


def module_name(file):
    return ".".join(file.relative_to(PACKAGE).with_suffix("").parts)


def layer(module):
    return LAYERS[module.split(".")[0]]


def resolve(dotted):
    """A dotted name inside the package -> the module (file) it names: "models" -> "models.__init__"."""
    if dotted in ("", "__init__"):
        return "__init__"
    return dotted + ".__init__" if (PACKAGE / dotted.replace(".", "/")).is_dir() else dotted


def package_imports(file):
    """[(imported minispec module, whether the import sits inside a function)] of one file."""
    tree = ast.parse(file.read_text())
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    inside = {id(node) for function in functions for node in ast.walk(function)}
    package = module_name(file).split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y, from . import x
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            elif (node.module or "").split(".")[0] == "minispec":
                base = node.module.removeprefix("minispec").lstrip(".")
            else:
                continue
            # each imported name may itself be a module (from .models import gpt2)
            names = [f"{base}.{a.name}".lstrip(".") for a in node.names]
            targets = [resolve(base)] if node.module else []  # `from . import x` imports only x
            targets += [resolve(n) for n in names if (PACKAGE / (n.replace(".", "/") + ".py")).exists()]
        elif isinstance(node, ast.Import):
            targets = [resolve(a.name.removeprefix("minispec").lstrip(".")) for a in node.names
                       if a.name.split(".")[0] == "minispec"]
        else:
            continue
        found += [(target, id(node) in inside) for target in targets]
    return found


EDGES = {module_name(file): package_imports(file) for file in PACKAGE.rglob("*.py")}


def test_every_module_has_a_layer():
    assert all(name.split(".")[0] in LAYERS for name in EDGES)


def only_a_docstring(module):
    body = ast.parse((PACKAGE / (module.replace(".", "/") + ".py")).read_text()).body
    return all(isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) for node in body)


def test_no_package_import_inside_a_function_but_the_optional_layers():
    late = [(name, target) for name, imports in EDGES.items() for target, inside in imports
            if inside and target not in LAZY and not only_a_docstring(target)]
    assert late == []


CORE_SCRIPT = """
import sys
import minispec
target, draft = minispec.load(sys.argv[1]), minispec.load(sys.argv[1])
minispec.generate(target, "the cat", draft=draft, max_new_tokens=4)
files = [m.__file__ for name, m in list(sys.modules.items()) if name.split(".")[0] == "minispec"]
print(sum(sum(1 for _ in open(f)) for f in files if f and f.endswith(".py")))
print(" ".join(sorted(name for name in sys.modules if name.split(".")[0] == "minispec")))
"""


def test_the_core_stays_small(llama_with_tokenizer):
    """What a newcomer must read to follow a float model's speculative generate, the native backend off:
    the optional layers above stay unread."""
    environment = {**os.environ, "MINISPEC_NATIVE": "0", "PYTHONPATH": str(PACKAGE.parent)}
    result = subprocess.run([sys.executable, "-c", CORE_SCRIPT, str(llama_with_tokenizer)], env=environment,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines, modules = result.stdout.split("\n")[:2]
    assert int(lines) <= CORE_LINES, f"{lines} lines in {modules}"
    assert not {f"minispec.{name.removesuffix('.__init__')}" for name in LAZY} & set(modules.split())


def test_imports_never_go_up_a_layer():
    upward = [(name, target) for name, imports in EDGES.items() for target, _ in imports
              if layer(target) > layer(name)]
    assert upward == []


def test_tools_import_only_the_public_api():
    for name, imports in EDGES.items():
        if name.startswith("tools."):
            outside = {target for target, _ in imports if not target.startswith("tools.")}
            assert outside <= {"__init__"} | TOOL_API, name


def test_no_engine_module_imports_tools():
    engine = [(name, target) for name, imports in EDGES.items() if not name.startswith("tools.")
              for target, _ in imports if target.startswith("tools.")]
    assert engine == []


def test_models_import_only_their_base():
    for name, imports in EDGES.items():
        if name.startswith("models.") and name not in ("models.base", "models.kernels", "models.__init__"):
            assert {target for target, _ in imports} <= {"models.base", "models.kernels", "models.backend",
                                                         "models.checks"}, name


def test_the_graph_has_no_cycle():
    edges = {name: {target for target, _ in imports if target in EDGES} for name, imports in EDGES.items()}
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as error:
        raise AssertionError(f"import cycle: {error.args[1]}") from None


def test_every_file_the_package_reads_is_installed_with_it():
    """A non-editable install (`pip install .`, a wheel) carries only the package data pyproject.toml
    lists: a source file minispec/native compiles but the list misses would be absent there."""
    tomllib = pytest.importorskip("tomllib")
    listed = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [path for path in PACKAGE.rglob("*") if path.is_file() and path.suffix not in (".py", ".pyc")]
    assert data
    for path in data:
        relative = path.relative_to(PACKAGE).as_posix()
        assert any(fnmatch(relative, pattern) for pattern in listed["minispec"]), f"{relative} is not package data"
