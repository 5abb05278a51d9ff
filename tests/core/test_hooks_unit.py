"""The hook door (``trainer_core/hooks.py``) without a Trainer: which hooks run, in which order, under which name.

The run is a ``SimpleNamespace`` with just what the hook runner reads (``callbacks``, ``datamodule``,
``lightning_module``, ``hook_runner``, the clipping options). Checked: only overridden batch hooks are
selected (callbacks first, then the module), ``current_fx`` names the hook while it runs and is
restored after, what runs between backward and step, and Lightning's rules for step signatures.
The order of every hook in a real run is ``test_hook_order_doc.py``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch

from trainer_core import LightningModule
from trainer_core.callbacks import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.hooks import BatchHooks, HookRunner, check_dataloader_idx, step_caller, takes_batch_idx


class Module(LightningModule):
    def __init__(self, calls: list[Any]) -> None:
        super().__init__()
        self.calls = calls
        self.layer = torch.nn.Linear(1, 1)
        # The run's hook runner, to record which hook it says is running.
        self.runner: Optional[HookRunner] = None

    def training_step(self, batch: Any) -> Any:  # no batch_idx: Lightning allows it
        self.calls.append(("training_step", batch))
        return batch

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.calls.append(("module", "on_train_batch_start", self.trainer_fx()))

    def on_fit_start(self) -> None:
        self.calls.append(("module", "on_fit_start", self.trainer_fx()))

    def trainer_fx(self) -> Optional[str]:
        return self.runner.current_fx if self.runner is not None else None


class Recorder(Callback):
    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.calls.append(("callback", "on_train_batch_start", batch, batch_idx))

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.calls.append(("callback", "on_before_optimizer_step"))

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        self.calls.append(("callback", "on_fit_start", trainer, module))


@pytest.fixture
def run() -> SimpleNamespace:
    """A run with one module and one callback that record their calls, and its hook runner."""
    calls: list[Any] = []
    fake = SimpleNamespace(
        callbacks=[Recorder(calls)],
        datamodule=None,
        lightning_module=Module(calls),
        gradient_clip_val=None,
        gradient_clip_algorithm=None,
        calls=calls,
    )
    fake.hook_runner = HookRunner(fake)
    fake.lightning_module.runner = fake.hook_runner
    return fake


def test_only_overridden_batch_hooks_are_selected_callbacks_first(run: SimpleNamespace) -> None:
    hooks = BatchHooks(run, run.lightning_module, run.callbacks)
    assert len(hooks.on_train_batch_start) == 2
    assert len(hooks.on_before_optimizer_step) == 1
    # Nobody listens: an empty tuple, one truth test per batch.
    assert hooks.on_after_backward == () and hooks.on_validation_batch_end == ()
    assert hooks.optimizer_step is False and hooks.optimizer_zero_grad is False
    run.hook_runner.run("on_train_batch_start", hooks.on_train_batch_start, "batch", 3)
    assert run.calls == [
        ("callback", "on_train_batch_start", "batch", 3),
        ("module", "on_train_batch_start", "on_train_batch_start"),
    ]


def test_call_runs_callbacks_then_the_module_and_restores_the_hook_name(run: SimpleNamespace) -> None:
    runner = run.hook_runner
    runner.current_fx = "training_step"
    runner.call("on_fit_start")
    # Callbacks get the run and its module, as Lightning passes them.
    assert run.calls == [
        ("callback", "on_fit_start", run, run.lightning_module),
        ("module", "on_fit_start", "on_fit_start"),
    ]
    assert runner.current_fx == "training_step"


def test_the_hook_name_is_restored_when_a_hook_raises(run: SimpleNamespace) -> None:
    runner = run.hook_runner

    def failing() -> None:
        raise ValueError("from the hook")

    run.lightning_module.on_fit_end = failing
    with pytest.raises(ValueError, match="from the hook"):
        runner.call_module("on_fit_end")
    assert runner.current_fx is None
    with runner.running("on_load_checkpoint"):
        assert runner.current_fx == "on_load_checkpoint"
    assert runner.current_fx is None


def test_call_module_returns_what_the_hook_returns(run: SimpleNamespace) -> None:
    optimizer = torch.optim.SGD(run.lightning_module.parameters(), lr=0.1)
    run.lightning_module.configure_optimizers = lambda: optimizer
    assert run.hook_runner.call_module("configure_optimizers") is optimizer


def test_nothing_runs_between_backward_and_step_unless_asked(run: SimpleNamespace) -> None:
    run.callbacks = []
    run.hook_runner.batch = BatchHooks(run, run.lightning_module, run.callbacks)
    assert run.hook_runner.make_after_closure(run.lightning_module) is None


def test_after_the_closure_hooks_then_clipping_with_the_trainers_values(run: SimpleNamespace) -> None:
    run.gradient_clip_val, run.gradient_clip_algorithm = 0.5, "value"
    module = run.lightning_module
    clipped: list[Any] = []

    def configure_gradient_clipping(
        optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        clipped.append((gradient_clip_val, gradient_clip_algorithm, run.hook_runner.current_fx))
        run.calls.append(("module", "configure_gradient_clipping"))

    module.configure_gradient_clipping = configure_gradient_clipping
    run.hook_runner.batch = BatchHooks(run, module, run.callbacks)
    after_closure = run.hook_runner.make_after_closure(module)
    after_closure(torch.optim.SGD(module.parameters(), lr=0.1))
    assert run.calls == [("callback", "on_before_optimizer_step"), ("module", "configure_gradient_clipping")]
    assert clipped == [(0.5, "value", "configure_gradient_clipping")]


def test_manual_optimization_clips_nothing_for_the_user(run: SimpleNamespace) -> None:
    run.gradient_clip_val = 1.0
    run.callbacks = []
    run.lightning_module.automatic_optimization = False
    run.hook_runner.batch = BatchHooks(run, run.lightning_module, run.callbacks)
    assert run.hook_runner.make_after_closure(run.lightning_module) is None


def test_a_step_without_batch_idx_is_called_without_it(run: SimpleNamespace) -> None:
    module = run.lightning_module
    call = step_caller(run, "training_step", module.training_step)
    assert call("batch", 7) == "batch" and run.calls == [("training_step", "batch")]
    full = lambda batch, batch_idx: (batch, batch_idx)  # noqa: E731
    module.validation_step = full
    assert step_caller(run, "validation_step", full) is full


@pytest.mark.parametrize(
    ("signature", "expected"),
    [
        (lambda batch: None, False),
        (lambda batch, batch_idx: None, True),
        (lambda batch, idx: None, True),  # a second positional parameter
        (lambda batch, *args: None, True),
        (lambda batch, *, batch_idx=0: None, True),  # named batch_idx, keyword-only
        (lambda batch, dataloader_idx=0: None, True),
        (print, True),  # a builtin: everything is passed, as before
    ],
)
def test_lightnings_rule_for_batch_idx(signature: Any, expected: bool) -> None:
    assert takes_batch_idx(signature) is expected


def test_dataloader_idx_must_match_the_number_of_loaders() -> None:
    def without(batch: Any, batch_idx: int) -> None: ...

    def required(batch: Any, batch_idx: int, dataloader_idx: int) -> None: ...

    def optional(batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...

    check_dataloader_idx(without, "validation_step", 1)
    check_dataloader_idx(optional, "validation_step", 1)
    check_dataloader_idx(optional, "validation_step", 3)
    with pytest.raises(MisconfigurationException) as raised:
        check_dataloader_idx(without, "validation_step", 2)
    assert str(raised.value) == (
        "2 dataloaders were given but `validation_step` has no `dataloader_idx` parameter: add "
        "`dataloader_idx=0` to its signature to tell the loaders apart."
    )
    with pytest.raises(
        MisconfigurationException, match=r"^One dataloader was given but `test_step` requires"
    ):
        check_dataloader_idx(required, "test_step", 1)
