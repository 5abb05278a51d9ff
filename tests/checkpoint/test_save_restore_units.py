"""The checkpoint code on its own: ``dump_checkpoint`` and the restore work on a run's parts, no Trainer.

The parts are built by hand from a tiny module, its optimizer and scheduler, a ``Progress``, a
callback and a data module, with a real one-device plugin; the hooks are a small recorder standing
in for the hook runner. What the checkpoint holds (keys, order, values) and what a restore puts back
(weights, optimizer and scheduler state, loop position, generators) is checked value by value, and a
file the run cannot take is refused with nothing changed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from trainer_core import LightningDataModule, LightningModule
from trainer_core.__about__ import __version__
from trainer_core.callbacks import Callback
from trainer_core.checkpoint.format import (
    FORMAT_VERSION,
    KEY_CALLBACKS,
    KEY_DATAMODULE,
    KEY_DATAMODULE_HPARAMS,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_HPARAMS,
    KEY_LOOPS,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_PRECISION,
    KEY_RNG,
    KEY_STATE_DICT,
    KEY_VERSION,
    LOOP_BATCH_SIZE,
    LOOP_PENDING_PLATEAU,
    LOOP_WORLD_SIZE,
)
from trainer_core.checkpoint.restore import (
    resolve_ckpt_path,
    restore_checkpoint,
    restore_module_and_callbacks,
    restore_training_state,
)
from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states
from trainer_core.checkpoint.save import dump_checkpoint
from trainer_core.errors import CheckpointError
from trainer_core.loops.progress import Progress
from trainer_core.optim import LRSchedulerConfig
from trainer_core.plugins import SingleDevicePlugin
from trainer_core.precision import Precision
from trainer_core.run_state import CheckpointParts


class TinyModel(LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(width, 2)
        self.seen: list[str] = []

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen.append("module.on_save_checkpoint")
        checkpoint["module_note"] = len(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.seen.append("module.on_load_checkpoint")


class Counting(Callback):
    def __init__(self, seen: list[str]) -> None:
        self.count = 0
        self.seen = seen

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"]

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.seen.append(f"callback.on_save_checkpoint({trainer}, {len(checkpoint)} keys)")

    def on_load_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        self.seen.append(f"callback.on_load_checkpoint({trainer})")


class Data(LightningDataModule):
    def __init__(self, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class RecordingHooks:
    """The hook runner's checkpoint side: calls the hooks as it does, with ``"<trainer>"`` for the Trainer."""

    def __init__(self, module: LightningModule, callbacks: list[Callback]) -> None:
        self.module = module
        self.callbacks = callbacks
        self.running_now: list[str] = []

    def call_module(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, name)(*args, **kwargs)

    def call_callbacks_on_checkpoint(self, name: str, checkpoint: dict[str, Any]) -> None:
        for cb in self.callbacks:
            getattr(cb, name)("<trainer>", self.module, checkpoint)

    def setup_callback(self, callback: Any, stage: str) -> None:
        callback.setup("<trainer>", self.module, stage)

    def running(self, name: str) -> Any:
        raise AssertionError("the checkpoint code names its hooks through call_callbacks_on_checkpoint")


