# SPDX-License-Identifier: Apache-2.0
"""The Python package's layers (shim_python/README.md), read from its source: no import cycle,
no import from a lower layer up to a higher one, the native module imported only where it is
allowed, no module past 600 lines but those still to split; and the module paths from before
the layers still import, as the same module objects."""

from __future__ import annotations

import ast
import importlib
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "shim_python", "trainstream")

# Lower layers first. A module may import its own layer and those below it.
# A dotted key places one module apart from its folder (the longest key that names it wins):
# the Hugging Face face of the package (load_model, wrap_hf, the Trainer) is built on wrap(),
# where the losses beside it are used by wrap(). The package's own __init__ re-exports them all.
# The options are definitions the optimizer, the memory plan and wrap() read: beside optim/.
LAYERS = {"errors": 0, "hooks": 0, "transport": 1, "frozen": 2, "optim": 3, "options": 3,
          "memory": 4, "integrations": 5, "session": 6, "report": 6, "wrap": 6,
          "inspection": 6,
          "integrations.huggingface": 7, "integrations.trainer": 7, "__init__": 8}
# Files still past the size a file should keep to, each to be split (the list may only shrink).
OVER_600_LINES: set[str] = set()


def _modules() -> dict[str, str]:
    """Dotted name under trainstream -> source path."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), PACKAGE)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__") if rel != "__init__" else rel] = \
                    os.path.join(folder, f)
    return out


def _imports(name: str, path: str, modules: dict) -> set[str]:
    """The package modules (and "_trainstream") that ``name`` imports, anywhere in its code."""
    is_package = path.endswith("__init__.py")
    here = name.split(".") if is_package and name != "__init__" else name.split(".")[:-1]
    if name == "__init__":
        here = []
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
        prefix = base + (node.module.split(".") if node.module else [])
        for alias in node.names:
            candidate = ".".join(prefix + [alias.name])
            if candidate in modules or alias.name == "_trainstream":
                found.add("_trainstream" if alias.name == "_trainstream" else candidate)
            elif ".".join(prefix) in modules:
                found.add(".".join(prefix))
    found.discard(name)
    return found


def _layer(name: str) -> int:
    parts = name.split(".")
    return next(LAYERS[".".join(parts[:n])] for n in range(len(parts), 0, -1)
                if ".".join(parts[:n]) in LAYERS)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_module_has_a_layer(graph):
    assert {name.split(".")[0] for name in graph} <= set(LAYERS), sorted(graph)


def test_no_import_cycle(graph):
    # Function-local imports count: a cycle through them still ties the two modules together.
    edges = {m: {d for d in deps if d in graph} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list) -> None:
        state[m] = 1
        for d in edges[m]:
            if state.get(d) == 1:
                raise AssertionError(" -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])


def test_no_module_imports_a_higher_layer(graph):
    upward = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                    if d != "_trainstream" and _layer(d) > _layer(m))
    assert upward == []


def test_only_the_transport_layer_imports_the_native_module(graph):
    native = {m for m, deps in graph.items() if "_trainstream" in deps
              and not m.startswith("transport")}
    assert native == set(), "outside transport/, give transport/ a function for these instead"


def test_files_stay_short():
    over = {name for name, path in _modules().items() if sum(1 for _ in open(path)) > 600}
    assert over == OVER_600_LINES, (
        f"past 600 lines: {sorted(over - OVER_600_LINES)}; split it" if over - OVER_600_LINES
        else f"no longer past 600 lines: {sorted(OVER_600_LINES - over)}; take it off the list")


# The flat module paths from before the package had layers (old name -> its layer's module).
OLD_PATHS = {
    "_embedded": "transport.embedded", "client": "transport.client",
    "host_optimizer": "transport.host_optimizer", "cuda_streams": "transport.device",
    "base_linear": "frozen.linear", "fp8_matmul": "frozen.fp8_matmul",
    "offload_adamw": "optim.offload_adamw", "staged_adamw": "optim.staged_adamw",
    "nonfinite_guard": "optim.nonfinite_guard", "blocks": "memory.blocks",
    "hardware": "transport.hardware", "planner": "memory.planner", "kv_cache": "memory.kv_cache",
    "recompute": "memory.recompute", "activation_arena": "memory.activation_arena",
    "allocator_split": "memory.allocator_split", "paging": "memory.pager",
    "adaptive_plan": "memory.adaptive", "block_memory": "memory.block_memory",
    "quantize_choice": "memory.quantization", "chunked_loss": "integrations.chunked_loss",
    "huggingface": "integrations.huggingface", "weak_hooks": "hooks", "hook_clock": "hooks",
}


def test_the_old_module_paths_are_gone_and_the_new_ones_import():
    pytest.importorskip("torch")
    import trainstream

    for old, new in OLD_PATHS.items():
        importlib.import_module(f"trainstream.{new}")
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"trainstream.{old}")
    # bases and gpu_pools were module names too; they are the package's functions.
    assert callable(trainstream.bases) and callable(trainstream.gpu_pools)
    for name in ("bases", "gpu_pools"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"trainstream.{name}")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private attributes a module gives objects: its own (``self._x = ...``, private
    methods and class attributes of its classes) and others' (``obj._x = ...``, a stamp that
    only this module should read back)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        if isinstance(target, ast.Name):
                            names.add(target.id)
    return {n for n in names if _is_private(n)}


def _private_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """``obj._x`` on anything but ``self``/``cls``, and ``getattr(obj, "_x")`` and its kin."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _is_private(node.args[1].value) \
                and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self"):
            found.append((node.lineno, node.args[1].value))
    return found


