"""The hook order that ``docs/architecture.md`` documents is the order a real run calls.

The document lists, for each run (``fit``, ``validate``, ``test``, ``predict``, a resumed ``fit``
and a ``fit`` stopped by an error), every hook a ``Callback`` and a ``LightningModule`` receive, in
fenced blocks that open with ```` ```hooks <run> ````. Each test here runs that run for real (CPU,
one device, a tiny ``Linear`` model, a ``ModelCheckpoint`` that saves) with a callback and a
module that record every hook on entry, and compares the recording with the document line by
line: a change of order in the code without the document, or in the document without the code,
fails here.

The recorders override every hook, so they also receive the hooks the Trainer calls only when a
user overrides them (the batch-transfer hooks, ``optimizer_step``, ``configure_gradient_clipping``,
...): the documented order is the one a user who overrides everything sees.

Format of a block, as :func:`parse_hook_blocks` reads it:

* one hook per line, ``Callback.<name>`` or ``LightningModule.<name>``; a ``#`` starts a comment;
  indentation is free (the document indents what runs inside another hook);
* ``for each <kind> batch:`` (``training``, ``validation``, ``test``, ``predict``) repeats the lines
  indented under it once per batch of that kind; the test knows how many batches each run has.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any, Callable, Union

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer
from trainer_core.callbacks import Callback, ModelCheckpoint

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"

# What the user calls on the module (its API), as opposed to the hooks the Trainer calls.
MODULE_API = frozenset(
    {
        "forward",
        "log",
        "log_dict",
        "all_gather",
        "print",
        "save_hyperparameters",
        "optimizers",
        "lr_schedulers",
        "manual_backward",
        "toggle_optimizer",
        "untoggle_optimizer",
        "clip_gradients",
        "freeze",
        "unfreeze",
        "toggled_optimizer",
        "to_torchscript",
        "to_onnx",
    }
)


def _public_functions(cls: type) -> list[str]:
    return sorted(
        name for name, fn in vars(cls).items() if inspect.isfunction(fn) and not name.startswith("_")
    )


# Every hook there is: a hook added to either class is recorded, and must be documented.
# What a callback calls on itself (its API), not a hook the Trainer calls.
CALLBACK_API = frozenset({"generate_state_key"})
CALLBACK_HOOKS = [name for name in _public_functions(Callback) if name not in CALLBACK_API]
MODULE_HOOKS = [name for name in _public_functions(LightningModule) if name not in MODULE_API]

TRAIN_BATCHES = 2
VAL_BATCHES = 1
TEST_BATCHES = 2
PREDICT_BATCHES = 2

# ---------------------------------------------------------------------- the document
_BLOCK = re.compile(
    r"^```hooks[ \t]+(?P<run>[\w-]+)[ \t]*\n(?P<body>.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL
)
_HOOK = re.compile(r"^(Callback|LightningModule)\.[a-z_]+$")
_LOOP = re.compile(r"^for each (?P<kind>training|validation|test|predict) batch:$")

Loop = tuple[str, list[str]]
Entry = Union[str, Loop]


def parse_hook_blocks(text: str) -> dict[str, list[Entry]]:
    """``{run: entries}`` from the ```` ```hooks <run> ```` blocks of ``text``.

    An entry is a hook (``"Callback.setup"``) or a loop ``(kind, hooks)`` for a
    ``for each <kind> batch:`` line and the lines indented under it.
    """
    blocks: dict[str, list[Entry]] = {}
    for match in _BLOCK.finditer(text):
        run = match.group("run")
        if run in blocks:
            raise ValueError(f"docs/architecture.md: two `hooks {run}` blocks; keep one per run.")
        blocks[run] = _parse_block(run, match.group("body"))
    return blocks


def _parse_block(run: str, body: str) -> list[Entry]:
    entries: list[Entry] = []
    loop_indent = -1
    for number, raw in enumerate(body.splitlines(), start=1):
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        text = line.strip()
        where = f"docs/architecture.md, block `hooks {run}`, line {number}"
        if loop_indent >= 0 and indent <= loop_indent:
            loop_indent = -1
        loop = _LOOP.match(text)
        if loop:
            if loop_indent >= 0:
                raise ValueError(f"{where}: {text!r} inside another loop; loops do not nest.")
            entries.append((loop.group("kind"), []))
            loop_indent = indent
        elif _HOOK.match(text):
            if loop_indent >= 0:
                entries[-1][1].append(text)  # type: ignore[union-attr]
            else:
                entries.append(text)
        else:
            raise ValueError(
                f"{where}: {text!r} is neither `Callback.<hook>`, `LightningModule.<hook>` "
                "nor `for each <training|validation|test|predict> batch:`."
            )
    return entries


def expand(entries: list[Entry], batches: dict[str, int]) -> list[str]:
    """The flat hook sequence of a block, each loop repeated ``batches[kind]`` times."""
    out: list[str] = []
    for entry in entries:
        if isinstance(entry, str):
            out.append(entry)
        else:
            kind, hooks = entry
            out.extend(hooks * batches[kind])
    return out


@pytest.fixture(scope="module")
def documented() -> dict[str, list[Entry]]:
    assert DOC.is_file(), f"{DOC} is missing: it documents the hook order these tests check."
    return parse_hook_blocks(DOC.read_text())


# ---------------------------------------------------------------------- recorders
class TinyModule(LightningModule):
    """A Linear regression with its own data, optimizer and a per-step scheduler."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        # interval="step": the scheduler steps in every batch, so every training batch calls the same hooks.
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _loader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(0)
        return DataLoader(
            TensorDataset(torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)), batch_size=2
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader()

    def val_dataloader(self) -> DataLoader:
        return self._loader()

    def test_dataloader(self) -> DataLoader:
        return self._loader()

    def predict_dataloader(self) -> DataLoader:
        return self._loader()


class FailingModule(TinyModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        raise RuntimeError("training_step failed on purpose")


class StatefulCallback(Callback):
    """A callback with state, so that a checkpoint holds it and a resume loads it."""

    def state_dict(self) -> dict[str, Any]:
        return {"recorded": True}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def _recording(owner: str, name: str, implementation: Callable[..., Any]) -> Callable[..., Any]:
    # Deliberately not functools.wraps: the Trainer must see every hook as overridden.
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.called.append(f"{owner}.{name}")
        return implementation(self, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


def recording_module(base: type[TinyModule], called: list[str]) -> TinyModule:
    cls = type(
        f"Recording{base.__name__}",
        (base,),
        {name: _recording("LightningModule", name, getattr(base, name)) for name in MODULE_HOOKS},
    )
    module = cls()
    module.called = called
    return module


RecordingCallback = type(
    "RecordingCallback",
    (StatefulCallback,),
    {name: _recording("Callback", name, getattr(StatefulCallback, name)) for name in CALLBACK_HOOKS},
)


def recording_callback(called: list[str]) -> Callback:
    callback = RecordingCallback()
    callback.called = called
    return callback


def _trainer(tmp_path: Path, callback: Callback, **overrides: Any) -> Trainer:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=TRAIN_BATCHES,
        limit_val_batches=VAL_BATCHES,
        limit_test_batches=TEST_BATCHES,
        limit_predict_batches=PREDICT_BATCHES,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback, ModelCheckpoint(dirpath=tmp_path / "checkpoints")],
    )
    kwargs.update(overrides)
    return Trainer(**kwargs)


def _diff(called: list[str], expected: list[str]) -> str:
    for i, (got, want) in enumerate(zip(called, expected)):
        if got != want:
            lo = max(0, i - 3)
            return (
                f"first difference at call {i}: the run called {called[lo : i + 4]}, "
                f"docs/architecture.md says {expected[lo : i + 4]}"
            )
    return f"the run made {len(called)} calls, docs/architecture.md lists {len(expected)}: {called[len(expected) :] or expected[len(called) :]}"


def _check(documented: dict[str, list[Entry]], run: str, called: list[str], batches: dict[str, int]) -> None:
    assert run in documented, f"docs/architecture.md has no `hooks {run}` block."
    expected = expand(documented[run], batches)
    assert called == expected, _diff(called, expected)


# ---------------------------------------------------------------------- the runs
def test_fit(tmp_path: Path, documented: dict[str, list[Entry]]) -> None:
    called: list[str] = []
    trainer = _trainer(tmp_path, recording_callback(called))
    trainer.fit(recording_module(TinyModule, called))
    assert trainer.global_step == TRAIN_BATCHES
    assert trainer.checkpoint_callback.best_model_path  # the checkpoint hooks ran for a real save
    _check(documented, "fit", called, {"training": TRAIN_BATCHES, "validation": VAL_BATCHES})


@pytest.mark.parametrize(
    ("stage", "kind", "count"), [("validate", "validation", VAL_BATCHES), ("test", "test", TEST_BATCHES)]
)
def test_evaluation(
    tmp_path: Path, documented: dict[str, list[Entry]], stage: str, kind: str, count: int
) -> None:
    called: list[str] = []
    trainer = _trainer(tmp_path, recording_callback(called))
    (metrics,) = getattr(trainer, stage)(recording_module(TinyModule, called), verbose=False)
    assert f"{'val' if stage == 'validate' else 'test'}_loss" in metrics
    _check(documented, stage, called, {kind: count})


def test_predict(tmp_path: Path, documented: dict[str, list[Entry]]) -> None:
    called: list[str] = []
    trainer = _trainer(tmp_path, recording_callback(called))
    predictions = trainer.predict(recording_module(TinyModule, called))
    assert len(predictions) == PREDICT_BATCHES
    _check(documented, "predict", called, {"predict": PREDICT_BATCHES})


def test_fit_resumed(tmp_path: Path, documented: dict[str, list[Entry]]) -> None:
    """A second epoch from the checkpoint the first one saved (no validation, as Lightning's own test)."""
    first = _trainer(tmp_path, recording_callback([]), limit_val_batches=0)
    first.fit(recording_module(TinyModule, []))
    ckpt_path = first.checkpoint_callback.best_model_path

    called: list[str] = []
    trainer = _trainer(tmp_path, recording_callback(called), limit_val_batches=0, max_epochs=2)
    trainer.fit(recording_module(TinyModule, called), ckpt_path=ckpt_path)
    assert trainer.global_step == 2 * TRAIN_BATCHES
    _check(documented, "fit-resumed", called, {"training": TRAIN_BATCHES})


def test_fit_failed(tmp_path: Path, documented: dict[str, list[Entry]]) -> None:
    """An error in ``training_step``: ``on_exception``, and no teardown hooks (Lightning's rule)."""
    called: list[str] = []
    trainer = _trainer(tmp_path, recording_callback(called), limit_val_batches=0)
    with pytest.raises(RuntimeError, match="on purpose"):
        trainer.fit(recording_module(FailingModule, called))
    _check(documented, "fit-failed", called, {})


def test_every_hook_is_documented(documented: dict[str, list[Entry]]) -> None:
    """A hook added to Callback or LightningModule must find its place in the document."""
    named = {
        hook
        for entries in documented.values()
        for hook in expand(entries, dict.fromkeys(("training", "validation", "test", "predict"), 1))
    }
    every = {f"Callback.{name}" for name in CALLBACK_HOOKS} | {
        f"LightningModule.{name}" for name in MODULE_HOOKS
    }
    assert not every - named, (
        f"hooks no block of docs/architecture.md lists: {sorted(every - named)}; add them where a run calls them "
        "(or, for a method the user calls, to MODULE_API in this file)."
    )
    assert not named - every, f"docs/architecture.md lists hooks that do not exist: {sorted(named - every)}"


def test_parser_repeats_loops_and_refuses_unknown_lines() -> None:
    text = (
        "```hooks demo\n"
        "Callback.on_train_start  # a comment\n"
        "for each training batch:\n"
        "    Callback.on_train_batch_start\n"
        "        LightningModule.training_step\n"
        "LightningModule.on_train_end\n"
        "```\n"
    )
    (entries,) = parse_hook_blocks(text).values()
    assert expand(entries, {"training": 2}) == [
        "Callback.on_train_start",
        "Callback.on_train_batch_start",
        "LightningModule.training_step",
        "Callback.on_train_batch_start",
        "LightningModule.training_step",
        "LightningModule.on_train_end",
    ]
    with pytest.raises(ValueError, match="on_train_start\\(\\)"):
        parse_hook_blocks("```hooks demo\nCallback.on_train_start()\n```\n")
