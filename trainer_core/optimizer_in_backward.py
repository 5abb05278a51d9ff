"""Optimizer in backward: every parameter steps the moment its gradient is ready.

``Trainer(optimizer_in_backward=True)`` gives each trainable parameter an optimizer of its own
(the class and hyper-parameters of the one ``configure_optimizers`` returned) and steps it from
the parameter's ``register_post_accumulate_grad_hook``, then drops the gradient. So the gradients
of the whole model never exist at once: at most the one being consumed does, which is what makes
this worth doing for large models.

The optimizer ``configure_optimizers`` returned stays the one everything else sees. Its
``param_groups`` are what schedulers drive, what ``LearningRateMonitor`` reads and what the
checkpoint stores; its ``state`` is *the same dict* the per-parameter optimizers write into (each
writes only its own parameter's entry). Its ``state_dict()`` is therefore exactly the one a normal
run writes, keyed the same way, and a run can switch between stepping in backward and normal
stepping across a resume. Before each training step, ``sync`` copies the groups' hyper-parameters
(the learning rate a scheduler set, say) into the per-parameter optimizers, and shares the state
dict again if ``load_state_dict`` replaced it.

A plugin supports this only when the gradient a parameter's hook sees is final: on one device,
and under FSDP2, whose hook fires on the reduced, sharded gradient. Under DDP the hook would fire
before the gradient is all-reduced, so DDP-based plugins refuse it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
from torch import Tensor
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException

__all__ = ["OptimizerInBackward", "optimizer_defaults"]


class OptimizerInBackward:
    """Per-parameter copies of ``optimizer``, stepped from gradient hooks during ``backward``."""

    def __init__(self, optimizer: Optimizer) -> None:
        _check_optimizer(optimizer)
        self.optimizer = optimizer
        defaults = optimizer_defaults(optimizer)
        self._state = optimizer.state
        # One list of per-parameter groups for each of ``optimizer``'s groups, in order.
        self._members: list[list[dict[str, Any]]] = []
        self.per_parameter_optimizers: list[Optimizer] = []
        self._handles: list[Any] = []
        for group in optimizer.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            members: list[dict[str, Any]] = []
            for param in group["params"]:
                if not param.requires_grad:
                    continue
                single = type(optimizer)([{**hyper, "params": [param]}], **defaults)
                single.state = optimizer.state
                members.append(single.param_groups[0])
                self.per_parameter_optimizers.append(single)
                self._handles.append(param.register_post_accumulate_grad_hook(_step_and_free(single)))
            self._members.append(members)

    def sync(self) -> None:
        """Bring the per-parameter optimizers up to date with ``optimizer``; call before each backward."""
        optimizer = self.optimizer
        if optimizer.state is not self._state:
            # ``load_state_dict`` (a resume) replaces the state dict: share the new one.
            self._state = optimizer.state
            for single in self.per_parameter_optimizers:
                single.state = optimizer.state
        for group, members in zip(optimizer.param_groups, self._members):
            hyper = {k: v for k, v in group.items() if k != "params"}
            for member in members:
                member.update(hyper)
        # Its parameters do step (in backward): schedulers check this flag to warn about a wrong order.
        optimizer._opt_called = True  # type: ignore[attr-defined]

    def remove(self) -> None:
        """Take the hooks off the parameters; the model then trains (or evaluates) as usual."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (
            f"OptimizerInBackward({type(self.optimizer).__name__}, "
            f"{len(self.per_parameter_optimizers)} parameters)"
        )


def _step_and_free(optimizer: Optimizer) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        optimizer.step()
        param.grad = None

    return hook


def _check_optimizer(optimizer: Optimizer) -> None:
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.LBFGS):
        raise MisconfigurationException(
            "Trainer(optimizer_in_backward=True) cannot step LBFGS: it re-evaluates the whole model "
            "several times per step, which needs every gradient at once. Use another optimizer or "
            "optimizer_in_backward=False."
        )
    if callable(getattr(optimizer, "consolidate_state_dict", None)):
        raise MisconfigurationException(
            f"Trainer(optimizer_in_backward=True) cannot step {name}: a sharded optimizer steps its "
            "shard of every parameter together. Return a plain torch optimizer from configure_optimizers."
        )


def optimizer_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """The hyper-parameters to build another ``type(optimizer)`` with (sharded wrappers, per-parameter copies).

    ``optimizer.defaults`` can hold keys its own ``__init__`` does not take (torch's ``AdamW``
    stores ``decoupled_weight_decay``, set by its parent class), so only accepted names pass.
    """
    try:
        accepted = inspect.signature(type(optimizer).__init__).parameters
    except (TypeError, ValueError):
        return dict(optimizer.defaults)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}
