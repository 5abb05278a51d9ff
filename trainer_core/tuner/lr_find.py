"""The learning-rate range test: ``_LRFinder`` (the result), its two schedules, and ``_lr_find`` (the search)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.optim.lr_scheduler import LRScheduler

from trainer_core.errors import MisconfigurationException
from trainer_core.tuner.attributes import lightning_hasattr, lightning_setattr
from trainer_core.tuner.search import _fit_loop, _Search, _train
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

_logger = logging.getLogger("trainer_core")

_LR_ATTRIBUTES = ("lr", "learning_rate")


class _LRFinder:
    """What ``lr_find`` found: ``results`` (``{"lr": [...], "loss": [...]}``), a suggestion, a plot.

    Args:
        mode: ``"exponential"`` or ``"linear"``: how the learning rate grows after each step.
        lr_min: the learning rate of the first step.
        lr_max: the learning rate the schedule reaches after ``num_training`` steps.
        num_training: the number of steps (learning rates) to try.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int) -> None:
        if mode not in ("linear", "exponential"):
            raise MisconfigurationException(f"lr_find(mode={mode!r}): use 'exponential' or 'linear'.")
        self.mode = mode
        self.lr_min = lr_min
        self.lr_max = lr_max
        self.num_training = num_training
        self.results: dict[str, Any] = {}
        self._total_batch_idx = 0
        self._optimal_idx: Optional[int] = None

    def _exchange_scheduler(self, trainer: Trainer) -> None:
        """The optimizer starts at ``lr_min`` in every group; one step-interval scheduler raises it."""
        from trainer_core.optim import LRSchedulerConfig

        optimizers = trainer.plugin.optimizers
        if len(optimizers) != 1:
            raise MisconfigurationException(
                f"`configure_optimizers()` returned {len(optimizers)} optimizers, but the learning rate finder "
                "works with a single optimizer."
            )
        optimizer = optimizers[0]
        for group in optimizer.param_groups:
            group["lr"] = self.lr_min
            group["initial_lr"] = self.lr_min
        schedule = _LinearLR if self.mode == "linear" else _ExponentialLR
        scheduler = schedule(optimizer, self.lr_max, self.num_training)
        trainer.plugin.lr_scheduler_configs = [LRSchedulerConfig(scheduler, interval="step")]

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> Optional[float]:
        """The learning rate where the smoothed loss falls fastest (its most negative slope over the lr).

        ``skip_begin`` / ``skip_end`` points are left out at either end (too early to tell; already
        diverging). ``None`` (and an error in the log) when fewer than two finite points remain.
        """
        losses = torch.tensor(self.results["loss"][skip_begin:-skip_end])
        lrs = torch.tensor(self.results["lr"][skip_begin:-skip_end])
        finite = torch.isfinite(losses)
        losses, lrs = losses[finite], lrs[finite]
        if len(losses) < 2:
            _logger.error(
                "Failed to compute a learning rate suggestion: there are not enough points. Raise num_training "
                "or give the run more batches (limit_train_batches, max_epochs, the dataset's size)."
            )
            self._optimal_idx = None
            return None
        gradients = torch.gradient(losses, spacing=[lrs])[0]
        steepest = int(torch.argmin(gradients).item())
        kept = torch.arange(len(self.results["loss"]))[skip_begin:-skip_end][finite]
        self._optimal_idx = int(kept[steepest].item())
        return self.results["lr"][self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """The loss over the learning rate (log scale in exponential mode), the suggestion as a red dot.

        Returns the matplotlib figure (the one ``ax`` belongs to, when given).
        """
        try:
            import matplotlib.pyplot as plt
        except ImportError as err:
            raise MisconfigurationException(
                "_LRFinder.plot needs matplotlib: `pip install matplotlib`."
            ) from err
        lrs, losses = self.results["lr"], self.results["loss"]
        if ax is None:
            fig, ax = plt.subplots()
        else:
            fig = ax.figure
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest:
            self.suggestion()
            if self._optimal_idx:
                ax.plot(
                    lrs[self._optimal_idx], losses[self._optimal_idx], markersize=10, marker="o", color="red"
                )
        if show:
            plt.show()
        return fig


class _LinearLR(LRScheduler):
    """From the optimizer's learning rate to ``end_lr`` in ``num_iter`` equal steps (Lightning's schedule).

    The first two steps both use the starting rate; step ``k >= 1`` then uses
    ``base + (k + 1) / num_iter * (end_lr - base)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1):
        self.end_lr = end_lr
        self.num_iter = num_iter
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        if self.last_epoch > 0:
            val = [base + r * (self.end_lr - base) for base in self.base_lrs]
        else:
            val = list(self.base_lrs)
        self._lr = val
        return val

    @property
    def lr(self) -> list[float]:
        return self._lr


class _ExponentialLR(LRScheduler):
    """From the optimizer's learning rate to ``end_lr`` in ``num_iter`` geometric steps (Lightning's schedule).

    The first two steps both use the starting rate; step ``k >= 1`` then uses
    ``base * (end_lr / base) ** ((k + 1) / num_iter)``.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, end_lr: float, num_iter: int, last_epoch: int = -1):
        self.end_lr = end_lr
        self.num_iter = num_iter
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float]:
        r = (self.last_epoch + 1) / self.num_iter
        if self.last_epoch > 0:
            val = [base * (self.end_lr / base) ** r for base in self.base_lrs]
        else:
            val = list(self.base_lrs)
        self._lr = val
        return val

    @property
    def lr(self) -> list[float]:
        return self._lr