def _run(steps: int = 3, width: int = 3) -> tuple[CheckpointParts, list[str], list[str]]:
    """Parts of a run that took ``steps`` optimizer steps of Adam under StepLR."""
    torch.manual_seed(0)
    module = TinyModel(width)
    plugin = SingleDevicePlugin("cpu")
    plugin.connect(module)
    plugin.precision = Precision()
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    plugin.optimizers = [optimizer]
    plugin.lr_scheduler_configs = [LRSchedulerConfig(scheduler)]
    for _ in range(steps):
        module.layer(torch.randn(4, width)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    progress = Progress()
    progress.current_epoch = 1
    progress.global_step = steps
    progress.total_batch_idx = steps + 5
    progress.batches_that_stepped = steps + 5
    progress.batches_done_in_epoch = 2
    progress.loop_epoch = 1
    seen: list[str] = []
    callback = Counting(module.seen)
    callback.count = 11
    datamodule = Data()
    datamodule.position = 42
    restored: list[str] = []
    parts = CheckpointParts(
        module=module,
        plugin=plugin,
        progress=progress,
        hooks=RecordingHooks(module, [callback]),
        callbacks=[callback],
        datamodule=datamodule,
        train_dataloader=torch.utils.data.DataLoader(list(range(8)), batch_size=4),
        restored_from=restored.append,
    )
    return parts, seen, restored


def test_the_checkpoint_dict_holds_the_contract_keys_in_order_with_the_parts_values() -> None:
    parts, _, _ = _run()
    module, plugin, progress = parts.module, parts.plugin, parts.progress
    rng_before = collect_rng_states()
    checkpoint = dump_checkpoint(parts)

    assert list(checkpoint) == [
        KEY_FORMAT_VERSION,
        KEY_VERSION,
        KEY_EPOCH,
        KEY_GLOBAL_STEP,
        KEY_STATE_DICT,
        KEY_PLUGIN,
        KEY_HPARAMS,
        KEY_DATAMODULE_HPARAMS,
        KEY_OPTIMIZER_STATES,
        KEY_LR_SCHEDULERS,
        KEY_LOOPS,
        KEY_CALLBACKS,
        KEY_RNG,
        KEY_PRECISION,
        KEY_DATAMODULE,
        "module_note",
    ]
    assert checkpoint[KEY_FORMAT_VERSION] == FORMAT_VERSION and checkpoint[KEY_VERSION] == __version__
    assert (checkpoint[KEY_EPOCH], checkpoint[KEY_GLOBAL_STEP]) == (1, 3)
    assert checkpoint[KEY_PLUGIN] == {
        "name": "single_device",
        "world_size": 1,
        "layout": {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1},
        "precision": "32-true",
    }
    state = module.state_dict()
    assert list(checkpoint[KEY_STATE_DICT]) == ["layer.weight", "layer.bias"]
    assert all(torch.equal(checkpoint[KEY_STATE_DICT][k], state[k]) for k in state)
    assert checkpoint[KEY_HPARAMS] == {"width": 3}
    assert checkpoint[KEY_DATAMODULE_HPARAMS] == {"batch_size": 4}
    # Optimizer state keyed by parameter name, Adam's moments exactly the optimizer's.
    (named,) = checkpoint[KEY_OPTIMIZER_STATES]
    adam = plugin.optimizers[0].state[module.layer.weight]
    assert sorted(named["state"]) == ["layer.bias", "layer.weight"]
    assert torch.equal(named["state"]["layer.weight"]["exp_avg_sq"], adam["exp_avg_sq"])
    assert named["param_groups"][0]["params"] == ["layer.weight", "layer.bias"]
    assert checkpoint[KEY_LR_SCHEDULERS] == [plugin.lr_scheduler_configs[0].scheduler.state_dict()]
    assert checkpoint[KEY_LR_SCHEDULERS][0]["last_epoch"] == 3
    assert checkpoint[KEY_LOOPS] == {**progress.state_dict(), LOOP_WORLD_SIZE: 1, LOOP_BATCH_SIZE: 4}
    assert checkpoint[KEY_CALLBACKS] == {parts.callbacks[0].state_key: {"count": 11}}
    assert torch.equal(checkpoint[KEY_RNG]["torch"], rng_before["torch"])
    assert checkpoint[KEY_PRECISION] == {}
    assert checkpoint[KEY_DATAMODULE] == {"position": 42}
    # The callbacks' hook gets the Trainer (here the recorder's stand-in) before the module's, which runs last.
    assert module.seen == [
        "callback.on_save_checkpoint(<trainer>, 15 keys)",
        "module.on_save_checkpoint",
    ]
    assert checkpoint["module_note"] == 15


def test_a_weights_only_checkpoint_stops_after_the_hyper_parameters_and_skips_the_callbacks() -> None:
    parts, _, _ = _run()
    checkpoint = dump_checkpoint(parts, weights_only=True)
    assert list(checkpoint) == [
        KEY_FORMAT_VERSION,
        KEY_VERSION,
        KEY_EPOCH,
        KEY_GLOBAL_STEP,
        KEY_STATE_DICT,
        KEY_PLUGIN,
        KEY_HPARAMS,
        KEY_DATAMODULE_HPARAMS,
        "module_note",
    ]
    assert parts.module.seen == ["module.on_save_checkpoint"]


def test_callback_metrics_are_read_only_for_a_pending_plateau_step() -> None:
    parts, _, _ = _run(steps=1)
    reads: list[int] = []

    def metrics() -> dict[str, Any]:
        reads.append(1)
        return {"val_loss": torch.tensor(0.25)}

    parts.callback_metrics = metrics
    dump_checkpoint(parts)
    assert reads == []  # no ReduceLROnPlateau: nothing read

    optimizer = parts.plugin.optimizers[0]
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    parts.plugin.lr_scheduler_configs = [
        LRSchedulerConfig(plateau, reduce_on_plateau=True, monitor="val_loss")
    ]
    parts.progress.epoch_finished = True  # saved at the epoch's end, before its plateau step
    loops = dump_checkpoint(parts)[KEY_LOOPS]
    assert loops[LOOP_PENDING_PLATEAU] == {"val_loss": torch.tensor(0.25)}
    assert reads


def _save(parts: CheckpointParts, path: Path) -> dict[str, Any]:
    checkpoint = dump_checkpoint(parts)
    parts.plugin.save_checkpoint(checkpoint, str(path))
    return checkpoint


def test_a_restore_puts_weights_optimizer_schedulers_progress_and_generators_back_bit_exactly(
    tmp_path: Path,
) -> None:
    parts, _, restored = _run()
    module, plugin, progress = parts.module, parts.plugin, parts.progress
    path = tmp_path / "unit.ckpt"
    torch.manual_seed(1234)
    random.seed(5)
    np.random.seed(6)
    saved = _save(parts, path)
    expected_draws = (torch.rand(3), random.random(), np.random.rand())
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    moments = plugin.optimizers[0].state[module.layer.weight]["exp_avg"].clone()
    scheduler_state = plugin.lr_scheduler_configs[0].scheduler.state_dict()

    # The run goes on: weights, optimizer, scheduler, loop and generators all move.
    _run_more(parts)
    progress.global_step, progress.current_epoch, progress.total_batch_idx = 99, 9, 999
    parts.callbacks[0].count = 0
    parts.datamodule.position = 0
    assert not torch.equal(module.layer.weight, weights["layer.weight"])

    module.seen.clear()
    restore_checkpoint(parts, path)

    assert all(torch.equal(module.state_dict()[k], weights[k]) for k in weights)
    assert torch.equal(plugin.optimizers[0].state[module.layer.weight]["exp_avg"], moments)
    assert plugin.lr_scheduler_configs[0].scheduler.state_dict() == scheduler_state
    assert plugin.optimizers[0].param_groups[0]["lr"] == 0.05  # StepLR halved it at step 2
    assert (progress.global_step, progress.current_epoch, progress.total_batch_idx) == (3, 1, 8)
    assert progress.resume.batch_idx == 2 and progress.resume.mid_run
    assert parts.callbacks[0].count == 11 and parts.datamodule.position == 42
    assert restored == [str(path)]
    assert module.seen == ["module.on_load_checkpoint", "callback.on_load_checkpoint(<trainer>)"]
    # The generators come back as the paused position the next epoch starts from.
    assert torch.equal(progress.paused_rng["torch"], saved[KEY_RNG]["torch"])
    apply_rng_states(progress.paused_rng)
    draws = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], expected_draws[0]) and draws[1:] == expected_draws[1:]


