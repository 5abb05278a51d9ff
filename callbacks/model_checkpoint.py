"""``ModelCheckpoint``: save the run every N steps or epochs, keep the best ``save_top_k``.

It only ever deletes files it wrote itself in this run's ``dirpath`` (recorded in its state), so
two runs sharing a folder never remove each other's checkpoints.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Optional, Union

import torch

from trainer_core import paths
from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

CHECKPOINT_EXT = ".ckpt"
CHECKPOINT_NAME_LAST = "last"
_MODES = {"min": (torch.lt, math.inf), "max": (torch.gt, -math.inf)}


class ModelCheckpoint(Callback):
    """Lightning's ``ModelCheckpoint`` arguments: ``dirpath``, ``filename``, ``monitor``, ``mode``, ..."""

    # Runs after the module's ``on_train_epoch_end`` so it sees what that hook logged.
    _monitors_metrics = True

    def __init__(
        self,
        dirpath: Optional[Union[str, Any]] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[bool] = None,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
    ) -> None:
        if mode not in _MODES:
            raise MisconfigurationException(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_top_k < -1:
            raise MisconfigurationException(
                f"ModelCheckpoint(save_top_k={save_top_k}): use -1 (all), 0 (none) or more."
            )
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise MisconfigurationException(
                f"ModelCheckpoint(save_top_k={save_top_k}) ranks checkpoints by a metric; set `monitor=` too."
            )
        if every_n_train_steps and every_n_epochs:
            raise MisconfigurationException(
                "ModelCheckpoint: set either every_n_train_steps or every_n_epochs, not both."
            )
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise MisconfigurationException(
                    f"ModelCheckpoint({name}={value!r}): use a non-negative integer."
                )
        self.dirpath: Optional[str] = str(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        self._every_n_train_steps = every_n_train_steps or 0
        self._every_n_epochs = (
            1 if every_n_epochs is None and not every_n_train_steps else (every_n_epochs or 0)
        )
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter

        self.best_k_models: dict[str, Any] = {}
        self.kth_best_model_path = ""
        self.best_model_score: Optional[torch.Tensor] = None
        self.best_model_path = ""
        self.last_model_path = ""
        self.current_score: Optional[torch.Tensor] = None
        # Files this callback wrote (this run or the one it resumed): the only ones it may delete.
        self._written: set[str] = set()
        self._last_global_step_saved = -1

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
        )

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:
            root = trainer.log_dir if trainer.loggers else trainer.default_root_dir
            self.dirpath = paths.join(root, "checkpoints")
        self.dirpath = trainer.plugin.broadcast(self.dirpath)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._skip(trainer) or not self._every_n_train_steps:
            return
        if trainer.global_step % self._every_n_train_steps != 0:
            return
        self._save(trainer, self._metrics(trainer))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (
            not self._skip(trainer)
            and self._should_save_on_train_epoch_end(trainer)
            and self._epoch_due(trainer)
        ):
            self._save(trainer, self._metrics(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if (
            trainer.state_stage != "fit"
            or self._skip(trainer)
            or self._should_save_on_train_epoch_end(trainer)
        ):
            return
        if self._epoch_due(trainer):
            self._save(trainer, self._metrics(trainer))

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "last_model_path": self.last_model_path,
            "written": sorted(self._written),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("dirpath") != self.dirpath and self.dirpath is not None:
            # A resumed run that writes elsewhere starts its own ranking (Lightning's rule).
            return
        self.best_model_score = state_dict.get("best_model_score")
        self.best_model_path = state_dict.get("best_model_path", "")
        self.current_score = state_dict.get("current_score")
        self.best_k_models = dict(state_dict.get("best_k_models", {}))
        self.kth_best_model_path = state_dict.get("kth_best_model_path", "")
        self.last_model_path = state_dict.get("last_model_path", "")
        self._written = set(state_dict.get("written", []))

    # ------------------------------------------------------------------ decisions
    def _skip(self, trainer: Trainer) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or trainer.sanity_checking
            or self._last_global_step_saved == trainer.global_step
        )

    def _epoch_due(self, trainer: Trainer) -> bool:
        every = self._every_n_epochs
        return every >= 1 and (trainer.current_epoch + 1) % every == 0

    def _should_save_on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self._save_on_train_epoch_end is not None:
            return self._save_on_train_epoch_end
        if trainer.check_val_every_n_epoch != 1:
            return False
        if not trainer._val_loaders_for_fit or sum(trainer.num_val_batches) == 0:
            return True
        return trainer.val_check_interval == 1.0

    def _metrics(self, trainer: Trainer) -> dict[str, Any]:
        metrics = dict(trainer.callback_metrics)
        metrics["epoch"] = torch.tensor(trainer.current_epoch)
        metrics["step"] = torch.tensor(trainer.global_step)
        return metrics

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self._last_global_step_saved = trainer.global_step
        if self.save_top_k != 0:
            if self.monitor is None:
                self._save_latest(trainer, metrics)
            else:
                self._save_monitored(trainer, metrics)
        if self.save_last:
            self._save_last(trainer, metrics)

    def _save_latest(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        filepath = trainer.plugin.broadcast(self._unique_path(self.format_checkpoint_name(metrics)))
        previous = self.best_model_path
        self._write(trainer, filepath)
        self.best_model_path = filepath
        if self.save_top_k != -1 and previous and previous != filepath:
            self._remove(trainer, previous)

    def _save_monitored(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        value = metrics.get(self.monitor)  # type: ignore[arg-type]
        if value is None:
            available = ", ".join(sorted(k for k in metrics if k not in ("epoch", "step"))) or "none"
            raise MisconfigurationException(
                f"ModelCheckpoint(monitor={self.monitor!r}) could not find that metric (logged metrics: {available}). "
                f"Log it with self.log({self.monitor!r}, ...) or change `monitor`."
            )
        current = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
        if torch.isnan(current):
            current = torch.tensor(_MODES[self.mode][1], dtype=torch.float64)
        self.current_score = current
        # Rank 0 decides for all: every rank must take part in the save (it is a collective).
        if not trainer.plugin.broadcast(self._improves_top_k(current)):
            return
        filepath = trainer.plugin.broadcast(self._unique_path(self.format_checkpoint_name(metrics)))
        self._write(trainer, filepath)
        self.best_k_models[filepath] = current
        dropped = None
        if self.save_top_k != -1 and len(self.best_k_models) > self.save_top_k:
            dropped = self._worst_path()
            self.best_k_models.pop(dropped)
        sign = 1 if self.mode == "min" else -1
        self.kth_best_model_path = self._worst_path()
        self.best_model_path = min(self.best_k_models, key=lambda p: float(self.best_k_models[p]) * sign)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if dropped is not None and dropped != filepath:
            self._remove(trainer, dropped)
        if self.verbose and trainer.is_global_zero:
            print(
                f"Epoch {trainer.current_epoch}, step {trainer.global_step}: {self.monitor} reached {float(current):.5g}; saved {filepath}"
            )

    def _improves_top_k(self, current: torch.Tensor) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        worst = self.best_k_models[self._worst_path()]
        return bool(_MODES[self.mode][0](current, torch.as_tensor(worst)))

    def _worst_path(self) -> str:
        sign = 1 if self.mode == "min" else -1
        return max(self.best_k_models, key=lambda p: float(self.best_k_models[p]) * sign)

    def _save_last(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        filepath = paths.join(self.dirpath or "", CHECKPOINT_NAME_LAST + CHECKPOINT_EXT)
        self._write(trainer, filepath)
        self.last_model_path = filepath

    def _write(self, trainer: Trainer, filepath: str) -> None:
        self._written.add(filepath)
        trainer.save_checkpoint(filepath, weights_only=self.save_weights_only)

    def _remove(self, trainer: Trainer, filepath: str) -> None:
        if filepath not in self._written or filepath in (self.best_model_path, self.last_model_path):
            return
        try:
            trainer.plugin.remove_checkpoint(filepath)
        except FileNotFoundError:
            rank_zero_warn(f"ModelCheckpoint: {filepath} was already removed.")
        self._written.discard(filepath)

    # ------------------------------------------------------------------ names
    def format_checkpoint_name(self, metrics: dict[str, Any], prefix: str = "") -> str:
        template = self.filename or "{epoch}-{step}"
        groups = re.findall(r"(\{.*?)[:\}]", template)
        values = {}
        for group in groups:
            name = group[1:]
            if self.auto_insert_metric_name:
                template = template.replace(group, f"{name}={{{name}", 1)
            value = metrics.get(name, 0)
            if isinstance(value, torch.Tensor):
                value = value.item()
            values[name] = value
        # str.format cannot take names with "/" or "."; substitute safe placeholders.
        safe: dict[str, Any] = {}
        for idx, (name, value) in enumerate(values.items()):
            key = f"m{idx}"
            template = template.replace("{" + name, "{" + key)
            safe[key] = value
        name = template.format(**safe)
        return paths.join(self.dirpath or "", f"{prefix}{name}{CHECKPOINT_EXT}")

    def _unique_path(self, filepath: str) -> str:
        if not self._enable_version_counter or filepath in self._written:
            return filepath
        fs, _ = paths.resolve(filepath)
        stem = filepath[: -len(CHECKPOINT_EXT)]
        version = 1
        candidate = filepath
        while fs.exists(paths.resolve(candidate)[1]):
            candidate = f"{stem}-v{version}{CHECKPOINT_EXT}"
            version += 1
        return candidate