def test_no_module_reads_another_modules_private_attributes():
    # A private name counts as another module's when that module gives it to its objects and
    # the reader does not: torch's own privates (module._buffers, torch._C) are not ours to
    # police here, and a module may reach into the objects it defines.
    trees = {name: ast.parse(open(path).read()) for name, path in _modules().items()}
    owned = {name: _defined_privates(tree) for name, tree in trees.items()}
    crossings = []
    for name, tree in trees.items():
        for line, attr in _private_reads(tree):
            owners = sorted(m for m, names in owned.items() if attr in names)
            if owners and name not in owners:
                crossings.append(f"{name}:{line} reads {attr} of {', '.join(owners)}")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0 and node.module is not None:
                crossings += [f"{name}:{node.lineno} imports {a.name} from {node.module}"
                              for a in node.names if _is_private(a.name)]
    assert crossings == []


def _foreign_self_reads(tree: ast.AST) -> set[str]:
    """``self._x`` read in a module that neither assigns ``self._x`` nor defines ``_x`` in a
    class of its own: state a mixin shares with the files of its class's other parts."""
    given, read = _defined_privates(tree), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id == "self" and _is_private(node.attr) \
                and not isinstance(node.ctx, ast.Store):
            read.add(node.attr)
    return read - given


def test_no_state_is_shared_between_a_classs_files():
    """Collaborators own their state (issue 52): BlockPager's parts, AdaptivePlan's step meter,
    probe step, staging trial, applied plan and optimizer-state share, OffloadAdamW's parameter
    table, gradient router, device returns, state placement and offload="auto" switch. What
    is still one class over several files (OffloadAdamW's layer surface and checkpoints) reads
    its state through public names only."""
    reads = {}
    for name, path in _modules().items():
        found = _foreign_self_reads(ast.parse(open(path).read()))
        if found:
            reads[name] = sorted(found)
    assert reads == {}, ("private state read in a file that never sets it (a collaborator "
                         f"should own it, or it is the class's public state): {reads}")


def test_a_mixins_read_of_private_state_is_found():
    """The check above can fail: a part of a class reading what another file sets."""
    part = ast.parse("class Part:\n    def f(self):\n        return self._kept + self._own\n"
                     "    def g(self):\n        self._own = 1\n")
    assert _foreign_self_reads(part) == {"_kept"}