def _run_more(parts: CheckpointParts) -> None:
    optimizer = parts.plugin.optimizers[0]
    parts.module.layer(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    parts.plugin.lr_scheduler_configs[0].scheduler.step()
    torch.rand(10)


def _snapshot(parts: CheckpointParts) -> tuple[Any, ...]:
    optimizer = parts.plugin.optimizers[0]
    return (
        {k: v.clone() for k, v in parts.module.state_dict().items()},
        {id(p): {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()},
        parts.plugin.lr_scheduler_configs[0].scheduler.state_dict(),
        parts.progress.state_dict(),
        parts.progress.global_step,
        parts.callbacks[0].count,
        parts.datamodule.position,
    )


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    weights_a, optim_a, *rest_a = a
    weights_b, optim_b, *rest_b = b
    same_weights = weights_a.keys() == weights_b.keys() and all(
        torch.equal(weights_a[k], weights_b[k]) for k in weights_a
    )
    same_optim = optim_a.keys() == optim_b.keys() and all(
        torch.equal(optim_a[p][k], optim_b[p][k]) for p in optim_a for k in optim_a[p]
    )
    return same_weights and same_optim and rest_a == rest_b


def test_a_checkpoint_of_another_shape_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    wide, _, _ = _run(width=5)
    path = tmp_path / "wide.ckpt"
    _save(wide, path)
    parts, _, restored = _run(width=3)
    before = _snapshot(parts)
    with pytest.raises(CheckpointError, match=r"layer\.weight"):
        restore_checkpoint(parts, path)
    assert _same(_snapshot(parts), before)
    assert restored == []


def test_optimizers_that_refuse_the_file_after_the_weights_loaded_get_the_weights_back(
    tmp_path: Path,
) -> None:
    """Lightning's order loads weights before ``configure_optimizers``; a refusal then puts them back."""
    saved, _, _ = _run()
    saved.plugin.lr_scheduler_configs = []  # the saved run had no scheduler
    path = tmp_path / "two_step.ckpt"
    _save(saved, path)
    parts, _, restored = _run(steps=0)
    weights = {k: v.clone() for k, v in parts.module.state_dict().items()}
    configs = parts.plugin.lr_scheduler_configs
    parts.plugin.optimizers, parts.plugin.lr_scheduler_configs = [], []  # before configure_optimizers
    pending = restore_module_and_callbacks(parts, path)
    assert pending is not None and restored == [str(path)]
    assert torch.equal(parts.module.layer.weight, saved.module.layer.weight)
    # This run's configure_optimizers returns a scheduler, whose state the file does not hold.
    parts.plugin.optimizers, parts.plugin.lr_scheduler_configs = [configs[0].scheduler.optimizer], configs
    progress_before = parts.progress.state_dict()
    with pytest.raises(CheckpointError, match="holds no scheduler state but configure_optimizers returned 1"):
        restore_training_state(parts, pending)
    assert all(torch.equal(parts.module.state_dict()[k], weights[k]) for k in weights)
    assert parts.progress.state_dict() == progress_before and parts.progress.global_step == 0


def test_best_without_a_checkpoint_callback_names_what_to_pass() -> None:
    parts, _, _ = _run(steps=0)
    with pytest.raises(CheckpointError, match='ckpt_path="best" needs a ModelCheckpoint'):
        resolve_ckpt_path(parts, "best")
    assert resolve_ckpt_path(parts, "some/file.ckpt") == "some/file.ckpt"
