"""Numerical precision of a run: the autocast context, loss scaling, module and input dtypes.

:class:`Precision` is the extension point (Lightning's ``Precision`` plugin, its members and their
names); the built-in precisions are its subclasses, and ``Trainer(precision=...)`` takes a name or an
instance (:func:`precision_from`). Lightning's names and behaviour:

* ``"32-true"`` (:class:`Precision` itself) does nothing on the step at all: the loop asks
  ``forward_context_needed`` once and then calls the step directly, so the default precision costs no
  context manager per step; the backward and the optimizer step take the same shortcuts.
* ``"bf16-mixed"`` / ``"16-mixed"`` (:class:`MixedPrecision`): float32 weights, the forward under
  ``torch.autocast``. ``"16-mixed"`` scales the loss; the plugin picks the scaler
  (:meth:`TrainingTypePlugin.grad_scaler`): where each rank holds only part of the gradients (sharded
  optimizers, FSDP, pipeline stages) it is torch's ``ShardedGradScaler``, which agrees across ranks
  whether any gradient is inf/NaN, so every rank skips the same steps.
* ``"bf16-true"`` / ``"16-true"`` (:class:`HalfPrecision`) and ``"64-true"`` (:class:`DoublePrecision`):
  weights, inputs and tensors created in ``forward`` in that dtype.

Unlike Lightning, ``"16-mixed"`` on the CPU trains in float16 as asked (torch >= 2.4 autocasts float16
on the CPU); Lightning predates that and switches to bf16 with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.amp.grad_scaler import OptState
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities.apply_func import apply_to_collection
from trainer_core.utilities.overrides import is_overridden

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
_NAMES = "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true', '16-true'"

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
_BACKWARD_MEMBERS = ("pre_backward", "backward", "post_backward")


class Precision:
    """Full float32, nothing done per step: the default precision, and the base of every other.

    A subclass overrides what its precision changes, with Lightning's names: ``convert_module``,
    ``convert_input``, ``tensor_init_context``, ``forward_context`` (around every step's forward),
    ``pre_backward`` / ``backward`` / ``post_backward``, ``optimizer_step``, ``unscale_gradients``,
    ``state_dict`` / ``load_state_dict`` and ``check_device``. Pass an instance:
    ``Trainer(precision=MyPrecision())`` or ``Trainer(plugins=[MyPrecision()])``.

    The base has no ``__init__``: its defaults are class attributes, so a subclass whose ``__init__``
    does not call ``super().__init__()`` works. The loop asks once per epoch which members a subclass
    overrides and skips the others on every step (a float32 run pays nothing for them).
    """

    #: The precision's name: ``Trainer.precision``, and recorded in checkpoints, so that resuming
    #: under another name is noticed (a warning says what changes). A subclass that trains in other
    #: dtypes than float32 sets its own; a subclass that keeps float32 may keep ``"32-true"``.
    name: str = "32-true"
    #: The device type the forward runs on (``"cpu"``, ``"cuda"``): set by the Trainer (:func:`precision_from`).
    device_type: str = "cpu"
    #: The loss scaler (``"16-mixed"`` only), made by the plugin once its processes exist (:meth:`setup`).
    scaler: Optional[torch.amp.GradScaler] = None
    #: Whether the loss is scaled by :attr:`scaler` (``"16-mixed"``).
    scales_loss: bool = False
    #: Floating inputs are converted to this dtype before the transfer hooks (``*-true`` but 32).
    input_dtype: Optional[torch.dtype] = None

    @property
    def precision(self) -> str:
        """Lightning's attribute for the name (``trainer.precision_plugin.precision``)."""
        return self.name

    # ------------------------------------------------------------------ what the loop asks once
    @property
    def forward_context_needed(self) -> bool:
        """Whether :meth:`forward_context` does anything: ``False`` here, the loop then enters none per step."""
        return is_overridden("forward_context", self, Precision)

    @property
    def input_conversion_needed(self) -> bool:
        """Whether :meth:`convert_input` changes batches (otherwise the loop does not call it)."""
        return is_overridden("convert_input", self, Precision)

    @property
    def custom_backward(self) -> bool:
        """Whether a user's subclass overrides ``pre_backward``, ``backward`` or ``post_backward``."""
        return _user_overrides(self, _BACKWARD_MEMBERS)

    @property
    def custom_optimizer_step(self) -> bool:
        """Whether a user's subclass overrides ``optimizer_step``."""
        return _user_overrides(self, ("optimizer_step",))

    # ------------------------------------------------------------------ before training
    def check_device(self, device: torch.device) -> None:
        """Refuse, before anything runs, a precision the device cannot compute in (float32: every device)."""

    def setup(self, make_scaler: Callable[[], torch.amp.GradScaler]) -> None:
        """Once per Trainer, when the processes exist: ``make_scaler`` is the plugin's ``grad_scaler``."""

    def check_optimizers(self, optimizers: list[Optimizer]) -> None:
        """Refuse, before the first step, an optimizer this precision cannot drive."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """The module in this precision's parameter dtype (in place), before the plugin moves and wraps it."""
        return module

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        """Around ``Trainer.init_module``: tensors created inside take this precision's parameter dtype."""
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ every step
    def convert_input(self, batch: Any) -> Any:
        """The batch in this precision's input dtype, before ``on_before_batch_transfer``."""
        return batch

    def forward_context(self) -> contextlib.AbstractContextManager:
        """Around every step's forward (training, validation, test, predict)."""
        return contextlib.nullcontext()

    def pre_backward(self, tensor: Tensor, module: nn.Module) -> Tensor:
        """The tensor to run the backward from (the scaled loss under loss scaling)."""
        return tensor

    def backward(
        self, tensor: Tensor, model: nn.Module, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any
    ) -> None:
        """The backward of ``tensor`` (``optimizer`` is ``None`` under manual optimization)."""
        model.backward(tensor, *args, **kwargs)

    def post_backward(self, tensor: Tensor, module: nn.Module) -> Tensor:
        """After the backward; ``tensor`` is what :meth:`pre_backward` returned."""
        return tensor

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring the gradients back to their true scale (a precision that scales the loss).

        Gradient clipping calls it first; it may be called again in the same step, where it must not
        unscale twice.
        """

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Optional[Callable[[], Any]],
        after_closure: Optional[Callable[[Optimizer], None]] = None,
        skip_without_loss: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Step ``optimizer``: the closure (forward and backward), ``after_closure``, then the step.

        ``after_closure`` (``on_before_optimizer_step``, gradient clipping) sees the gradients the step
        will use, as in Lightning. ``skip_without_loss`` (automatic optimization): a precision that runs
        the closure itself should not step when it returned ``None`` (the batch was skipped).
        """
        if after_closure is not None:
            inner = closure

            def closure() -> Any:
                result = inner() if inner is not None else None
                after_closure(optimizer)
                return result

        return optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This precision's state, saved in the checkpoint under ``"precision"`` (``{}``: none).

        A dict whose values load with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On resume, after the plugin's setup: the state a precision of the same :attr:`name` saved.

        Not called when the checkpoint holds none for it (written under another name, or ``{}``).
        """


class _TruePrecision(Precision):
    """Weights, inputs and tensors created in ``forward`` in :attr:`dtype` (the ``*-true`` precisions)."""

    dtype: torch.dtype = torch.float32

    @property
    def input_dtype(self) -> torch.dtype:
        """Floating inputs are converted to this dtype before the transfer hooks."""
        return self.dtype

    def check_device(self, device: torch.device) -> None:
        _check_compute_dtype(self.name, self.dtype, device)

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return _default_dtype(self.dtype)

    def convert_input(self, batch: Any) -> Any:
        """Floating-point tensors of ``batch`` in the weights' dtype (others, and integers, as they are)."""
        dtype = self.dtype
        return apply_to_collection(
            batch, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t
        )

    def forward_context(self) -> contextlib.AbstractContextManager:
        # Tensors the forward creates (torch.zeros(...), torch.arange(..., dtype=float)) match the weights.
        return _default_dtype(self.dtype)


class DoublePrecision(_TruePrecision):
    """``"64-true"``: weights, inputs and tensors created in ``forward`` in float64."""

    name = "64-true"
    dtype = torch.float64


class HalfPrecision(_TruePrecision):
    """``"bf16-true"`` / ``"16-true"``: weights, inputs and tensors created in ``forward`` in that dtype."""

    def __init__(self, precision: str = "16-true") -> None:
        if precision not in ("16-true", "bf16-true"):
            raise MisconfigurationException(
                f"HalfPrecision(precision={precision!r}): use '16-true' or 'bf16-true'."
            )
        self.name = precision
        self.dtype = _TRUE_DTYPES[precision]


class MixedPrecision(Precision):
    """``"bf16-mixed"`` / ``"16-mixed"``: float32 weights, the forward under ``torch.autocast``.

    ``"16-mixed"`` scales the loss (``pre_backward``), unscales the gradients before
    ``on_before_optimizer_step`` and clipping, and skips a step whose gradients hold inf/NaN.
    """

    def __init__(self, precision: str, device_type: str = "cpu") -> None:
        if precision not in _AUTOCAST_DTYPES:
            raise MisconfigurationException(
                f"MixedPrecision(precision={precision!r}): use '16-mixed' or 'bf16-mixed'."
            )
        self.name = precision
        self.device_type = device_type
        self.dtype = _AUTOCAST_DTYPES[precision]
        self.scales_loss = precision == "16-mixed"

    def check_device(self, device: torch.device) -> None:
        _check_compute_dtype(self.name, self.dtype, device)
        if not _autocast_supported(device.type, self.dtype):
            other = "bf16-mixed" if self.dtype is torch.float16 else "16-mixed"
            raise MisconfigurationException(
                f"Trainer(precision={self.name!r}): torch {torch.__version__} cannot autocast to {self.dtype} on "
                f"{device.type!r}. Use {other!r} or '32-true'."
            )

    def setup(self, make_scaler: Callable[[], torch.amp.GradScaler]) -> None:
        """Make the loss scaler (``"16-mixed"``) with the plugin's ``grad_scaler``, once per Trainer."""
        if self.scales_loss and self.scaler is None:
            self.scaler = make_scaler()

    def check_optimizers(self, optimizers: list[Optimizer]) -> None:
        if self.scales_loss and any(isinstance(opt, torch.optim.LBFGS) for opt in _unwrapped(optimizers)):
            raise MisconfigurationException(_LBFGS_MESSAGE)

    def forward_context(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def pre_backward(self, tensor: Tensor, module: nn.Module) -> Tensor:
        return self.scaler.scale(tensor) if self.scaler is not None else tensor

    def unscale_gradients(self, optimizer: Optimizer) -> None:
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
        """Under loss scaling: a step whose gradients hold inf/NaN is skipped, and the scale lowered."""
        scaler = self.scaler
        if scaler is None:
            return super().optimizer_step(optimizer, closure, after_closure, skip_without_loss, **kwargs)
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
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)


def precision_from(value: Union[str, int, Precision], device_type: str = "cpu") -> Precision:
    """The precision ``Trainer(precision=value)`` asks for: a name (or Lightning's int alias) or an instance.

    An instance is used as it is, with :attr:`Precision.device_type` set to the Trainer's device.
    """
    if isinstance(value, Precision):
        value.device_type = device_type
        return value
    if isinstance(value, type) and issubclass(value, Precision):
        raise MisconfigurationException(
            f"Trainer(precision={value.__name__}): pass an instance, {value.__name__}()."
        )
    name = _ALIASES.get(value) if isinstance(value, (str, int)) and not isinstance(value, bool) else None
    if name is None:
        raise MisconfigurationException(
            f"Trainer(precision={value!r}) is not supported; use one of {_NAMES}, or a Precision instance."
        )
    if name == "32-true":
        return Precision()
    if name == "64-true":
        return DoublePrecision()
    if name in _TRUE_DTYPES:
        return HalfPrecision(name)
    return MixedPrecision(name, device_type)


def _user_overrides(precision: Precision, names: tuple[str, ...]) -> bool:
    """Whether a class defined outside this module (a user's) provides one of ``names`` for ``precision``."""
    for name in names:
        owner = next(cls for cls in type(precision).__mro__ if name in vars(cls))
        if owner.__module__ != __name__:
            return True
    return False


def _check_compute_dtype(name: str, dtype: torch.dtype, device: torch.device) -> None:
    if device.type == "cuda" and dtype is torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise MisconfigurationException(
            f"Trainer(precision={name!r}): {torch.cuda.get_device_name(device)} does not compute in "
            "bfloat16. Use precision='16-mixed' (float16 with loss scaling) or '32-true'."
        )
    if device.type == "mps" and dtype is torch.float64:
        raise MisconfigurationException(
            "Trainer(precision='64-true'): MPS devices have no float64. Use '32-true', or accelerator='cpu'."
        )


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


def loaded_state(precision: Precision, saved: Optional[str], state: dict[str, Any]) -> dict[str, Any]:
    """What of a checkpoint's precision ``state``, saved under the name ``saved``, ``precision`` loads.

    A precision loads the state one of its name saved. The built-in precisions also take each other's
    (a loss scaler's state or nothing) and a checkpoint that did not record the name (older, or Lightning's).
    """
    if not state or saved == precision.name:
        return state
    if type(precision) in _BUILT_IN and (saved is None or saved in _BUILT_IN_NAMES):
        return state
    return {}


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
    # A user's precision saved a state only a precision of its name reads; its dtypes are its own.
    foreign = saved not in _BUILT_IN_NAMES
    known = not foreign and current in _BUILT_IN_NAMES
    saved_dtype = _TRUE_DTYPES.get(saved, torch.float32)
    current_dtype = _TRUE_DTYPES.get(current, torch.float32)
    if known and saved_dtype != current_dtype:
        exact = current_dtype is torch.float64 or (
            current_dtype is torch.float32 and saved_dtype is not torch.float64
        )
        notes.append(
            f"the weights and optimizer state, saved in {_dtype_name(saved_dtype)}, are converted to "
            f"{_dtype_name(current_dtype)}" + (" (exactly)" if exact else " (rounded: the values change)")
        )
    if foreign and scaler_state:
        notes.append(f"the state precision={saved!r} saved ({', '.join(map(str, scaler_state))}) is dropped")
    elif saved == "16-mixed" and current != "16-mixed" and scaler_state:
        notes.append(f"the loss scaler's state (scale {scaler_state.get('scale')}) is dropped")
    if current == "16-mixed" and (foreign or not scaler_state):
        notes.append("the loss scaler starts fresh (scale 65536, growing every 2000 steps without inf)")
    saved_compute = _COMPUTE_DTYPES.get(saved, torch.float32)
    current_compute = _COMPUTE_DTYPES.get(current, torch.float32)
    if known and saved_compute != current_compute:
        notes.append(
            f"the forward computes in {_dtype_name(current_compute)} instead of {_dtype_name(saved_compute)}"
        )
    changes = ": " + "; ".join(notes) if notes else ""
    return (
        f"The checkpoint was written with precision={saved!r}; this run trains with precision={current!r}"
        + changes
        + ". Training continues from it, but not bit for bit as the saved run would have."
    )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


_BUILT_IN = (Precision, DoublePrecision, HalfPrecision, MixedPrecision)
_BUILT_IN_NAMES = frozenset(_ALIASES.values())
