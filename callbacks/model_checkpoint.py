"""``ModelCheckpoint``: save the run every N steps, N epochs or N minutes; keep the best ``save_top_k``.

Lightning 2.x's arguments and attributes (``best_model_path``, ``best_model_score``,
``best_k_models``, ``last_model_path``), with three rules of its own:

* It only ever deletes checkpoints it wrote itself (recorded in its state, so a resumed run may
  delete what the run it continues wrote), never the one the run resumed from: two runs sharing a
  folder, local or on an object store, never remove each other's files. A name another run already
  used gets a version suffix (``-v1``) instead of being overwritten.
* ``save_last="link"`` makes ``last.ckpt`` point at the checkpoint written last instead of writing
  the run a second time: a relative symlink on local disk, a server-side copy published with its
  commit marker on object stores (which have no links).
* A checkpoint a newer one replaces is deleted only after ``last.ckpt`` no longer points at it.

When ``last.ckpt`` is written is Lightning 2.6's rule, so that a program resuming from it resumes
at the epoch it does under Lightning: with every save of ``every_n_train_steps`` /
``train_time_interval``; at an epoch's end (or its validation's) only when a checkpoint was saved
at that step (with ``"link"``: whenever one was ever saved, pointing at it); and at the end of
training when nothing was saved before. Automatic restarts lose nothing by it: they resume from the
newest complete checkpoint of the folder, whatever its name.

Sharded checkpoints (folders written by ``DistributedCheckpointIO``) are handled like files.
"""

from __future__ import annotations

import math
import os
import re
import time
from datetime import timedelta
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
CHECKPOINT_JOIN_CHAR = "-"
CHECKPOINT_EQUALS_CHAR = "="
STARTING_VERSION = 1
_MODES = {"min": (torch.lt, math.inf), "max": (torch.gt, -math.inf)}
# ``{name}`` or ``{name:format}`` in a filename template.
_TEMPLATE_FIELD = re.compile(r"\{([^{}:]+)(:[^{}]*)?\}")


