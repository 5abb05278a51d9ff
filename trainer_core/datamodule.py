"""``LightningDataModule``: the data of a run in one object, with Lightning 2.x hook names."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

from trainer_core.utilities import AttributeDict

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer


class LightningDataModule:
    """Prepare, split and load the data; the Trainer calls these hooks around the module's."""

    def __init__(self) -> None:
        self.trainer: Optional[Trainer] = None
        self._hparams = AttributeDict()

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

    def state_dict(self) -> dict[str, Any]:
        """What the data module needs to continue after a resume (saved in the checkpoint)."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    @property
    def hparams(self) -> AttributeDict:
        return self._hparams

    def save_hyperparameters(self, *args: Any, ignore: Optional[Union[Sequence[str], str]] = None) -> None:
        """Store the calling ``__init__``'s arguments in ``self.hparams``, as ``LightningModule`` does."""
        from trainer_core.module import select_hyperparameters

        frame = inspect.currentframe().f_back  # type: ignore[union-attr]
        self._hparams = AttributeDict(select_hyperparameters(self, args, ignore, frame, LightningDataModule))
