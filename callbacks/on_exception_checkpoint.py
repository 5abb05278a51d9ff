"""``OnExceptionCheckpoint``: a full checkpoint of the run at the moment it fails, to resume from."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Union

from trainer_core import paths
from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer


class OnExceptionCheckpoint(Callback):
    """Save ``<dirpath>/<filename>.ckpt`` when a run raises; ``fit(ckpt_path=...)`` continues from it.

    The checkpoint is the one ``trainer.save_checkpoint`` writes, with the loop position of the
    failure: the batch that raised was not counted as done, so the resumed run trains it again and
    ends with the weights of a run that never failed, bit for bit, as long as the failing batch drew
    no random numbers before it raised (the generators are saved as they stand at the error; as in
    Lightning). A run that ends without an error removes the file in ``teardown``, so the file exists
    exactly when the last run failed.

    Args:
        dirpath: the folder (any fsspec URL); fixed here because an error can come at any moment.
        filename: the file name without its extension.

    Every rank must reach the save (it is collective under distributed plugins): a failure raised
    on one rank only cannot be saved this way, as in Lightning. A save that itself fails is reported
    as a warning, so that the error of the run is the one raised.
    """

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: Union[str, os.PathLike], filename: str = "on_exception") -> None:
        if not filename:
            raise MisconfigurationException(
                "OnExceptionCheckpoint(filename=''): give the file a name (without the extension)."
            )
        self.dirpath = os.fspath(dirpath)
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        return paths.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Trainer, *_: Any, **__: Any) -> None:
        try:
            trainer.save_checkpoint(self.ckpt_path)
        except Exception as err:
            rank_zero_warn(f"OnExceptionCheckpoint could not save {self.ckpt_path}: {err!r}")

    def teardown(self, trainer: Trainer, *_: Any, **__: Any) -> None:
        trainer.plugin.remove_checkpoint(self.ckpt_path)
