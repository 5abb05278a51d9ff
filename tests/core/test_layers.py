"""The layering rules of docs/architecture.md, checked on the source.

* No private member of the Trainer is used outside ``trainer_core/trainer.py``: loops, checkpoint
  code, plugins and callbacks go through ``trainer.progress``, ``trainer.hook_runner``,
  ``trainer.metrics`` and the Trainer's public attributes.
* The core imports ``trainer_core.plugins`` and ``trainer_core.callbacks`` at import time in one
  module only (``trainer_core/connectors.py``, which builds them); plugins never import callbacks;
  callbacks never import the checkpoint IO's modules (they call ``CheckpointIO``'s public methods).
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
# Trainer's arguments, and LightningCLI, which builds a whole run (Trainer, module, callbacks) from a config
# and whose SaveConfigCallback is itself a callback.
FRONT_ENDS = {CORE / "connectors.py", CORE / "cli.py"}


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
