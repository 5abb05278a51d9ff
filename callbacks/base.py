"""``Callback``: Lightning 2.x hook names, plus state that travels in the checkpoint.

The Trainer looks at which hooks a callback overrides once per run and calls only those, so
a callback with one hook costs one call per event and nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.optim import Optimizer

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer


class Callback:
    """Base class: override any hook; each receives the trainer and the module first."""

    @property
    def state_key(self) -> str:
        """The key of this callback's state in the checkpoint (``checkpoint["callbacks"][state_key]``).

        The class's qualified name (Lightning's default), so one instance per class. A stateful callback
        meant to run as several instances overrides it with :meth:`generate_state_key` over the settings
        that tell the instances apart; two stateful callbacks with one key are refused at fit start,
        because on resume both would get one instance's state.
        """
        return type(self).__qualname__

    def generate_state_key(self, **settings: Any) -> str:
        """A state key of the class's name and ``settings`` (values whose ``repr`` is stable across runs).

        Example::

            @property
            def state_key(self) -> str:
                return self.generate_state_key(monitor=self.monitor, every_n_steps=self.every_n_steps)

        The same settings give the same key in the next run, which is how a resumed run finds each
        instance's state.
        """
        return f"{type(self).__qualname__}{settings!r}"

    # Lightning's name, kept for callbacks ported from it (and for keys already in checkpoints).
    _generate_state_key = generate_state_key

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None: ...
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None: ...
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None: ...

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None: ...

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...

    def on_validation_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_validation_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_test_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_test_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_predict_batch_start(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_predict_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...

    def on_exception(
        self, trainer: Trainer, pl_module: LightningModule, exception: BaseException
    ) -> None: ...
    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: Tensor) -> None: ...
    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None: ...

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None: ...

    def on_before_zero_grad(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer
    ) -> None: ...

    def state_dict(self) -> dict[str, Any]:
        """What this callback needs to continue after a resume; saved under ``state_key``."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None: ...

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None: ...
