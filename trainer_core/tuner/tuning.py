"""``Tuner``: runs a finder callback through the Trainer's entry point, and the checks of its arguments."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional

from trainer_core.errors import MisconfigurationException
from trainer_core.tuner.search import _METHODS

if TYPE_CHECKING:
    from trainer_core.callbacks.base import Callback
    from trainer_core.datamodule import LightningDataModule
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer
    from trainer_core.tuner.lr_find import _LRFinder


class Tuner:
    """Finds a learning rate (:meth:`lr_find`) or a batch size (:meth:`scale_batch_size`) for a Trainer's run.

    Each method adds its finder callback to the Trainer, runs the entry point (``fit`` for the
    learning rate; ``method`` for the batch size), which ends once the search is done, and removes
    the callback again. The model comes back exactly as it went in, but for the attribute found.
    """

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    def scale_batch_size(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> Optional[int]:
        """The largest batch size that runs ``steps_per_trial`` steps without running out of memory.

        ``mode="power"`` doubles the size until a trial fails, then halves it; ``"binsearch"``
        then bisects between the last size that fit and the first that failed, and gives
        ``margin`` back (5% by default). The size is set on ``batch_arg_name`` of the module, its
        hparams or the datamodule (wherever it is), whose dataloader hook must read it: loaders
        passed to ``fit`` directly cannot change their batch size.
        """
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        _check_scale_batch_size_configuration(self._trainer)
        from trainer_core.callbacks.batch_size_finder import BatchSizeFinder

        finder = BatchSizeFinder(
            mode=mode,
            steps_per_trial=steps_per_trial,
            init_val=init_val,
            max_trials=max_trials,
            batch_arg_name=batch_arg_name,
            margin=margin,
            max_val=max_val,
        )
        finder._early_exit = True
        self._run_with(finder, model, method, train_dataloaders, val_dataloaders, dataloaders, datamodule)
        return finder.optimal_batch_size

    def lr_find(
        self,
        model: LightningModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Optional[LightningDataModule] = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: Optional[float] = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> Optional[_LRFinder]:
        """A learning rate range test: ``num_training`` steps from ``min_lr`` up to ``max_lr``.

        ``mode`` grows the rate ``"exponential"``-ly or ``"linear"``-ly; the search stops early when
        the smoothed loss exceeds ``early_stop_threshold`` times the best (``None``: never). With
        ``update_attr``, the suggestion is written to ``attr_name`` (found by itself: ``lr`` or
        ``learning_rate``, on the module or its hparams). Returns the finder: ``results``,
        ``suggestion()``, ``plot()``; ``None`` under ``fast_dev_run``.
        """
        if method != "fit":
            raise MisconfigurationException("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        _check_lr_find_configuration(self._trainer)
        from trainer_core.callbacks.lr_finder import LearningRateFinder

        finder = LearningRateFinder(
            min_lr=min_lr,
            max_lr=max_lr,
            num_training_steps=num_training,
            mode=mode,
            early_stop_threshold=early_stop_threshold,
            update_attr=update_attr,
            attr_name=attr_name,
        )
        finder._early_exit = True
        self._run_with(finder, model, "fit", train_dataloaders, val_dataloaders, None, datamodule)
        return finder.optimal_lr

    def _run_with(
        self,
        finder: Callback,
        model: LightningModule,
        method: str,
        train_dataloaders: Any,
        val_dataloaders: Any,
        dataloaders: Any,
        datamodule: Optional[LightningDataModule],
    ) -> None:
        trainer = self._trainer
        trainer.callbacks = [finder, *trainer.callbacks]
        try:
            if method == "fit":
                trainer.fit(model, train_dataloaders, val_dataloaders, datamodule)
            elif method == "validate":
                trainer.validate(model, dataloaders, datamodule=datamodule)
            elif method == "test":
                trainer.test(model, dataloaders, datamodule=datamodule)
            else:
                trainer.predict(model, dataloaders, datamodule=datamodule)
        finally:
            trainer.callbacks = [cb for cb in trainer.callbacks if cb is not finder]


def _check_tuner_configuration(
    train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, method: str
) -> None:
    if method not in _METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {_METHODS}.")
    if method == "fit":
        if dataloaders is not None:
            raise MisconfigurationException(
                f"In tuner with method={method!r}, `dataloaders` argument should be None,"
                " please consider setting `train_dataloaders` and `val_dataloaders` instead."
            )
    elif train_dataloaders is not None or val_dataloaders is not None:
        raise MisconfigurationException(
            f"In tuner with `method`={method!r}, `train_dataloaders` and `val_dataloaders`"
            " arguments should be None, please consider setting `dataloaders` instead."
        )


def _check_lr_find_configuration(trainer: Trainer) -> None:
    from trainer_core.callbacks.lr_finder import LearningRateFinder

    if any(isinstance(cb, LearningRateFinder) for cb in trainer.callbacks):
        raise ValueError(
            "Trainer is already configured with a `LearningRateFinder` callback. "
            "Please remove it if you want to use the Tuner."
        )


def _check_scale_batch_size_configuration(trainer: Trainer) -> None:
    if trainer.world_size > 1:
        raise ValueError("Tuning the batch size is currently not supported with distributed strategies.")
    from trainer_core.callbacks.batch_size_finder import BatchSizeFinder

    if any(isinstance(cb, BatchSizeFinder) for cb in trainer.callbacks):
        raise ValueError(
            "Trainer is already configured with a `BatchSizeFinder` callback. "
            "Please remove it if you want to use the Tuner."
        )
