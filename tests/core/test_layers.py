"""The layering rules of docs/architecture.md, checked on the source.

* No private member of the Trainer is used outside ``trainer_core/trainer.py``: loops, checkpoint
  code, plugins and callbacks go through ``trainer.progress``, ``trainer.hook_runner``,
  ``trainer.metrics`` and the Trainer's public attributes.
* The core imports ``trainer_core.plugins`` and ``trainer_core.callbacks`` at import time only in
  ``trainer_core/connectors.py`` (which builds them), ``trainer_core/callback_queries.py`` (which asks
  about callbacks by class) and ``trainer_core/cli.py``; plugins never import callbacks;
  callbacks never import the checkpoint IO's modules (they call ``CheckpointIO``'s public methods).
* No import circle in the core, every import counted (module level, in functions, under
  ``TYPE_CHECKING``); the checkpoint code reaches nothing of the Trainer, its builders or its loops,
  and takes no Trainer argument: it works on the parts the Trainer hands it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from trainer_core import Trainer

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "trainer_core"
PLUGINS = ROOT / "plugins"
CALLBACKS = ROOT / "callbacks"
# Names a module uses for a Trainer it was handed.
TRAINER_NAMES = {"trainer", "t", "_trainer"}


def _sources(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def _trainer_private_members() -> set[str]:
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    names = set(vars(trainer)) | {name for klass in Trainer.__mro__ for name in vars(klass)}
    return {name for name in names if name.startswith("_") and not name.startswith("__")}


def _holder_name(node: ast.expr) -> str:
    """``trainer`` for ``trainer._x``, ``self.trainer._x`` and ``self._trainer._x``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def test_no_private_trainer_member_is_used_outside_the_trainer() -> None:
    private = _trainer_private_members()
    assert "_setup_run" in private  # the check sees the Trainer's privates
    found = []
    for path in _sources(CORE, PLUGINS, CALLBACKS):
        if path == CORE / "trainer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                if _holder_name(node.value) in TRAINER_NAMES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in private
                and _holder_name(node.args[0]) in TRAINER_NAMES
            ):
                found.append(
                    f"{path.relative_to(ROOT)}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})"
                )
    assert not found, "private Trainer members used outside trainer_core/trainer.py:\n" + "\n".join(found)


def _imports_in(nodes: list[ast.stmt], at_import_time: bool) -> list[tuple[int, str]]:
    """Modules the statements import; with ``at_import_time``, not those inside functions or TYPE_CHECKING."""
    found: list[tuple[int, str]] = []
    for node in nodes:
        if at_import_time and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if at_import_time and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found += _imports_in(node.orelse, at_import_time)
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        for field in ("body", "orelse", "finalbody", "handlers"):
            found += _imports_in(getattr(node, field, []), at_import_time)
    return found


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    return _imports_in(ast.parse(path.read_text()).body, at_import_time=True)


def _all_imports(path: Path) -> list[tuple[int, str]]:
    return _imports_in(ast.parse(path.read_text()).body, at_import_time=False)


# Where the core may import plugins and callbacks at import time: the connector, which builds them from the
# Trainer's arguments; the callback queries, which answer the loops' and hooks' questions about callbacks
# (which act on metrics, which is the progress bar) by class; and LightningCLI, which builds a whole run
# (Trainer, module, callbacks) from a config and whose SaveConfigCallback is itself a callback.
FRONT_ENDS = {CORE / "connectors.py", CORE / "callback_queries.py", CORE / "cli.py"}


def test_the_core_imports_plugins_and_callbacks_only_through_the_connector() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _sources(CORE)
        if path not in FRONT_ENDS
        for line, module in _module_level_imports(path)
        if module.startswith(("trainer_core.plugins", "trainer_core.callbacks"))
    ]
    assert not offending, "core modules importing plugins/callbacks at import time:\n" + "\n".join(offending)


def test_plugins_never_import_callbacks() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _sources(PLUGINS)
        for line, module in _all_imports(path)
        if module.startswith("trainer_core.callbacks")
    ]
    assert not offending, "\n".join(offending)


def test_callbacks_use_only_the_public_checkpoint_io() -> None:
    offending = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in _sources(CALLBACKS)
        for line, module in _all_imports(path)
        if module.startswith("trainer_core.plugins.io.")
    ]
    assert not offending, "\n".join(offending)


