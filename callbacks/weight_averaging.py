"""``WeightAveraging`` and ``EMAWeightAveraging``: an averaged copy of the weights, updated as training goes.

Lightning 2.5's callbacks of the same names, with the same arguments, hooks and checkpoint layout:
the averaged weights are updated after optimizer steps (``should_update``), swapped into the model
for every validation epoch and copied into it when training ends; a checkpoint holds the averaged
weights as its ``state_dict`` (so ``load_from_checkpoint`` gives the averaged model), the weights
being trained as ``current_model_state``, and ``n_averaged`` as ``averaging_state``.

**How the average is held, under every plugin.** Lightning keeps a ``torch.optim.swa_utils.AveragedModel``
(a deep copy of the module, made in ``setup`` before the strategy wraps or shards anything) and
refuses sharded models. Here the average is a list of tensors in the layout the module holds its own
once the plugin has set it up (``on_fit_start``): whole tensors under the single-device, DDP, sharded
(OSS) and ZeRO plugins, each rank's own shard under ``FSDPPlugin``. Averaging is element-wise, so
averaging shards gives the shards of the average, with no communication and a rank's share of the
memory only. The arithmetic is ``AveragedModel.update_parameters``'s, with its ``avg_fn`` /
``multi_avg_fn`` arguments, so the numbers are those of ``AveragedModel``.

**How it reaches the checkpoint.** The averaged weights take the model's own path: they are swapped
into the module (values exchanged in place) while the plugin builds the module's state dict
(``plugin.lightning_module_state_dict()``), then swapped back. So the averaged copy is consolidated
exactly like the model: whole tensors by parameter name (under FSDP gathered to rank 0, as the model
is), loadable in one process, and loaded back through ``plugin.load_model_state_dict``, which cuts
whole tensors into this run's shards. There is no second consolidation path to keep in step with the
plugins. ``FSDPPlugin(state_dict_type="sharded")`` writes the model's shards through DCP but every
other entry whole from rank 0, so the weights being trained cannot move to ``current_model_state``
there; it is refused with a clear error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim.swa_utils import get_ema_avg_fn, get_swa_avg_fn, get_swa_multi_avg_fn

from trainer_core.callbacks.base import Callback
from trainer_core.checkpoint.format import KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_info, rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

#: Lightning's checkpoint keys: the weights being trained, and the averaging state beside ``n_averaged``.
CURRENT_MODEL_STATE = "current_model_state"
AVERAGING_STATE = "averaging_state"
N_AVERAGED = "n_averaged"

_AVERAGED_MODEL_ARGUMENTS = ("avg_fn", "multi_avg_fn")

AvgFn = Callable[[Tensor, Tensor, Union[Tensor, int]], Tensor]
MultiAvgFn = Callable[[list[Tensor], list[Tensor], Union[Tensor, int]], None]


def _local(tensor: Tensor) -> Tensor:
    """The values this rank holds: a DTensor's local shard (same storage), a plain tensor itself."""
    tensor = tensor.detach()
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _foreach_devices() -> tuple[str, ...]:
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return tuple(_get_foreach_kernels_supported_devices())


