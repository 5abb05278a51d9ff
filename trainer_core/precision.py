"""Numerical precision of a run: the autocast context, loss scaling and module dtype.

``"32-true"`` does nothing on the step at all: the Trainer asks ``forward_context_needed`` once
and then calls the step directly, so the default precision costs no context manager per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
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
}

#: The parameter dtype of the precisions that train in it (``Trainer.init_module`` creates tensors in it).
_TRUE_DTYPES = {"64-true": torch.float64, "bf16-true": torch.bfloat16}


class Precision:
    """Precision settings for one run on one device type."""

    def __init__(self, precision: Union[str, int], device_type: str = "cpu") -> None:
        if precision not in _ALIASES:
            raise MisconfigurationException(
                f"Trainer(precision={precision!r}) is not supported; use one of "
                "'32-true', '64-true', 'bf16-mixed', '16-mixed', 'bf16-true'."
            )
        self.name = _ALIASES[precision]
        self.device_type = device_type
        self.scaler: Optional[torch.amp.GradScaler] = None
        if self.name == "16-mixed":
            self.scaler = torch.amp.GradScaler(device_type)

    @property
    def forward_context_needed(self) -> bool:
        return self.name in ("bf16-mixed", "16-mixed")

    def forward_context(self) -> contextlib.AbstractContextManager:
        if self.name == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        if self.name == "16-mixed":
            return torch.autocast(self.device_type, dtype=torch.float16)
        return contextlib.nullcontext()

    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.name == "64-true":
            return module.double()
        if self.name == "bf16-true":
            return module.bfloat16()
        return module

    @contextlib.contextmanager
    def tensor_init_context(self) -> Iterator[None]:
        """Floating-point tensors created inside are in this precision's parameter dtype (``*-true``)."""
        dtype = _TRUE_DTYPES.get(self.name)
        if dtype is None:
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    def pre_backward(self, loss: Tensor) -> Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Bring gradients back to their true scale before clipping or inspecting them."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def optimizer_step(
        self, optimizer: Optimizer, closure: Optional[Callable[[], Any]], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return (
                optimizer.step(closure=closure, **kwargs) if closure is not None else optimizer.step(**kwargs)
            )
        # A scaler must see the gradients before stepping, so the closure runs first, outside step().
        result = closure() if closure is not None else None
        self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return result

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
