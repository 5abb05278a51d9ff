"""``StochasticWeightAveraging``: Lightning's epoch-wise SWA (Izmailov et al., UAI 2018).

From epoch ``swa_epoch_start`` on, the weights at the start of every epoch are averaged into a
copy, and ``torch.optim.swa_utils.SWALR`` replaces the run's scheduler (annealing each parameter
group to its ``swa_lrs`` value). When training ends the averaged weights are copied into the model;
a model with BatchNorm layers gets one more epoch over the training data first, which only runs
``training_step`` (no backward, no optimizer step; ``trainer.fit_loop.forward_only``) to recompute
the running statistics for the averaged weights. (Lightning 2.6's extra epoch also steps the
optimizer once at its end, with the previous batch's gradients, so its model ends one SGD step away
from the average; here it is the average.)

The average is kept as :class:`~trainer_core.callbacks.weight_averaging.AveragedWeights`: in the
layout the plugin gives the module (each rank's shards under ``FSDPPlugin``, where Lightning refuses
SWA), and saved as whole tensors by parameter name through the plugin's own consolidation of the
model state; see ``callbacks/weight_averaging.py`` for why.

Checkpoint state (``state_dict``), as Lightning's: ``n_averaged``, ``latest_update_epoch``,
``scheduler_state`` (the SWALR scheduler) and ``average_model_state`` (the module's full state dict
with the averaged parameters). One difference: while SWALR stands in for the module's scheduler, the
checkpoint's ``lr_schedulers`` entry keeps the module's own scheduler state (Lightning writes
SWALR's there), so a resumed run loads each state into a scheduler of its own kind whatever the
restore order of the plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import SWALR

from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.weight_averaging import AveragedWeights, refuse_sharded_folders
from trainer_core.checkpoint.format import KEY_LR_SCHEDULERS
from trainer_core.errors import MisconfigurationException
from trainer_core.optim import LRSchedulerConfig
from trainer_core.utilities import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

_AVG_FN = Callable[[Tensor, Tensor, Tensor], Tensor]
_CPU = torch.device("cpu")


class StochasticWeightAveraging(Callback):
    """Average the weights of the last epochs and anneal the learning rate to ``swa_lrs``.

    Args:
        swa_lrs: the SWA learning rate, one float for every parameter group or a list with one per group.
        swa_epoch_start: an int: the (1-based) epoch to start averaging at; a float in [0, 1]: that
            fraction of ``max_epochs``.
        annealing_epochs: epochs of the annealing to ``swa_lrs``.
        annealing_strategy: ``"cos"`` or ``"linear"``.
        avg_fn: ``(averaged, current, n_averaged) -> new averaged``; the equal-weight mean by default.
        device: where the averaged copy lives (``"cpu"`` by default); ``None``: the module's device.

    Works with one optimizer and at most one scheduler (which SWALR replaces from ``swa_epoch_start``).
    """

    def __init__(
        self,
        swa_lrs: Union[float, list[float]],
        swa_epoch_start: Union[int, float] = 0.8,
        annealing_epochs: int = 10,
        annealing_strategy: Literal["cos", "linear"] = "cos",
        avg_fn: Optional[_AVG_FN] = None,
        device: Optional[Union[torch.device, str]] = _CPU,
    ) -> None:
        if isinstance(swa_epoch_start, int) and swa_epoch_start < 1:
            raise MisconfigurationException(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start}): use an int >= 1 (the epoch, "
                "counted from 1) or a float in [0, 1] (a fraction of max_epochs)."
            )
        if isinstance(swa_epoch_start, float) and not 0 <= swa_epoch_start <= 1:
            raise MisconfigurationException(
                f"StochasticWeightAveraging(swa_epoch_start={swa_epoch_start}): a float must lie in [0, 1] (a "
                "fraction of max_epochs); pass an int for an epoch number."
            )
        wrong = (
            not isinstance(swa_lrs, (float, list))
            or (isinstance(swa_lrs, float) and swa_lrs <= 0)
            or (isinstance(swa_lrs, list) and not all(isinstance(lr, float) and lr > 0 for lr in swa_lrs))
        )
        if wrong:
            raise MisconfigurationException(
                f"StochasticWeightAveraging(swa_lrs={swa_lrs!r}): use a positive float, or a list of positive "
                "floats (one per parameter group)."
            )
        if annealing_strategy not in ("cos", "linear"):
            raise MisconfigurationException(
                f"StochasticWeightAveraging(annealing_strategy={annealing_strategy!r}): use 'cos' or 'linear'."
            )
        if avg_fn is not None and not callable(avg_fn):
            raise MisconfigurationException("StochasticWeightAveraging(avg_fn=...): pass a function.")
        if device is not None and not isinstance(device, (torch.device, str)):
            raise MisconfigurationException(
                f"StochasticWeightAveraging(device={device!r}): pass a torch.device or a string such as 'cpu'."
            )
        self._swa_epoch_start = swa_epoch_start
        self._swa_lrs = swa_lrs
        self._annealing_epochs = annealing_epochs
        self._annealing_strategy = annealing_strategy
        self._avg_fn = avg_fn or self.avg_fn
        self._device = device
        self._average: Optional[AveragedWeights] = None
        self._pending_average: Optional[dict[str, Any]] = None
        self._init_n_averaged = 0
        self._latest_update_epoch = -1
        self._initialized = False
        self._swa_scheduler: Optional[SWALR] = None
        self._scheduler_state: Optional[dict[str, Any]] = None
        # The module's scheduler config SWALR took the place of (None: SWALR was added).
        self._replaced: Optional[LRSchedulerConfig] = None
        self._model_contains_batch_norm: Optional[bool] = None
        self._max_epochs = -1
        self._trainer: Optional[Trainer] = None
        self._module: Optional[LightningModule] = None
        self.momenta: dict[nn.modules.batchnorm._BatchNorm, Optional[float]] = {}

    # ------------------------------------------------------------------ Lightning's public helpers
    @property
    def swa_start(self) -> int:
        """The first epoch averaged (0-based)."""
        assert isinstance(self._swa_epoch_start, int)
        return max(self._swa_epoch_start - 1, 0)

    @property
    def swa_end(self) -> int:
        """The last epoch averaged (0-based); unbounded with ``max_epochs=-1``."""
        if self._max_epochs == -1:
            return float("inf")  # type: ignore[return-value]
        return self._max_epochs - 1

    @property
    def n_averaged(self) -> Optional[Tensor]:
        """How many weight snapshots the average holds (``None`` before the first)."""
        if self._average is None or not self._initialized:
            return None
        return self._average.n_averaged

    @staticmethod
    def pl_module_contains_batch_norm(pl_module: LightningModule) -> bool:
        return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in pl_module.modules())

    @staticmethod
    def avg_fn(averaged_model_parameter: Tensor, model_parameter: Tensor, num_averaged: Tensor) -> Tensor:
        """The equal-weight running mean (``torch.optim.swa_utils``'s)."""
        return averaged_model_parameter + (model_parameter - averaged_model_parameter) / (num_averaged + 1)

    # ------------------------------------------------------------------ the run
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # load_state_dict gets no trainer: remember where the averaged state will be loaded.
        self._trainer, self._module = trainer, pl_module
        if stage == "fit":
            self._average = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise MisconfigurationException(
                f"StochasticWeightAveraging works with one optimizer; configure_optimizers returned "
                f"{len(trainer.optimizers)}."
            )
        if len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationException(
                f"StochasticWeightAveraging replaces at most one scheduler; configure_optimizers returned "
                f"{len(trainer.lr_scheduler_configs)}."
            )
        refuse_sharded_folders(trainer, "StochasticWeightAveraging")
        if isinstance(self._swa_epoch_start, float):
            if trainer.max_epochs == -1:
                raise MisconfigurationException(
                    f"StochasticWeightAveraging(swa_epoch_start={self._swa_epoch_start}) is a fraction of "
                    "max_epochs, but max_epochs=-1; pass the epoch as an int."
                )
            self._swa_epoch_start = int(trainer.max_epochs * self._swa_epoch_start)
        self._model_contains_batch_norm = self.pl_module_contains_batch_norm(pl_module)
        self._max_epochs = trainer.max_epochs
        if self._model_contains_batch_norm and trainer.max_epochs != -1:
            # One more epoch after the last, to recompute the BatchNorm statistics of the averaged weights.
            trainer.max_epochs += 1
        if self._scheduler_state is not None:
            # A checkpoint written while SWALR ran (Lightning writes SWALR's state as the run's
            # scheduler state): SWALR comes back at the next epoch start, from its own saved state.
            trainer.lr_scheduler_configs.clear()
        self._average = AveragedWeights(pl_module, self._device, buffers="none", avg_fn=self._avg_fn)
        if self._pending_average is not None:
            self._load_average(self._pending_average)
            self._pending_average = None

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        averaging = self.swa_start <= epoch <= self.swa_end
        if not self._initialized and averaging:
            self._initialized = True
            self._start_swa_scheduler(trainer, epoch)
        assert self._average is not None
        if averaging and epoch > self._latest_update_epoch:
            self._average.update(pl_module)
            self._latest_update_epoch = epoch
        if self._max_epochs != -1 and epoch == self.swa_end + 1:
            # The BatchNorm epoch: the averaged weights, fresh statistics, forward passes only.
            if int(self._average.n_averaged) > 0:
                self._average.copy_to(pl_module)
            self.reset_batch_norm_and_save_state(pl_module)
            trainer.fit_loop.forward_only = True

    def _start_swa_scheduler(self, trainer: Trainer, epoch: int) -> None:
        assert self._average is not None
        optimizer = trainer.optimizers[0]
        if isinstance(self._swa_lrs, float):
            self._swa_lrs = [self._swa_lrs] * len(optimizer.param_groups)
        for lr, group in zip(self._swa_lrs, optimizer.param_groups):
            group["initial_lr"] = lr
        self._swa_scheduler = SWALR(
            optimizer,
            swa_lr=self._swa_lrs,  # type: ignore[arg-type]
            anneal_epochs=self._annealing_epochs,
            anneal_strategy=self._annealing_strategy,
            last_epoch=trainer.max_epochs if self._annealing_strategy == "cos" else -1,
        )
        if self._scheduler_state is not None:
            self._swa_scheduler.load_state_dict(self._scheduler_state)
        elif epoch != self.swa_start:
            rank_zero_warn(
                f"StochasticWeightAveraging starts at epoch {epoch}, after swa_epoch_start, without a saved SWA "
                "state: the average holds fewer epochs than an uninterrupted run's would."
            )
        swa_config = LRSchedulerConfig(self._swa_scheduler)
        configs = trainer.lr_scheduler_configs
        if configs:
            current = configs[0]
            if current.interval != "epoch" or current.frequency != 1:
                rank_zero_warn(
                    f"StochasticWeightAveraging steps SWALR once per epoch; it replaces a scheduler stepped every "
                    f"{current.frequency} {current.interval}(s)."
                )
            rank_zero_info(f"Swapping scheduler `{type(current.scheduler).__name__}` for `SWALR`")
            self._replaced = current
            configs[0] = swa_config
        else:
            self._replaced = None
            configs.append(swa_config)
        if int(self._average.n_averaged) == 0:
            self._average.n_averaged.fill_(self._init_n_averaged)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.fit_loop.forward_only = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # current_epoch counts the epochs run: swa_end + 2 after the BatchNorm epoch.
        if (
            self._model_contains_batch_norm
            and self._max_epochs != -1
            and trainer.current_epoch - 1 == self.swa_end + 1
        ):
            trainer.max_epochs -= 1
            self.reset_momenta()
        elif trainer.current_epoch - 1 == self.swa_end or self._max_epochs == -1:
            # Only an average that holds something replaces the weights (Lightning would copy the
            # initial weights into a run stopped before swa_epoch_start).
            if self._average is not None and self._initialized and int(self._average.n_averaged) > 0:
                self._average.copy_to(pl_module)

    def reset_batch_norm_and_save_state(self, pl_module: LightningModule) -> None:
        """Running statistics back to their initial values and a cumulative mean (``momentum=None``).

        In place, so a wrapper that holds the buffers (DDP broadcasts them) keeps seeing the module's.
        """
        self.momenta = {}
        with torch.no_grad():
            for module in pl_module.modules():
                if not isinstance(module, nn.modules.batchnorm._BatchNorm) or module.running_mean is None:
                    continue
                module.running_mean.zero_()
                module.running_var.fill_(1)  # type: ignore[union-attr]
                self.momenta[module] = module.momentum
                module.momentum = None  # type: ignore[assignment]
                module.num_batches_tracked.zero_()  # type: ignore[union-attr]

    def reset_momenta(self) -> None:
        for module, momentum in self.momenta.items():
            module.momentum = momentum  # type: ignore[assignment]

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        average = self._average
        n_averaged = 0 if average is None else int(average.n_averaged)
        return {
            "n_averaged": n_averaged,
            "latest_update_epoch": self._latest_update_epoch,
            "scheduler_state": None if self._swa_scheduler is None else self._swa_scheduler.state_dict(),
            # Before the first average there is nothing to keep (Lightning saves the initial weights).
            "average_model_state": None
            if n_averaged == 0 or self._trainer is None or self._module is None
            else average.consolidated_state(self._trainer, self._module),  # type: ignore[union-attr]
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._init_n_averaged = state_dict["n_averaged"]
        self._latest_update_epoch = state_dict["latest_update_epoch"]
        self._scheduler_state = state_dict["scheduler_state"]
        average_state = state_dict["average_model_state"]
        if average_state is None:
            return
        if self._average is not None:
            self._load_average(average_state)  # restored after the plugin set the module up (FSDP)
        else:
            self._pending_average = average_state

    def _load_average(self, state: dict[str, Any]) -> None:
        assert self._average is not None and self._trainer is not None and self._module is not None
        self._average.load_consolidated_state(self._trainer, self._module, state)
        if self._init_n_averaged:
            self._average.n_averaged.fill_(self._init_n_averaged)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Where SWALR stands in for the module's scheduler, the module's own state goes in ``lr_schedulers``."""
        if self._swa_scheduler is None or KEY_LR_SCHEDULERS not in checkpoint:
            return
        configs = trainer.lr_scheduler_configs
        index = next((i for i, c in enumerate(configs) if c.scheduler is self._swa_scheduler), None)
        if index is None:
            return
        states = list(checkpoint[KEY_LR_SCHEDULERS])
        if self._replaced is not None:
            states[index] = self._replaced.scheduler.state_dict()
        else:
            del states[index]
        checkpoint[KEY_LR_SCHEDULERS] = states
