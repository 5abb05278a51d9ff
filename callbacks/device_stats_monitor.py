"""``DeviceStatsMonitor``: the device's memory and utilisation at each batch's start and end, to the loggers.

Lightning's callback, with its metric names: on the CPU ``psutil``'s ``cpu_vm_percent``,
``cpu_percent`` and ``cpu_swap_percent``; on a CUDA device every entry of
``torch.cuda.memory_stats`` (bytes and counts). Each is logged as
``DeviceStatsMonitor.<hook>/<name>``, at the logging interval of training, so the step it costs is
one in ``log_every_n_steps``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

CPU_VM_PERCENT = "cpu_vm_percent"
CPU_PERCENT = "cpu_percent"
CPU_SWAP_PERCENT = "cpu_swap_percent"


def get_cpu_stats() -> dict[str, float]:
    """System-wide RAM, CPU and swap use in percent (``psutil``)."""
    try:
        import psutil
    except ImportError as err:
        raise ModuleNotFoundError(
            "DeviceStatsMonitor needs `psutil` for CPU stats, which is not installed: `pip install psutil`, "
            "or pass cpu_stats=False."
        ) from err
    return {
        CPU_VM_PERCENT: psutil.virtual_memory().percent,
        CPU_PERCENT: psutil.cpu_percent(),
        CPU_SWAP_PERCENT: psutil.swap_memory().percent,
    }


def get_device_stats(device: torch.device) -> dict[str, float]:
    """What Lightning's accelerator reports for ``device``: CUDA memory stats, or the CPU's stats."""
    if device.type == "cuda":
        return dict(torch.cuda.memory_stats(device))
    return get_cpu_stats()


class DeviceStatsMonitor(Callback):
    """Log device statistics during training, validation and testing (needs a logger).

    Args:
        cpu_stats: ``None`` (default): CPU stats when the run is on the CPU; ``True``: also beside a
            GPU's stats; ``False``: never CPU stats (on the CPU this logs nothing).
    """

    def __init__(self, cpu_stats: Optional[bool] = None) -> None:
        if cpu_stats not in (None, True, False):
            raise MisconfigurationException(
                f"DeviceStatsMonitor(cpu_stats={cpu_stats!r}): use None, True or False."
            )
        self._cpu_stats = cpu_stats
        # Validation and test batches of the current run: their logging interval (Lightning's).
        self._eval_batches = 0
        # The training batch's logging step, taken at its start (Lightning's counter does not move
        # before the batch's end hooks have run; the Trainer's already counts the batch there).
        self._train_step = 0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if not trainer.loggers:
            raise MisconfigurationException(
                "DeviceStatsMonitor logs to the loggers, but Trainer(logger=False) has none: give a logger or "
                "remove the callback."
            )
        if self._cpu_stats is not False and (self._cpu_stats or trainer.plugin.root_device.type == "cpu"):
            get_cpu_stats()  # fail here, at the start, when psutil is missing

    def _log_stats(self, trainer: Trainer, key: str, due: bool, step: int) -> None:
        if not due or not trainer.loggers:
            return
        device = trainer.plugin.root_device
        if self._cpu_stats is False and device.type == "cpu":
            return
        stats = get_device_stats(device)
        if self._cpu_stats and device.type != "cpu":
            stats.update(get_cpu_stats())
        for lg in trainer.loggers:
            separator = getattr(lg, "group_separator", "/")
            lg.log_metrics(
                {f"{type(self).__qualname__}.{key}{separator}{k}": v for k, v in stats.items()}, step=step
            )

    # Lightning's ``should_update_logs``: in training, the logging step of the batch (if it steps)
    # is due; in evaluation, every log_every_n_steps-th batch of the run.
    def _train_due(self, trainer: Trainer) -> bool:
        return (self._train_step + 1) % trainer.log_every_n_steps == 0 or trainer.should_stop

    def _eval_due(self, trainer: Trainer) -> bool:
        return self._eval_batches % trainer.log_every_n_steps == 0 or trainer.should_stop

    def _eval_step(self, trainer: Trainer) -> int:
        # Inside fit, validation runs after the Trainer counted the batch that called it.
        return (
            max(0, trainer.batches_that_stepped - 1)
            if trainer.state_stage == "fit"
            else trainer.batches_that_stepped
        )

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._train_step = trainer.batches_that_stepped
        self._log_stats(trainer, "on_train_batch_start", self._train_due(trainer), self._train_step)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._log_stats(trainer, "on_train_batch_end", self._train_due(trainer), self._train_step)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_batches = 0

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_batches = 0

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batches += 1
        self._log_stats(
            trainer, "on_validation_batch_start", self._eval_due(trainer), self._eval_step(trainer)
        )

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log_stats(trainer, "on_validation_batch_end", self._eval_due(trainer), self._eval_step(trainer))

    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._eval_batches += 1
        self._log_stats(trainer, "on_test_batch_start", self._eval_due(trainer), self._eval_step(trainer))

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._log_stats(trainer, "on_test_batch_end", self._eval_due(trainer), self._eval_step(trainer))