class AveragedWeights:
    """A running average of a module's parameters (and buffers), in the layout the module holds them.

    ``buffers``: ``"average"`` (buffers averaged like parameters: ``AveragedModel(use_buffers=True)``),
    ``"copy"`` (copied from the module at each update: ``use_buffers=False``) or ``"none"`` (not kept:
    Lightning's ``StochasticWeightAveraging`` averages parameters only).
    """

    def __init__(
        self,
        module: nn.Module,
        device: Optional[Union[torch.device, str, int]],
        buffers: str = "average",
        avg_fn: Optional[AvgFn] = None,
        multi_avg_fn: Optional[MultiAvgFn] = None,
    ) -> None:
        self.buffers = buffers
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        with torch.no_grad():
            own = self._module_tensors(module)
            self.device = torch.device(device) if device is not None else (own[0].device if own else None)
            self.tensors = [t.to(self.device, copy=True) for t in own]
        self.num_params = len(list(module.parameters()))
        self.n_averaged = torch.tensor(0, dtype=torch.long, device=self.device)

    def _module_tensors(self, module: nn.Module) -> list[Tensor]:
        params = [_local(p) for p in module.parameters()]
        if self.buffers == "none":
            return params
        return params + [_local(b) for b in module.buffers()]

    @torch.no_grad()
    def update(self, module: nn.Module) -> None:
        """One ``AveragedModel.update_parameters`` step: the first copies, later ones average."""
        current = self._module_tensors(module)
        averaged_count = len(self.tensors) if self.buffers == "average" else self.num_params
        targets = self.tensors[:averaged_count]
        sources = [c.to(a.device) for a, c in zip(targets, current)]
        if int(self.n_averaged) == 0:
            for a, c in zip(targets, sources):
                a.copy_(c)
        elif self.multi_avg_fn is not None or self.avg_fn is None:
            self._average_grouped(targets, sources)
        else:
            for a, c in zip(targets, sources):
                a.copy_(self.avg_fn(a, c, self.n_averaged.to(a.device)))
        for a, c in zip(self.tensors[averaged_count:], current[averaged_count:]):
            a.copy_(c)
        self.n_averaged += 1

    def _average_grouped(self, targets: list[Tensor], sources: list[Tensor]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
        for a, c in zip(targets, sources):
            mine = groups.setdefault((a.device, a.dtype), ([], []))
            mine[0].append(a)
            mine[1].append(c)
        for (device, _), (averaged, current) in groups.items():
            n = self.n_averaged.to(device)
            if self.multi_avg_fn is not None:
                self.multi_avg_fn(averaged, current, n)
            elif device.type in _foreach_devices():
                get_swa_multi_avg_fn()(averaged, current, n)
            else:
                swa = get_swa_avg_fn()
                for a, c in zip(averaged, current):
                    a.copy_(swa(a, c, n))

    @torch.no_grad()
    def swap(self, module: nn.Module) -> None:
        """Exchange the averaged values with the module's, in place (twice restores both exactly)."""
        for a, m in zip(self.tensors, self._module_tensors(module)):
            kept = m.clone()
            m.copy_(a)
            a.copy_(kept)

    @torch.no_grad()
    def copy_to(self, module: nn.Module) -> None:
        for a, m in zip(self.tensors, self._module_tensors(module)):
            m.copy_(a)

    @torch.no_grad()
    def copy_from(self, module: nn.Module) -> None:
        for a, m in zip(self.tensors, self._module_tensors(module)):
            a.copy_(m)

    @contextlib.contextmanager
    def swapped_in(self, module: nn.Module) -> Iterator[None]:
        self.swap(module)
        try:
            yield
        finally:
            self.swap(module)

    def consolidated_state(self, trainer: Trainer, module: nn.Module) -> dict[str, Any]:
        """The module's full state dict with the averaged values in it, built by the plugin like the model's.

        A collective under sharding plugins: every rank calls it (as every rank builds the checkpoint).
        """
        with self.swapped_in(module):
            state = trainer.plugin.lightning_module_state_dict()
            # Some plugins return views of the module's own tensors: keep the averaged values, not the views.
            held = {_local(t).untyped_storage().data_ptr() for t in self._module_tensors(module)}
            return {
                name: value.clone()
                if isinstance(value, Tensor) and _local(value).untyped_storage().data_ptr() in held
                else value
                for name, value in state.items()
            }

    @torch.no_grad()
    def load_consolidated_state(
        self,
        trainer: Trainer,
        module: nn.Module,
        state: dict[str, Any],
        current_state: Optional[dict[str, Any]] = None,
    ) -> None:
        """Take the averaged values from a full state dict, through the plugin (cut into this run's shards).

        The module is the vehicle: the plugin loads ``state`` into it, the averaged values are read back,
        and the module gets ``current_state`` (or, without one, its own values from before) again.
        """
        strict = bool(getattr(module, "strict_loading", True))
        kept = None if current_state is not None else [t.clone() for t in self._module_tensors(module)]
        trainer.plugin.load_model_state_dict(state, strict=strict)
        self.copy_from(module)
        if current_state is not None:
            trainer.plugin.load_model_state_dict(current_state, strict=strict)
        else:
            for m, k in zip(self._module_tensors(module), kept):  # type: ignore[arg-type]
                m.copy_(k)


def refuse_sharded_folders(trainer: Trainer, owner: str) -> None:
    """The averaged weights travel like the model's full state; a sharded folder has no place for them."""
    if getattr(trainer.plugin, "state_dict_type", "full") == "sharded":
        raise MisconfigurationException(
            f"{owner} under {type(trainer.plugin).__name__}(state_dict_type='sharded'): the averaged weights are "
            "saved as whole tensors by parameter name, like the model's state under state_dict_type='full'; use "
            "state_dict_type='full' (the default) with this callback."
        )


class WeightAveraging(Callback):
    """Keep an average of the weights (SWA by default, EMA with ``avg_fn``), used for validation and at the end.

    Args:
        device: where the averaged copy lives; by default the module's device (``"cpu"`` saves
            accelerator memory).
        use_buffers: average the buffers too (BatchNorm statistics); ``False`` copies them from the
            model at each update instead (then recompute them with ``torch.optim.swa_utils.update_bn``).
        **kwargs: ``AveragedModel``'s averaging arguments, ``avg_fn`` or ``multi_avg_fn``; without
            them the average is the equal-weight one (SWA).

    Override ``should_update(step_idx=None, epoch_idx=None)`` to choose when the average is updated:
    it is asked after every optimizer step (with ``step_idx``, zero-based) and at the end of every
    training epoch (with ``epoch_idx``); the default updates after every step.

    Differences from Lightning, on purpose: the averaged copy is made in ``on_fit_start`` from the
    module as the plugin set it up (so ``configure_model`` layers and FSDP shards are covered and
    ``configure_model`` is not called twice), and ``latest_update_epoch`` is saved beside
    ``latest_update_step`` so that epoch-based updates resume exactly too.
    """

    def __init__(
        self,
        device: Optional[Union[torch.device, str, int]] = None,
        use_buffers: bool = True,
        **kwargs: Any,
    ) -> None:
        unknown = sorted(set(kwargs) - set(_AVERAGED_MODEL_ARGUMENTS))
        if unknown:
            raise MisconfigurationException(
                f"{type(self).__name__}({', '.join(f'{k}=...' for k in unknown)}): unknown argument(s); the "
                f"averaging arguments of torch.optim.swa_utils.AveragedModel are {', '.join(_AVERAGED_MODEL_ARGUMENTS)}."
            )
        for name in _AVERAGED_MODEL_ARGUMENTS:
            if kwargs.get(name) is not None and not callable(kwargs[name]):
                raise MisconfigurationException(f"{type(self).__name__}({name}=...): pass a function.")
        self._device = torch.device(device) if isinstance(device, str) else device
        self._use_buffers = use_buffers
        self._kwargs = kwargs
        self._average: Optional[AveragedWeights] = None
        # A checkpoint's averaged state read before the plugin set the module up: applied in on_fit_start.
        self._pending: Optional[tuple[dict[str, Any], Any]] = None
        # Optimizer steps taken when the average was last updated (0: first asked after the first step).
        self._latest_update_step = 0
        # The epoch after which the average was last updated (-1: none yet).
        self._latest_update_epoch = -1

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        """Whether to update the average after optimizer step ``step_idx`` or epoch ``epoch_idx`` (zero-based)."""
        return step_idx is not None

    # ------------------------------------------------------------------ the run
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            # A new average for every fit, made once the plugin has set the module up (on_fit_start).
            self._average = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        refuse_sharded_folders(trainer, type(self).__name__)
        self._average = AveragedWeights(
            pl_module,
            self._device,
            buffers="average" if self._use_buffers else "copy",
            avg_fn=self._kwargs.get("avg_fn"),
            multi_avg_fn=self._kwargs.get("multi_avg_fn"),
        )
        if self._pending is not None:
            state, n_averaged = self._pending
            self._pending = None
            self._average.load_consolidated_state(trainer, pl_module, state)
            self._set_n_averaged(n_averaged)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step > self._latest_update_step and self.should_update(step_idx=step - 1):
            assert self._average is not None
            self._average.update(pl_module)
            self._latest_update_step = step

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch > self._latest_update_epoch and self.should_update(epoch_idx=epoch):
            assert self._average is not None
            self._average.update(pl_module)
            self._latest_update_epoch = epoch

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._average is not None
        self._average.copy_to(pl_module)

    def on_validation_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._average is not None:
            self._average.swap(pl_module)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._average is not None:
            self._average.swap(pl_module)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {
            "latest_update_step": self._latest_update_step,
            "latest_update_epoch": self._latest_update_epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._latest_update_step = state_dict["latest_update_step"]
        # Lightning's checkpoints do not hold it.
        self._latest_update_epoch = state_dict.get("latest_update_epoch", -1)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """The averaged weights become the checkpoint's ``state_dict``; the trained ones ``current_model_state``."""
        if self._average is None:
            rank_zero_info(
                "WeightAveraging: a checkpoint saved outside fit holds no averaged weights; after fit the model "
                "holds them already."
            )
            return
        averaged = self._average.consolidated_state(trainer, pl_module)
        checkpoint[CURRENT_MODEL_STATE] = checkpoint[KEY_STATE_DICT]
        checkpoint[KEY_STATE_DICT] = averaged
        checkpoint[AVERAGING_STATE] = {N_AVERAGED: self._average.n_averaged.detach().cpu().clone()}

    def on_load_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Averaged weights from ``state_dict``, the trained ones back into the model from ``current_model_state``.

        Written for either moment of the restore: before the plugin sets the module up (the averaged
        state waits for ``on_fit_start``) or after (``FSDPPlugin``: taken now). The checkpoint's
        ``state_dict`` is pointed at the trained weights, so a load of it after this hook loads those.
        """
        if CURRENT_MODEL_STATE in checkpoint and AVERAGING_STATE in checkpoint:
            averaged, current = checkpoint[KEY_STATE_DICT], checkpoint[CURRENT_MODEL_STATE]
            n_averaged = checkpoint[AVERAGING_STATE].get(N_AVERAGED, 0)
            checkpoint[KEY_STATE_DICT] = current
            if self._average is not None:
                self._average.load_consolidated_state(trainer, pl_module, averaged, current_state=current)
                self._set_n_averaged(n_averaged)
            else:
                self._pending = (averaged, n_averaged)
                strict = bool(getattr(pl_module, "strict_loading", True))
                trainer.plugin.load_model_state_dict(current, strict=strict)
            return
        rank_zero_warn(
            "The checkpoint was not written with WeightAveraging: the averaged and the trained weights both start "
            "from its state_dict."
        )
        if self._average is not None:
            self._average.load_consolidated_state(trainer, pl_module, checkpoint[KEY_STATE_DICT])

    def _set_n_averaged(self, value: Any) -> None:
        assert self._average is not None
        self._average.n_averaged.fill_(int(value))


class EMAWeightAveraging(WeightAveraging):
    """An exponential moving average of the weights: ``ema = decay * ema + (1 - decay) * weights``.

    Args:
        decay: the weight of the average so far, in ``[0, 1]``.
        update_every_n_steps: update after every n-th optimizer step (zero-based step index divisible by n).
        update_starting_at_step: no step-based update before this optimizer step (zero-based).
        update_starting_at_epoch: also update at the end of every epoch from this one on.
        device, use_buffers: as for :class:`WeightAveraging`.
    """

    def __init__(
        self,
        device: Optional[Union[torch.device, str, int]] = None,
        use_buffers: bool = True,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: Optional[int] = None,
        update_starting_at_epoch: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        if not 0.0 <= decay <= 1.0:
            raise MisconfigurationException(f"EMAWeightAveraging(decay={decay}): use a value in [0, 1].")
        super().__init__(device=device, use_buffers=use_buffers, **kwargs, avg_fn=get_ema_avg_fn(decay=decay))
        self.decay = decay
        self.update_every_n_steps = update_every_n_steps
        self.update_starting_at_step = update_starting_at_step
        self.update_starting_at_epoch = update_starting_at_epoch

    def should_update(self, step_idx: Optional[int] = None, epoch_idx: Optional[int] = None) -> bool:
        if step_idx is not None:
            started = self.update_starting_at_step is None or step_idx >= self.update_starting_at_step
            due = self.update_every_n_steps > 0 and step_idx % self.update_every_n_steps == 0
            if started and due:
                return True
        return (
            epoch_idx is not None
            and self.update_starting_at_epoch is not None
            and epoch_idx >= self.update_starting_at_epoch
        )