def _determine_lr_attr_name(model: LightningModule, attr_name: str = "") -> str:
    if attr_name:
        if not lightning_hasattr(model, attr_name):
            raise MisconfigurationException(
                f"lr_find(attr_name={attr_name!r}): {type(model).__name__} has no attribute {attr_name!r}, in "
                "itself, its `hparams`, or the datamodule. Name the attribute that holds the learning rate."
            )
        return attr_name
    for name in _LR_ATTRIBUTES:
        if lightning_hasattr(model, name):
            return name
    raise MisconfigurationException(
        f"The learning rate finder looked for one of {_LR_ATTRIBUTES} on {type(model).__name__} and its "
        "`hparams` and found none. Store the learning rate there (and read it in `configure_optimizers`), set "
        "`lr_find(attr_name=...)` to the name you use, or pass `update_attr=False`."
    )


def _lr_find(
    trainer: Trainer,
    model: LightningModule,
    min_lr: float = 1e-8,
    max_lr: float = 1,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: Optional[float] = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
) -> Optional[_LRFinder]:
    """The range test: ``num_training`` steps from ``min_lr`` to ``max_lr``, then the run as it was.

    With ``update_attr``, the suggestion becomes the module's learning rate attribute and every
    optimizer group's ``lr``, after the run is put back, so the training that follows uses it.
    """
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping the learning rate finder: `fast_dev_run` is on.")
        return None
    _fit_loop(trainer, "The learning rate finder")
    if update_attr:
        attr_name = _determine_lr_attr_name(model, attr_name)
    lr_finder = _LRFinder(mode, min_lr, max_lr, num_training)
    start_step = trainer.global_step
    from trainer_core.callbacks.lr_finder import _LRCallback

    callback = _LRCallback(
        num_training, early_stop_threshold, show_progress=trainer.progress_bar_callback is not None
    )
    finished = False
    with _Search(trainer, "lr_find") as search:
        try:
            search.use_callbacks([callback])
            callback.start_step = start_step
            trainer.max_steps = num_training + start_step
            trainer.limit_val_batches = num_training
            lr_finder._exchange_scheduler(trainer)
            _train(trainer)
        finally:
            callback.close()
        if trainer.global_step != num_training + start_step:
            _logger.info(
                f"The learning rate finder stopped early after {trainer.global_step - start_step} steps: the loss diverged."
            )
        lr_finder.results = trainer.plugin.broadcast({"lr": callback.lrs, "loss": callback.losses})
        lr_finder._total_batch_idx = trainer.total_batch_idx
        finished = True
    if update_attr and finished:
        lr = lr_finder.suggestion()
        if lr is not None:
            lightning_setattr(model, attr_name, lr)
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = lr
            _logger.info(f"Learning rate set to {lr}")
    return lr_finder
