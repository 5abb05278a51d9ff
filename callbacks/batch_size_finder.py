"""``BatchSizeFinder``: the largest batch size that runs without an out-of-memory error, as a callback.

It searches at ``on_fit_start`` (or at the start of ``validate``, ``test``, ``predict``); the search
(and how the run is put back after it) lives in ``trainer_core.tuner``. The size is an attribute
(``batch_arg_name``) of the module, its ``hparams`` or the datamodule that the dataloader hook reads,
so dataloaders passed straight to ``fit`` cannot be searched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException, _TunerExitException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class BatchSizeFinder(Callback):
    """Grow the batch size until a trial of ``steps_per_trial`` steps runs out of memory; keep the last that fit.

    Args:
        mode: ``"power"`` doubles the size until a trial fails, then halves it; ``"binsearch"`` then
            bisects between the last size that fit and the first that failed.
        steps_per_trial: steps (batches) each trial runs.
        init_val: the size of the first trial.
        max_trials: at most this many trials.
        batch_arg_name: the attribute holding the batch size, looked up on the module, its
            ``hparams``, the datamodule and its ``hparams``.
        margin: the fraction given back after a binary search (a safety buffer); ``"power"`` ignores it.
        max_val: the largest size tried (on a CPU there is no out-of-memory error to stop the search).

    ``optimal_batch_size`` holds the result; the attribute is set to it.
    """

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise MisconfigurationException(
                f"BatchSizeFinder(mode={mode!r}): use one of {self.SUPPORTED_MODES}."
            )
        if not 0.0 <= margin < 1.0:
            raise MisconfigurationException(f"BatchSizeFinder(margin={margin!r}): use a fraction in [0, 1).")
        self.optimal_batch_size: Optional[int] = init_val
        self._mode = mode
        self._steps_per_trial = steps_per_trial
        self._init_val = init_val
        self._max_trials = max_trials
        self._batch_arg_name = batch_arg_name
        self._margin = margin
        self._max_val = max_val
        # Set by the Tuner: end the run once the search is done.
        self._early_exit = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from trainer_core.tuner import lightning_hasattr

        if trainer.world_size > 1:
            raise MisconfigurationException(
                "The batch size finder is not supported with distributed plugins."
            )
        if stage == "fit" and trainer.fit_loop is not None and trainer.fit_loop.train_source is not None:
            raise MisconfigurationException(
                "The batch size finder cannot be used with dataloaders passed directly to `.fit()`: it must make "
                "them again at each size. Return them from the module's or datamodule's `train_dataloader`, "
                f"reading `{self._batch_arg_name}`, or remove the BatchSizeFinder."
            )
        if not lightning_hasattr(pl_module, self._batch_arg_name):
            raise MisconfigurationException(
                f"BatchSizeFinder(batch_arg_name={self._batch_arg_name!r}): no field {self._batch_arg_name!r} in "
                f"`model`, `model.hparams`, the datamodule, nor its `hparams`. Store the batch size there and read "
                "it in the dataloader hook, or pass the name you use."
            )
        if hasattr(pl_module, self._batch_arg_name) and self._batch_arg_name in pl_module.hparams:
            rank_zero_warn(
                f"Field `model.{self._batch_arg_name}` and `model.hparams.{self._batch_arg_name}` are mutually "
                f"exclusive! `model.{self._batch_arg_name}` will be used as the initial batch size for scaling. "
                "If this is not the intended behavior, please remove either one."
            )

    def scale_batch_size(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Run the search now; the weights, optimizer and loop counters come back as they were."""
        from trainer_core.tuner.batch_size import _scale_batch_size

        self.optimal_batch_size = _scale_batch_size(
            trainer,
            self._mode,
            self._steps_per_trial,
            self._init_val,
            self._max_trials,
            self._batch_arg_name,
            self._margin,
            self._max_val,
        )
        if self._early_exit:
            raise _TunerExitException()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state_stage != "validate":
            return
        self.scale_batch_size(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.scale_batch_size(trainer, pl_module)
