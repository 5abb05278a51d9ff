"""``LightningDataModule``: the data of a run in one object, with Lightning 2.x hook names.

A data module may also own how a batch reaches the device (``on_before_batch_transfer``,
``transfer_batch_to_device``, ``on_after_batch_transfer``): for each of the three, the Trainer uses
the data module's when it overrides it, else the module's, as Lightning does. Its hyper-parameters
(``save_hyperparameters``) are saved in every checkpoint under ``datamodule_hyper_parameters``, the key
Lightning uses, so ``MyData.load_from_checkpoint(path)`` rebuilds it.
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from trainer_core.checkpoint.format import (
    KEY_DATAMODULE_HPARAMS,
    KEY_DATAMODULE_HPARAMS_NAME,
    KEY_LIGHTNING_VERSION,
)
from trainer_core.hparams import _load_hparams_file, hparams_argument, store_hyperparameters
from trainer_core.utilities import AttributeDict, move_data_to_device
from trainer_core.utilities.apply_func import apply_to_collection

if TYPE_CHECKING:
    from trainer_core.run_state import RunState


class LightningDataModule:
    """Prepare, split and load the data; the Trainer calls these hooks around the module's."""

    name: Optional[str] = None
    CHECKPOINT_HYPER_PARAMS_KEY = KEY_DATAMODULE_HPARAMS
    CHECKPOINT_HYPER_PARAMS_NAME = KEY_DATAMODULE_HPARAMS_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Takes and drops any arguments, as Lightning's does, so `super().__init__(*args, **kwargs)` works.
        self.trainer: Optional[RunState] = None
        self._hparams = AttributeDict()
        self._hparams_initial = AttributeDict()
        self._hparams_name: Optional[str] = None
        self._log_hyperparams = False

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Optional[Union[Dataset, Iterable[Dataset]]] = None,
        val_dataset: Optional[Union[Dataset, Iterable[Dataset]]] = None,
        test_dataset: Optional[Union[Dataset, Iterable[Dataset]]] = None,
        predict_dataset: Optional[Union[Dataset, Iterable[Dataset]]] = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> LightningDataModule:
        """A data module whose dataloaders serve the given data sets (a data set, or a list/dict of them).

        The training loader shuffles (but not an ``IterableDataset``); the others keep the order.
        ``batch_size`` and ``num_workers`` go to every loader, and to ``cls.__init__`` when it takes
        arguments of those names; ``datamodule_kwargs`` go to ``cls.__init__``. Unlike Lightning,
        memory is pinned only when CUDA is available (pinning on a CPU-only machine only warns).
        """
        pin_memory = torch.cuda.is_available()

        def dataloader(ds: Dataset, shuffle: bool = False) -> DataLoader:
            shuffle &= not isinstance(ds, IterableDataset)
            return DataLoader(
                ds, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers, pin_memory=pin_memory
            )

        def loaders(datasets: Any, shuffle: bool = False) -> Any:
            return apply_to_collection(datasets, Dataset, dataloader, shuffle=shuffle)

        parameters = inspect.signature(cls.__init__).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        passed = {"batch_size": batch_size, "num_workers": num_workers}
        special = passed if takes_any else {k: v for k, v in passed.items() if k in parameters}
        datamodule = cls(**datamodule_kwargs, **special)
        # Instance attributes: the Trainer sees them as overridden hooks, exactly as methods.
        if train_dataset is not None:
            datamodule.train_dataloader = lambda: loaders(train_dataset, shuffle=True)  # type: ignore[method-assign]
        if val_dataset is not None:
            datamodule.val_dataloader = lambda: loaders(val_dataset)  # type: ignore[method-assign]
        if test_dataset is not None:
            datamodule.test_dataloader = lambda: loaders(test_dataset)  # type: ignore[method-assign]
        if predict_dataset is not None:
            datamodule.predict_dataloader = lambda: loaders(predict_dataset)  # type: ignore[method-assign]
        return datamodule

    def prepare_data(self) -> None:
        """Download or write data once per node."""

    def setup(self, stage: str) -> None:
        """Build the data sets of ``stage`` on every process."""

    def teardown(self, stage: str) -> None:
        """Release what ``setup`` built."""

    def train_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define `train_dataloader`.")

    def val_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define `val_dataloader`.")

    def test_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define `test_dataloader`.")

    def predict_dataloader(self) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define `predict_dataloader`.")

    # ------------------------------------------------------------------ batch transfer
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch before it moves to the device; used instead of the module's when overridden."""
        return batch

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Move a batch to ``device``; used instead of the module's when overridden."""
        return move_data_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Change a batch once it is on the device; used instead of the module's when overridden."""
        return batch

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What the data module needs to continue after a resume (saved in the checkpoint)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Union[str, os.PathLike],
        map_location: Any = None,
        hparams_file: Optional[Union[str, os.PathLike]] = None,
        weights_only: Optional[bool] = None,
        **kwargs: Any,
    ) -> LightningDataModule:
        """The data module built from the hyper-parameters a checkpoint saved, with its ``state_dict`` loaded.

        ``hparams_file`` (``.yaml``/``.yml``/``.csv``) replaces the checkpoint's value of every
        hyper-parameter it names and ``kwargs`` override both, as for ``LightningModule``; of these,
        ``__init__`` gets those it takes (all of them when it has ``**kwargs``), Lightning's rule, so a
        data module whose arguments changed since the save still loads. A PyTorch Lightning checkpoint
        is read too (its data module part has the same layout). ``weights_only`` is Lightning's: by
        default the file is read without running code from it; ``False`` unpickles it whole, for a
        file you trust.
        """
        from trainer_core.checkpoint.format import trusted_unpickling

        path = os.fspath(checkpoint_path)
        with trusted_unpickling(weights_only is False):
            checkpoint = _read_checkpoint(path, map_location)
        return cls._from_checkpoint(checkpoint, path, hparams_file, kwargs)

    @classmethod
    def _from_checkpoint(
        cls,
        checkpoint: dict[str, Any],
        path: str,
        hparams_file: Optional[Union[str, os.PathLike]],
        overrides: dict[str, Any],
    ) -> LightningDataModule:
        from trainer_core.checkpoint.format import KEY_DATAMODULE
        from trainer_core.checkpoint.restore import _accepted_by_init
        from trainer_core.errors import CheckpointError, MisconfigurationException

        lightning = KEY_LIGHTNING_VERSION in checkpoint  # Lightning keys the state by the class's name
        state = checkpoint.get(cls.__qualname__ if lightning else KEY_DATAMODULE)
        if hparams_file is not None:
            overrides = {**_load_hparams_file(hparams_file), **overrides}
        hparams = {**(checkpoint.get(KEY_DATAMODULE_HPARAMS) or {}), **overrides}
        name = hparams_argument(cls, checkpoint.get(KEY_DATAMODULE_HPARAMS_NAME))
        if name:  # `__init__(self, config)` with `save_hyperparameters(config)`: the dict goes back whole
            hparams = {name: hparams, **{k: v for k, v in overrides.items() if k != name}}
        try:
            datamodule = cls(**_accepted_by_init(cls, hparams))
        except (CheckpointError, MisconfigurationException):
            raise
        except Exception as err:  # a missing argument, or a value the data module refuses
            raise CheckpointError(
                f"{cls.__name__}(**{KEY_DATAMODULE_HPARAMS} of {path}) failed: {type(err).__name__}: {err}. Pass the "
                "missing or changed arguments to load_from_checkpoint as keywords."
            ) from err
        if state:
            datamodule.load_state_dict(state)
        return datamodule

    # ------------------------------------------------------------------ hyper-parameters
    @property
    def hparams(self) -> AttributeDict:
        if "_hparams" not in self.__dict__:  # a subclass whose __init__ skipped super().__init__()
            self._hparams = AttributeDict()
        return self._hparams

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyper-parameters as ``save_hyperparameters`` stored them: a copy, unchanged by edits of ``hparams``."""
        return copy.deepcopy(self.__dict__.get("_hparams_initial", AttributeDict()))

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Optional[Union[Sequence[str], str]] = None,
        frame: Optional[Any] = None,
        logger: bool = True,
    ) -> None:
        """Store the calling ``__init__``'s arguments in ``self.hparams``, as ``LightningModule`` does.

        They are saved in checkpoints (for ``load_from_checkpoint``) and, with ``logger=True``, sent
        to the loggers together with the module's.
        """
        self._log_hyperparams = logger
        if frame is None:
            frame = inspect.currentframe().f_back  # type: ignore[union-attr]
        store_hyperparameters(self, args, ignore, frame, LightningDataModule)


def hyperparameters_to_log(
    module: Any, datamodule: Optional[LightningDataModule]
) -> Optional[dict[str, Any]]:
    """What the loggers record at the start of ``fit``: the module's and the data module's initial hyper-parameters.

    Each side counts only if it called ``save_hyperparameters(logger=True)``; ``None`` when neither
    did. A name both define with different values is an error, as in Lightning, since the logged
    record could only show one of them.
    """
    log_module = module._log_hyperparams and bool(module.hparams)
    log_data = (
        datamodule is not None and getattr(datamodule, "_log_hyperparams", False) and bool(datamodule.hparams)
    )
    if not log_module and not log_data:
        return None
    merged: dict[str, Any] = _initial_or_current(module) if log_module else {}
    if log_data:
        assert datamodule is not None
        data_hparams = _initial_or_current(datamodule)
        clashes = sorted(
            key
            for key in merged.keys() & data_hparams.keys()
            if type(merged[key]) is not type(data_hparams[key]) or not _same(merged[key], data_hparams[key])
        )
        if clashes:
            from trainer_core.errors import MisconfigurationException

            raise MisconfigurationException(
                f"The hyper-parameters {clashes} are saved by both {type(module).__name__} and "
                f"{type(datamodule).__name__} with different values; rename one of them, or leave it out with "
                "save_hyperparameters(ignore=[...])."
            )
        merged.update(data_hparams)
    return merged


def log_stage_hyperparameters(trainer: Any) -> None:
    """At the start of every stage, as Lightning does: the hyper-parameters to each logger (the module's and the
    data module's, merged), then the model's graph (a logger that draws one), then a save.

    So a test after fit adds them (and TensorBoard's ``hp_metric``) to the test's events, and a test-only run
    writes its ``hparams.yaml``.
    """
    if not trainer.loggers:
        return
    module = trainer.lightning_module
    hparams = hyperparameters_to_log(module, trainer.datamodule)
    for lg in trainer.loggers:
        if hparams is not None:
            lg.log_hyperparams(hparams)
        lg.log_graph(module)
        lg.save()


def _initial_or_current(owner: Any) -> dict[str, Any]:
    """``hparams_initial`` (what ``save_hyperparameters`` stored), or ``hparams`` when only those were filled in."""
    return dict(owner.hparams_initial or owner.hparams)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a is b or (a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:
        return a is b


def _read_checkpoint(path: str, map_location: Any) -> dict[str, Any]:
    """The checkpoint at ``path``, checked when it is trainer-core's; ``map_location=None`` keeps tensors on a device this machine has."""
    from trainer_core.checkpoint.format import validate_checkpoint
    from trainer_core.checkpoint.restore import _to_available_device
    from trainer_core.plugins.io import TorchCheckpointIO

    if map_location is None:
        map_location = _to_available_device
    checkpoint = TorchCheckpointIO().load_checkpoint(path, map_location=map_location)
    if not (isinstance(checkpoint, dict) and KEY_LIGHTNING_VERSION in checkpoint):
        validate_checkpoint(checkpoint, path)
    return checkpoint
