"""Numerical precision of a run: the autocast context, loss scaling, module and input dtypes.

Lightning's names and behaviour:

* ``"32-true"`` does nothing on the step at all: the Trainer asks ``forward_context_needed`` once
  and then calls the step directly, so the default precision costs no context manager per step.
* ``"bf16-mixed"`` / ``"16-mixed"``: float32 weights, the forward under ``torch.autocast``. ``"16-mixed"``
  scales the loss; the plugin picks the scaler (:meth:`TrainingTypePlugin.grad_scaler`): where each rank
  holds only part of the gradients (sharded optimizers, FSDP, pipeline stages) it is torch's
  ``ShardedGradScaler``, which agrees across ranks whether any gradient is inf/NaN, so every rank skips
  the same steps.
* ``"bf16-true"`` / ``"16-true"`` / ``"64-true"``: weights, inputs and tensors created in ``forward`` in
  that dtype.

Unlike Lightning, ``"16-mixed"`` on the CPU trains in float16 as asked (torch >= 2.4 autocasts float16
on the CPU); Lightning predates that and switches to bf16 with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException

_ALIASES: dict[Any, str] = {
    "32-true": "32-true",
    "32": "32-true",
    32: "32-true",
    "64-true": "64-true",
    "64": "64-true",
    64: "64-true",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
}

#: The parameter (and input) dtype of the precisions that train in it.
_TRUE_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16, "16-true": torch.float16}
#: The dtype ``torch.autocast`` computes in, for the mixed precisions.
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_LBFGS_MESSAGE = (
    "precision='16-mixed' and the LBFGS optimizer are not compatible: LBFGS re-evaluates the loss inside step(), "
    "where a loss scaler cannot check it for inf/NaN. Use precision='bf16-mixed' or '32-true'."
)
#: The dtype each precision computes in (what a device must support).
_COMPUTE_DTYPES = {**_TRUE_DTYPES, **_AUTOCAST_DTYPES}


class Precision:
    """Precision settings for one run on one device type."""

    def __init__(self, precision: Union[str, int], device_type: str = "cpu") -> None:
        if precision not in _ALIASES:
            raise MisconfigurationException(
                f"Trainer(precision={precision!r}) is not supported; use one of "
                "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'."
            )
        self.name = _ALIASES[precision]
        self.device_type = device_type
        #: The loss scaler (``"16-mixed"`` only), made by the plugin once its processes exist (:meth:`setup`).
        self.scaler: Optional[torch.amp.GradScaler] = None
        #: Floating inputs are converted to this dtype before the transfer hooks (``*-true`` but 32).
        self.input_dtype: Optional[torch.dtype] = _TRUE_DTYPES.get(self.name)

    @property
    def precision(self) -> str:
        """Lightning's attribute for the name (``trainer.precision_plugin.precision``)."""
        return self.name

    @property
    def scales_loss(self) -> bool:
        return self.name == "16-mixed"

    @property
    def forward_context_needed(self) -> bool:
        return self.name != "32-true"

    def check_device(self, device: torch.device) -> None:
        """Refuse, before anything runs, a precision the device cannot compute in."""
        dtype = _COMPUTE_DTYPES.get(self.name)
        if dtype is None:
            return
        if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise MisconfigurationException(
                f"Trainer(precision={self.name!r}): {torch.cuda.get_device_name(device)} does not compute in "
                "bfloat16. Use precision='16-mixed' (float16 with loss scaling) or '32-true'."
            )
        if device.type == "mps" and dtype is torch.float64:
            raise MisconfigurationException(
                "Trainer(precision='64-true'): MPS devices have no float64. Use '32-true', or accelerator='cpu'."
            )
        if self.name in _AUTOCAST_DTYPES and not _autocast_supported(device.type, dtype):
            raise MisconfigurationException(
                f"Trainer(precision={self.name!r}): torch {torch.__version__} cannot autocast to {dtype} on "
                f"{device.type!r}. Use {'bf16-mixed' if dtype is torch.float16 else '16-mixed'!r} or '32-true'."
            )

    def setup(self, make_scaler: Callable[[], torch.amp.GradScaler]) -> None:
        """Make the loss scaler (``"16-mixed"``) with the plugin's ``grad_scaler``, once per Trainer."""
        if not self.scales_loss or self.scaler is not None:
            return
        self.scaler = make_scaler()

    def check_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Refuse, before the first step, an optimizer loss scaling cannot drive."""
        if self.scales_loss and any(isinstance(opt, torch.optim.LBFGS) for opt in _unwrapped(optimizers)):
            raise MisconfigurationException(_LBFGS_MESSAGE)

    def forward_context(self) -> contextlib.AbstractContextManager:
        dtype = _AUTOCAST_DTYPES.get(self.name)
        if dtype is not None:
            return torch.autocast(self.device_type, dtype=dtype)
        if self.input_dtype is not None:
            # Tensors the forward creates (torch.zeros(...), torch.arange(..., dtype=float)) match the weights.
            return _default_dtype(self.input_dtype)
        return contextlib.nullcontext()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.input_dtype is not None:
            return module.to(dtype=self.input_dtype)
        return module

    def convert_input(self, batch: Any) -> Any:
        """Floating-point tensors of ``batch`` in the ``*-true`` dtype (others, and integers, as they are)."""
        dtype = self.input_dtype
        if dtype is None:
            return batch
        return apply_to_collection(
            batch, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t
        )

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Floating-point tensors created inside are in this precision's parameter dtype (``*-true``)."""
        if self.input_dtype is None:
            return contextlib.nullcontext()
        return _default_dtype(self.input_dtype)

    def pre_backward(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients back to their true scale before clipping or inspecting them (once per step)."""
        scaler = self.scaler
        if scaler is None:
            return
        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Optional[Callable[[], Any]],
        after_closure: Optional[Callable[[Optimizer], None]] = None,
        skip_without_loss: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer``: the closure (forward and backward), ``after_closure``, then the step.

        ``after_closure`` (``on_before_optimizer_step``, gradient clipping) sees the gradients at their
        true scale, as in Lightning. Under loss scaling, a step whose closure returned ``None`` (the batch
        was skipped) does not step (with ``skip_without_loss``, automatic optimization), and a step whose
        gradients hold inf/NaN is skipped by the scaler, which then lowers the scale.
        """
        scaler = self.scaler
        if scaler is None:
            if after_closure is not None:
                inner = closure

                def closure() -> Any:
                    result = inner() if inner is not None else None
                    after_closure(optimizer)
                    return result

            return (
                optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)
            )
        if isinstance(optimizer, torch.optim.LBFGS):
            raise MisconfigurationException(_LBFGS_MESSAGE)
        # A scaler must see the gradients before stepping, so the closure runs first, outside step().
        result = closure() if closure is not None else None
        if result is None and skip_without_loss:
            return None
        self.unscale_gradients(optimizer)
        if after_closure is not None:
            after_closure(optimizer)
        scaler.step(optimizer, **kwargs)
        scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # Called once the plugin's setup made the scaler (restore_training_state).
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def _unwrapped(optimizers: list[Optimizer]) -> Iterator[Optimizer]:
    """The optimizers themselves: containers (one per pipeline part) and wrappers opened."""
    for opt in optimizers:
        inner = getattr(opt, "optimizers", None)
        if isinstance(inner, (list, tuple)):
            yield from _unwrapped(list(inner))
            continue
        yield getattr(opt, "optim", opt)  # fairscale OSS and ZeroRedundancyOptimizer hold the real one there


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype)`` autocasts (torch disables it with a warning otherwise)."""
    if not torch.amp.is_autocast_available(device_type):
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.autocast(device_type, dtype=dtype)
    return not any("not supported" in str(w.message) or "Disabling" in str(w.message) for w in caught)


def describe_change(saved: Optional[str], current: str, scaler_state: dict[str, Any]) -> Optional[str]:
    """What resuming a checkpoint written under precision ``saved`` changes under ``current`` (``None``: nothing)."""
    if saved == current:
        return None
    if saved is None:
        # Written before checkpoints recorded the precision, or by Lightning.
        if scaler_state and current != "16-mixed":
            return (
                f"The checkpoint holds a loss scaler's state (scale {scaler_state.get('scale')}), which "
                f"precision={current!r} does not use: it is dropped."
            )
        return None
    notes = []
    saved_dtype = _TRUE_DTYPES.get(saved, torch.float32)
    current_dtype = _TRUE_DTYPES.get(current, torch.float32)
    if saved_dtype != current_dtype:
        exact = current_dtype is torch.float64 or (
            current_dtype is torch.float32 and saved_dtype is not torch.float64
        )
        notes.append(
            f"the weights and optimizer state, saved in {_dtype_name(saved_dtype)}, are converted to "
            f"{_dtype_name(current_dtype)}" + (" (exactly)" if exact else " (rounded: the values change)")
        )
    if saved == "16-mixed" and current != "16-mixed" and scaler_state:
        notes.append(f"the loss scaler's state (scale {scaler_state.get('scale')}) is dropped")
    if current == "16-mixed" and not scaler_state:
        notes.append("the loss scaler starts fresh (scale 65536, growing every 2000 steps without inf)")
    saved_compute = _COMPUTE_DTYPES.get(saved, torch.float32)
    current_compute = _COMPUTE_DTYPES.get(current, torch.float32)
    if saved_compute != current_compute:
        notes.append(
            f"the forward computes in {_dtype_name(current_compute)} instead of {_dtype_name(saved_compute)}"
        )
    return (
        f"The checkpoint was written with precision={saved!r}; this run trains with precision={current!r}: "
        + "; ".join(notes)
        + ". Training continues from it, but not bit for bit as the saved run would have."
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")