class ModelCheckpoint(Callback):
    """Lightning's ``ModelCheckpoint``.

    Args:
        dirpath: folder (any fsspec URL); default ``<logger.log_dir>/checkpoints`` or
            ``<default_root_dir>/checkpoints``.
        filename: template such as ``"{epoch}-{val_loss:.2f}"``; default ``"{epoch}-{step}"``.
        monitor: metric that ranks checkpoints; ``None`` keeps the latest.
        save_last: ``True`` also writes ``last.ckpt`` whenever a checkpoint is saved (Lightning's
            rule, above); ``"link"`` points it at the checkpoint written last (symlink locally,
            server-side copy on object stores).
        save_top_k: how many ranked checkpoints to keep (``-1`` all, ``0`` none).
        save_on_exception: when an exception stops the run, save it as it stands (and ``last``).
        auto_insert_metric_name: ``"{epoch}"`` becomes ``"epoch=3"`` (``False``: ``"3"``).
        every_n_train_steps / train_time_interval / every_n_epochs: when to save (at most one);
            without any, after every epoch (after its validation when there is one).
        save_on_train_epoch_end: save at the end of the training epoch rather than after
            validation; ``None`` decides as Lightning does.
        enable_version_counter: a name that exists already gets ``-v1``, ``-v2``, ... instead of
            overwriting it.
    """

    CHECKPOINT_NAME_LAST = CHECKPOINT_NAME_LAST
    FILE_EXTENSION = CHECKPOINT_EXT

    def __init__(
        self,
        dirpath: Optional[Union[str, os.PathLike]] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        verbose: bool = False,
        save_last: Optional[Union[bool, str]] = None,
        save_top_k: int = 1,
        save_on_exception: bool = False,
        save_weights_only: bool = False,
        mode: str = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        enable_version_counter: bool = True,
    ) -> None:
        if mode not in _MODES:
            raise MisconfigurationException(f"ModelCheckpoint(mode={mode!r}): use 'min' or 'max'.")
        if save_last not in (None, True, False, "link"):
            raise MisconfigurationException(
                f"ModelCheckpoint(save_last={save_last!r}): use True, False or 'link'."
            )
        if not isinstance(save_top_k, int) or save_top_k < -1:
            raise MisconfigurationException(
                f"ModelCheckpoint(save_top_k={save_top_k!r}): use -1 (all), 0 (none) or more."
            )
        if monitor is None and save_top_k not in (-1, 0, 1):
            raise MisconfigurationException(
                f"ModelCheckpoint(save_top_k={save_top_k}) ranks checkpoints by a metric; set `monitor=` too."
            )
        for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise MisconfigurationException(
                    f"ModelCheckpoint({name}={value!r}): use a non-negative integer."
                )
        if train_time_interval is not None and (
            not isinstance(train_time_interval, timedelta) or train_time_interval.total_seconds() <= 0
        ):
            raise MisconfigurationException(
                f"ModelCheckpoint(train_time_interval={train_time_interval!r}): use a positive datetime.timedelta."
            )
        triggers = [
            f"{n}={v!r}"
            for n, v in (
                ("every_n_train_steps", every_n_train_steps),
                ("every_n_epochs", every_n_epochs),
                ("train_time_interval", train_time_interval),
            )
            if v
        ]
        if len(triggers) > 1:
            raise MisconfigurationException(
                f"ModelCheckpoint({', '.join(triggers)}): these triggers exclude each other; set only one."
            )
        self.dirpath: Optional[str] = os.fspath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.verbose = verbose
        self.save_last = save_last
        self.save_top_k = save_top_k
        self.save_on_exception = save_on_exception
        self.save_weights_only = save_weights_only
        self.mode = mode
        self.auto_insert_metric_name = auto_insert_metric_name
        no_trigger = every_n_train_steps is None and every_n_epochs is None and train_time_interval is None
        self._every_n_train_steps = every_n_train_steps or 0
        self._every_n_epochs = 1 if no_trigger else (every_n_epochs or 0)
        self._train_time_interval = train_time_interval
        self._save_on_train_epoch_end = save_on_train_epoch_end
        self._enable_version_counter = enable_version_counter

        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value = torch.tensor(_MODES[mode][1])
        self.best_model_score: Optional[torch.Tensor] = None
        self.best_model_path = ""
        self.last_model_path = ""
        self.current_score: Optional[torch.Tensor] = None
        # Checkpoints this callback wrote (this run or the one it resumed): the only ones it may delete.
        self._written: set[str] = set()
        # Lightning's rule: nothing is saved before the first optimizer step, and a step is saved once
        # (so a batch that only accumulates gradients never triggers a step-based save).
        self._last_global_step_saved = 0
        # The checkpoint written last: what ``save_last="link"`` points at.
        self._last_checkpoint_saved = ""
        self._last_time_checked: Optional[float] = None
        self._validation_ran = False

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    @property
    def every_n_epochs(self) -> int:
        return self._every_n_epochs

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:
            root = trainer.log_dir if trainer.loggers else trainer.default_root_dir
            self.dirpath = paths.join(root, "checkpoints")
            # Under a logger the folder is this run's version; a resumed run gets the next version.
            self._versions_root = _versions_root(root) if trainer.loggers else None
        self.dirpath = trainer.plugin.broadcast(self.dirpath)

    def resume_search_dirs(self) -> list[str]:
        """Where ``fit(ckpt_path="last")`` looks: ``dirpath``, and the checkpoints of earlier versions.

        With the default ``dirpath`` (``<logger's log_dir>/checkpoints``) a requeued job logs to a
        new ``version_N``, so the checkpoints of the run it continues are in a sibling folder.
        """
        assert self.dirpath is not None
        found = [self.dirpath]
        root = getattr(self, "_versions_root", None)
        if root is None:
            return found
        fs, path = paths.resolve(root)
        try:
            entries = fs.ls(path, detail=False)
        except (FileNotFoundError, OSError):
            return found
        for entry in entries:
            name = str(entry).rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("version_"):
                candidate = paths.join(root, name, "checkpoints")
                if candidate != self.dirpath:
                    found.append(candidate)
        return found

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A resumed run's step was saved (or not due) in the run that wrote the checkpoint.
        self._last_global_step_saved = max(self._last_global_step_saved, trainer.global_step)
        self._last_time_checked = time.monotonic()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        every = self._every_n_train_steps
        if not every and self._train_time_interval is None:
            return  # saves by epoch: nothing to do per batch
        if self._skip(trainer):
            return
        due = bool(every) and trainer.global_step % every == 0
        interval = self._train_time_interval
        if interval is not None:
            now = time.monotonic()
            elapsed = now - (self._last_time_checked if self._last_time_checked is not None else now)
            # Clocks differ across ranks; saving is a collective, so every rank must agree.
            time_due = trainer.plugin.reduce_boolean_decision(elapsed >= interval.total_seconds(), all=False)
            if time_due:
                self._last_time_checked = now
            due = due or time_due
        if due:
            self._save(trainer, self._metrics(trainer), topk=True)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._skip(trainer) and self._should_save_on_train_epoch_end(trainer):
            self._save(trainer, self._metrics(trainer), topk=self._epoch_due(trainer), last_always=False)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state_stage != "fit" or trainer.sanity_checking:
            return
        self._validation_ran = True
        if not self._skip(trainer) and not self._should_save_on_train_epoch_end(trainer):
            self._save(trainer, self._metrics(trainer), topk=self._epoch_due(trainer), last_always=False)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning's rule: a run that saved nothing still ends with its last.ckpt.
        if self.save_last and not self._last_checkpoint_saved:
            self._save(trainer, self._metrics(trainer), topk=False)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if (
            not self.save_on_exception
            or trainer.fast_dev_run
            or trainer.sanity_checking
            or self._last_global_step_saved == trainer.global_step
        ):
            return
        metrics = self._metrics(trainer)
        # Lightning's rule: the run as the exception left it, under the plain name (overwriting one taken).
        self._write(trainer, self.format_checkpoint_name(metrics))
        replaced = self._save_last(trainer, metrics) if self.save_last else []
        for path in replaced:
            self._remove(trainer, path)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": self.current_score,
            "dirpath": self.dirpath,
            "best_k_models": dict(self.best_k_models),
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": self.kth_value,
            "last_model_path": self.last_model_path,
            "written": sorted(self._written),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved_dir = state_dict.get("dirpath", self.dirpath)
        if self.dirpath is not None and saved_dir != self.dirpath:
            # A resumed run that writes elsewhere starts its own ranking (Lightning's rule).
            # Paths stored in a checkpoint are trusted only inside this run's own folder (below).
            rank_zero_warn(
                f"ModelCheckpoint: the checkpoint was written to {saved_dir!r} and this run writes to "
                f"{self.dirpath!r}; the top-k ranking and `best_model_path` start afresh."
            )
            return
        # A checkpoint's contents never choose a file to open or delete: every stored path must be a
        # name directly inside this run's dirpath, as this callback writes them; others are dropped.
        inside = self._inside_dirpath
        self.best_model_score = state_dict.get("best_model_score")
        self.best_model_path = inside(state_dict.get("best_model_path", ""))
        self.current_score = state_dict.get("current_score")
        self.best_k_models = {p: v for p, v in dict(state_dict.get("best_k_models", {})).items() if inside(p)}
        self.kth_best_model_path = inside(state_dict.get("kth_best_model_path", ""))
        self.kth_value = state_dict.get("kth_value", self.kth_value)
        self.last_model_path = inside(state_dict.get("last_model_path", ""))
        self._written = {p for p in state_dict.get("written", []) if inside(p)}

    def _inside_dirpath(self, path: Any) -> str:
        """``path`` if it names an entry directly inside ``dirpath``, else ``""``."""
        if not isinstance(path, str) or self.dirpath is None:
            return ""
        prefix = self.dirpath.rstrip("/") + "/"
        name = path[len(prefix) :]
        if not path.startswith(prefix) or not name or name in (".", "..") or "/" in name or "\\" in name:
            return ""
        return path

    # ------------------------------------------------------------------ decisions
    def _skip(self, trainer: Trainer) -> bool:
        return (
            bool(trainer.fast_dev_run)
            or trainer.state_stage != "fit"
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
        if sum(trainer.num_val_batches) == 0:
            return True
        return trainer.val_check_interval == 1.0

    def _metrics(self, trainer: Trainer) -> dict[str, Any]:
        metrics = dict(trainer.callback_metrics)
        epoch, step = metrics.get("epoch"), metrics.get("step")
        metrics["epoch"] = (
            epoch.int() if isinstance(epoch, torch.Tensor) else torch.tensor(trainer.current_epoch)
        )
        metrics["step"] = step.int() if isinstance(step, torch.Tensor) else torch.tensor(trainer.global_step)
        return metrics

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: Trainer, metrics: dict[str, Any], topk: bool, last_always: bool = True) -> None:
        """One save event: the ranked checkpoint if due, then ``last``, then what they replaced.

        Without ``last_always`` (an epoch's end), ``last`` follows only a checkpoint saved at this
        step, or with ``"link"`` any saved before (Lightning's rule).
        """
        replaced: list[str] = []
        if topk and self.save_top_k != 0:
            if self.monitor is None:
                replaced = self._save_latest(trainer, metrics)
            else:
                replaced = self._save_monitored(trainer, metrics)
        saved_now = self._last_global_step_saved == trainer.global_step
        linkable = self.save_last == "link" and bool(self._last_checkpoint_saved)
        if self.save_last and (last_always or saved_now or linkable):
            replaced += self._save_last(trainer, metrics)
        for path in replaced:
            self._remove(trainer, path)
        if trainer.is_global_zero:
            # Loggers that upload checkpoints (MLFlowLogger, WandbLogger with log_model) read what is kept now.
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

    def _save_latest(self, trainer: Trainer, metrics: dict[str, Any]) -> list[str]:
        previous = self.best_model_path
        filepath = self._unique_path(trainer, self.format_checkpoint_name(metrics), replaceable=previous)
        self.best_model_path = filepath
        self._write(trainer, filepath)
        if self.save_top_k == 1 and previous and previous != filepath:
            return [previous]
        return []

    def _save_monitored(self, trainer: Trainer, metrics: dict[str, Any]) -> list[str]:
        assert self.monitor is not None
        value = metrics.get(self.monitor)
        if value is None:
            self._missing_monitor(trainer, metrics)
            return []
        current = torch.as_tensor(value, dtype=torch.float64).detach().cpu().squeeze()
        if torch.isnan(current):
            current = torch.tensor(_MODES[self.mode][1], dtype=torch.float64)
        self.current_score = current
        # Rank 0 decides for all: every rank must take part in the save (it is a collective).
        if not trainer.plugin.broadcast(self._improves_top_k(current)):
            if self.verbose and trainer.is_global_zero:
                print(
                    f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {self.monitor!r} "
                    f"was not in top {self.save_top_k}"
                )
            return []
        k = len(self.best_k_models) + 1 if self.save_top_k == -1 else self.save_top_k
        dropped = ""
        if len(self.best_k_models) == k:
            dropped = self.kth_best_model_path
            self.best_k_models.pop(dropped)
        filepath = self._unique_path(trainer, self.format_checkpoint_name(metrics), replaceable=dropped)
        self.best_k_models[filepath] = current
        if len(self.best_k_models) == k:
            self.kth_best_model_path = self._worst_path()
            self.kth_value = self.best_k_models[self.kth_best_model_path]
        sign = 1 if self.mode == "min" else -1
        self.best_model_path = min(self.best_k_models, key=lambda p: float(self.best_k_models[p]) * sign)
        self.best_model_score = self.best_k_models[self.best_model_path]
        if self.verbose and trainer.is_global_zero:
            print(
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {self.monitor!r} reached "
                f"{float(current):.5f} (best {float(self.best_model_score):.5f}), saving model to "
                f"{filepath!r} as top {k}"
            )
        self._write(trainer, filepath)
        return [dropped] if dropped and dropped != filepath else []

    def _missing_monitor(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        available = ", ".join(sorted(k for k in metrics if k not in ("epoch", "step"))) or "none"
        message = (
            f"ModelCheckpoint(monitor={self.monitor!r}) could not find that metric (logged metrics: {available}). "
            f"Log it with self.log({self.monitor!r}, ...) or change `monitor`."
        )
        # Before the first validation a validation metric cannot be there yet (Lightning warns then).
        if self._validation_ran or sum(trainer.num_val_batches) == 0:
            raise MisconfigurationException(message)
        rank_zero_warn(message)

    def _improves_top_k(self, current: torch.Tensor) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        worst = self.best_k_models[self._worst_path()]
        return bool(_MODES[self.mode][0](current, torch.as_tensor(worst, dtype=current.dtype)))

    def _worst_path(self) -> str:
        sign = 1 if self.mode == "min" else -1
        return max(self.best_k_models, key=lambda p: float(self.best_k_models[p]) * sign)

    def _save_last(self, trainer: Trainer, metrics: dict[str, Any]) -> list[str]:
        previous = self.last_model_path
        filepath = self._unique_path(
            trainer,
            self.format_checkpoint_name(metrics, filename=CHECKPOINT_NAME_LAST),
            replaceable=previous,
        )
        self.last_model_path = filepath
        target = self._last_checkpoint_saved
        if self.save_last == "link" and target and self.save_top_k != 0:
            if target != filepath:  # else it is already the checkpoint written last
                self._written.add(filepath)
                self._link(trainer, target, filepath)
        else:
            self._write(trainer, filepath)  # the IO replaces a link at ``filepath`` as it replaces a file
        return [previous] if previous and previous != filepath else []

    def _write(self, trainer: Trainer, filepath: str) -> None:
        self._written.add(filepath)
        trainer.save_checkpoint(filepath, weights_only=self.save_weights_only)
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath

    def _remove(self, trainer: Trainer, filepath: str) -> None:
        keep = {self.best_model_path, self.last_model_path, *self.best_k_models}
        if self.save_last == "link" and self.last_model_path:
            keep.add(self._last_checkpoint_saved)
        if trainer.ckpt_path is not None:
            keep.add(os.fspath(trainer.ckpt_path))
        if filepath not in self._written or filepath in keep:
            return
        try:
            trainer.plugin.remove_checkpoint(filepath)
        except FileNotFoundError:
            rank_zero_warn(f"ModelCheckpoint: {filepath} was already removed.")
        self._written.discard(filepath)

    def _link(self, trainer: Trainer, target: str, linkpath: str) -> None:
        """Make ``linkpath`` show the checkpoint at ``target`` without writing the run again."""
        if trainer.is_global_zero:
            # The IO publishes the link as it publishes a save (an asynchronous IO after its write).
            trainer.plugin.checkpoint_io.link(target, linkpath)
        trainer.plugin.barrier("ModelCheckpoint.link")

    # ------------------------------------------------------------------ names
    def format_checkpoint_name(
        self, metrics: dict[str, Any], filename: Optional[str] = None, ver: Optional[int] = None
    ) -> str:
        """The path a checkpoint with ``metrics`` gets, e.g. ``{epoch}-{val_loss:.2f}`` -> ``epoch=2-val_loss=0.12.ckpt``.

        A name in the template that is not in ``metrics`` formats as 0, as in Lightning.
        """
        template = filename or self.filename or "{epoch}" + CHECKPOINT_JOIN_CHAR + "{step}"

        def fill(match: re.Match[str]) -> str:
            name, spec = match.group(1), (match.group(2) or "")[1:]
            value = metrics.get(name, 0)
            if isinstance(value, torch.Tensor):
                value = value.item()
            text = format(value, spec)
            return f"{name}{CHECKPOINT_EQUALS_CHAR}{text}" if self.auto_insert_metric_name else text

        name = _TEMPLATE_FIELD.sub(fill, template)
        if ver is not None:
            name = f"{name}{CHECKPOINT_JOIN_CHAR}v{ver}"
        return paths.join(self.dirpath or "", f"{name}{CHECKPOINT_EXT}")

    def _unique_path(self, trainer: Trainer, filepath: str, replaceable: str = "") -> str:
        """``filepath``, or with ``-v1``, ``-v2``, ... while that name is taken (rank 0 looks, all agree)."""
        if not self._enable_version_counter or filepath == replaceable:
            return filepath
        candidate = filepath
        if trainer.is_global_zero:
            fs, _ = paths.resolve(filepath)
            stem = filepath[: -len(CHECKPOINT_EXT)]
            version = STARTING_VERSION
            while candidate != replaceable and fs.exists(paths.resolve(candidate)[1]):
                candidate = f"{stem}{CHECKPOINT_JOIN_CHAR}v{version}{CHECKPOINT_EXT}"
                version += 1
        return trainer.plugin.broadcast(candidate)


def _versions_root(log_dir: str) -> Optional[str]:
    """The folder holding ``version_*`` folders, when ``log_dir`` is one of them."""
    head, _, tail = log_dir.rstrip("/").rpartition("/")
    return head if head and tail.startswith("version_") else None