# The import graph of the core, every import counted: module level, inside functions and under
# ``if TYPE_CHECKING:`` (a type-only import still ties two modules together for a reader and a refactor).


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _core_modules() -> dict[str, Path]:
    return {_module_name(path): path for path in _sources(CORE)}


def _package_exports(modules: dict[str, Path]) -> dict[str, dict[str, str]]:
    """For each package, the module each name it re-exports comes from (so ``from pkg import X`` is an edge to X's module)."""
    exports: dict[str, dict[str, str]] = {}
    for name, path in modules.items():
        if path.name != "__init__.py":
            continue
        table: dict[str, str] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for alias in node.names:
                    table[alias.asname or alias.name] = node.module if node.module in modules else name
        exports[name] = table
    return exports


def _imported_modules(path: Path, modules: dict[str, Path], exports: dict[str, dict[str, str]]) -> set[str]:
    """The core modules ``path`` imports, each name resolved to the module that defines it."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if submodule in modules:
                    found.add(submodule)
                elif alias.name in exports.get(node.module, {}):
                    found.add(exports[node.module][alias.name])
                elif node.module in modules:
                    found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
    found.discard(_module_name(path))
    return found


def _core_import_graph() -> dict[str, set[str]]:
    modules = _core_modules()
    exports = _package_exports(modules)
    return {name: _imported_modules(path, modules, exports) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.get(target, ())))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        circles.append(sorted(component))
    return circles


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_import_circle_in_the_core() -> None:
    graph = _core_import_graph()
    assert graph.get("trainer_core.trainer")  # the graph sees the core
    circles = _circles(graph)
    assert not circles, "import circles in trainer_core/ (every import counted):\n" + "\n".join(
        " <-> ".join(circle) for circle in circles
    )


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


# What the checkpoint code may not reach, directly or through another module: the Trainer, the code
# that builds it, and the loops it runs (``loops.progress``, the loop state it saves, is a leaf it may use).
TRAINER_SIDE = (
    "trainer_core.trainer",
    "trainer_core.connectors",
    "trainer_core.tuner",
    "trainer_core.loops.fit",
    "trainer_core.loops.evaluation",
    "trainer_core.loops.training_step",
    "trainer_core.loops.data",
    "trainer_core.loops.schedulers",
)


def test_checkpoint_code_imports_nothing_of_the_trainer() -> None:
    graph = _core_import_graph()
    checkpoint_modules = [name for name in graph if name.startswith("trainer_core.checkpoint")]
    assert "trainer_core.checkpoint.save" in checkpoint_modules
    offending = {
        name: sorted(m for m in _reachable(graph, name) if m.startswith(TRAINER_SIDE))
        for name in checkpoint_modules
    }
    offending = {name: reached for name, reached in offending.items() if reached}
    assert not offending, f"checkpoint modules that reach the Trainer: {offending}"


def test_checkpoint_code_takes_no_trainer_argument() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}({arg.arg})"
        for path in _sources(CORE / "checkpoint")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args + node.args.kwonlyargs + node.args.posonlyargs
        if arg.arg in TRAINER_NAMES
    ]
    assert not found, "checkpoint functions that take a Trainer:\n" + "\n".join(found)


# Names under which a plugin would compute a data-parallel rank or the sampler's split itself.
DP_RANK_NAMES = {"dp_rank", "data_parallel_rank", "dp_size"}


def test_plugins_compute_no_data_parallel_rank_outside_parallel_dims() -> None:
    """``ParallelDims`` is the one answer to "which data-parallel rank, of how many": plugins ask it."""
    assert "def dp_rank" in (PLUGINS / "parallel_dims.py").read_text()  # the rule's one home exists
    found = []
    for path in _sources(PLUGINS):
        if path.name == "parallel_dims.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in DP_RANK_NAMES:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: defines {node.name}")
            elif isinstance(node, ast.Dict) and any(
                isinstance(key, ast.Constant) and key.value == "num_replicas" for key in node.keys
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: builds the sampler's split")
    assert not found, "data-parallel rank computed outside ParallelDims:\n" + "\n".join(found)
