"""Stepping the learning-rate schedulers on Lightning's rule (interval, frequency, monitored metric)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.run_state import RunState


def update_lr_schedulers(trainer: RunState, interval: str, plateau: bool) -> None:
    """Step the schedulers of ``interval`` whose frequency is due (Lightning's rule)."""
    configs = trainer.plugin.lr_scheduler_configs
    if not configs:
        return
    progress = trainer.progress
    for config in configs:
        if config.reduce_on_plateau != plateau or config.interval != interval:
            continue
        index = (progress.batch_idx if interval == "step" else progress.current_epoch) + 1
        if index % config.frequency:
            continue
        metric = None
        if config.reduce_on_plateau:
            metric = trainer.callback_metrics.get(config.monitor)
            if metric is None:
                if config.strict:
                    available = ", ".join(sorted(trainer.callback_metrics)) or "none"
                    raise MisconfigurationException(
                        f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged (logged metrics: "
                        f"{available}). Log it with self.log({config.monitor!r}, ...) or change `monitor`."
                    )
                rank_zero_warn(
                    f"ReduceLROnPlateau watches {config.monitor!r}, which was not logged; the scheduler did not step."
                )
                continue
        trainer.hook_runner.call_module("lr_scheduler_step", config.scheduler, metric)
