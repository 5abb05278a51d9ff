"""DDP communication hooks: the checks where ``DDPPlugin`` is built, and their state in checkpoints.

``DDPPlugin(ddp_comm_hook=..., ddp_comm_state=..., ddp_comm_wrapper=...)`` registers the hook on its
``DistributedDataParallel`` wrapper (plugins/ddp.py). Here: what ``register_comm_hook`` would refuse in
every process at setup, checked once in the process that builds the plugin; and a hook state as the
checkpoint holds it (a ``PowerSGDState`` field by field, in types ``torch.load(weights_only=True)``
reads; another state through its own ``state_dict``/``load_state_dict``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities.arguments import pass_instance

#: Under the checkpoint's ``"plugin_state"``: the communication hook's state, ``{KIND_KEY: ..., PER_RANK_KEY: [...]}``.
COMM_STATE_KEY = "ddp_comm_state"
KIND_KEY = "kind"
PER_RANK_KEY = "per_rank"
POWER_SGD_KIND = "PowerSGDState"
STATE_DICT_KIND = "state_dict"
BUCKETS_KEY = "buckets"
#: Under the checkpoint's ``"plugin_state"``: the gradient buckets DDP had rebuilt (:func:`bucket_layout`), which
#: the resumed wrapper reduces in from its first iteration on.
BUCKET_LAYOUT_KEY = "ddp_bucket_layout"
#: What a ``PowerSGDState`` changes as it runs; its other fields are the hyper-parameters it was built with.
_POWER_SGD_RUN_STATE = (
    "iter",
    "rng",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)
#: The fields every rank holds alike (the iteration and the generator that seeds the random projections).
_POWER_SGD_SHARED = (
    "iter",
    "rng",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)


def check_comm_hook(owner: str, unsupported: Optional[str], state: Any, hook: Any, wrapper: Any) -> None:
    """Refuse, where the plugin ``owner`` is built, a hook setting that would fail at the first backward or never run.

    ``unsupported``: why the plugin runs no hook at all (``DDPPlugin.ddp_comm_hook_unsupported``), or ``None``.
    """
    call = f"{owner}(ddp_comm_hook={hook_name(hook)})"
    if hook is not None and unsupported:
        raise MisconfigurationException(f"{call}: {unsupported}.")
    if hook is not None and not _takes_arguments(hook, 2):
        raise MisconfigurationException(
            f"{call}: a communication hook is a function hook(state, bucket) returning a torch.futures.Future "
            "of the reduced bucket; pass one, such as torch.distributed.algorithms.ddp_comm_hooks."
            "default_hooks.allreduce_hook."
        )
    problem = _registration_problem(hook) if hook is not None and wrapper is None else None
    if problem:
        raise MisconfigurationException(f"{call}: {problem}.")
    if wrapper is not None and hook is None:
        raise MisconfigurationException(
            f"{owner}(ddp_comm_wrapper={hook_name(wrapper)}): a wrapper wraps a hook, and ddp_comm_hook is "
            "None; pass the hook to wrap as well (ddp_comm_hook=powerSGD_hook, ddp_comm_wrapper=fp16_compress_wrapper)."
        )
    if wrapper is not None and not _takes_arguments(wrapper, 1):
        raise MisconfigurationException(
            f"{owner}(ddp_comm_wrapper={hook_name(wrapper)}): a wrapper is a function wrapper(hook) returning "
            "the hook to register; pass one, such as torch.distributed.algorithms.ddp_comm_hooks."
            "default_hooks.fp16_compress_wrapper."
        )
    if isinstance(state, type):
        raise MisconfigurationException(f"{owner}(ddp_comm_state={state.__name__}): {pass_instance(state)}.")
    if state is not None and hook is None:
        raise MisconfigurationException(
            f"{owner}(ddp_comm_state={type(state).__name__}(...)): the state is what ddp_comm_hook "
            "is called with, and ddp_comm_hook is None; pass the hook as well (powerSGD_hook for a PowerSGDState)."
        )


def _takes_arguments(fn: Any, count: int) -> bool:
    """Whether ``fn`` is callable with ``count`` positional arguments (assumed so where its signature is unknown)."""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(*([None] * count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def _registration_problem(hook: Callable[..., Any]) -> Optional[str]:
    """What ``DistributedDataParallel.register_comm_hook`` would refuse in ``hook`` (in every process, at setup)."""
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return None
    bucket = signature.parameters.get("bucket")
    if bucket is None:
        return "torch registers a hook whose second parameter is named `bucket` only; rename it"
    if getattr(hook, "__name__", None) is None:
        return "torch reads the hook's __name__, which it lacks (a functools.partial); pass a function (def)"
    postponed = " (a string annotation, as `from __future__ import annotations` makes, counts as another)"
    if bucket.annotation is not inspect.Parameter.empty and bucket.annotation is not dist.GradBucket:
        return (
            f"torch refuses `bucket: {bucket.annotation}`: annotate it torch.distributed.GradBucket{postponed}, "
            "or leave it unannotated"
        )
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and returned != torch.futures.Future[Tensor]:
        return (
            f"torch refuses the return annotation {returned}: annotate it torch.futures.Future[torch.Tensor]"
            f"{postponed}, or leave it out"
        )
    return None


def hook_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def bucket_layout(model: Optional[nn.Module]) -> Optional[list[list[int]]]:
    """The gradient buckets ``model`` reduces in now: each bucket's parameters, by position in ``parameters()``.

    A new wrapper reduces its first iteration in its initial buckets (the parameters in the order they
    are defined) and then rebuilds them in the order the gradients became ready (unless
    ``find_unused_parameters=True``). Torch shows a wrapper's buckets only as zero-filled copies
    (``reducer._get_zeros_like_grad_buckets``): one transient allocation of the gradients' size, made
    when a PowerSGD state is saved or restored, never on the step. ``None`` without a wrapper.
    """
    if not isinstance(model, DistributedDataParallel):
        return None
    position = {id(param): index for index, param in enumerate(model.module.parameters())}
    buckets = model.reducer._get_zeros_like_grad_buckets()
    return [[position[id(param)] for param in bucket.parameters()] for bucket in buckets]


def same_first_buckets(saved: Optional[list[list[int]]], model: Optional[nn.Module]) -> bool:
    """Whether ``model``'s next iteration reduces in the buckets a state was saved in."""
    return saved is not None and saved == bucket_layout(model)


def is_power_sgd(state: Any) -> bool:
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    return isinstance(state, PowerSGDState)


def comm_state_dict(state: Any) -> Optional[tuple[str, dict[str, Any]]]:
    """``(kind, this rank's state)`` of a hook state that can be saved, or ``None``."""
    if state is None:
        return None
    if is_power_sgd(state):
        return POWER_SGD_KIND, _power_sgd_state(state)
    if callable(getattr(state, "state_dict", None)) and callable(getattr(state, "load_state_dict", None)):
        return STATE_DICT_KIND, state.state_dict()
    return None


def _power_sgd_state(state: Any) -> dict[str, Any]:
    """What ``PowerSGDState.__getstate__`` gives (without its warning), in types ``weights_only`` loads.

    Tensors are copied to the CPU: the warm-start matrices change in place at the next step.
    """
    import numpy as np

    fields: dict[str, Any] = {}
    for slot in type(state).__slots__:
        if slot == "process_group":
            continue
        value = getattr(state, slot)
        if slot == "rng":
            kind, keys, pos, has_gauss, cached_gaussian = value.get_state()
            value = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype(np.int64)),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            }
        elif isinstance(value, dict):
            value = {index: tensor.detach().to("cpu", copy=True) for index, tensor in value.items()}
        fields[slot] = value
    return fields


def load_power_sgd(state: Any, saved: dict[str, Any], device: torch.device, same_world: bool) -> None:
    """Put a saved PowerSGD run state into ``state``; its hyper-parameters stay the ones it was built with."""
    import numpy as np

    for slot in _POWER_SGD_RUN_STATE if same_world else _POWER_SGD_SHARED:
        value = saved[slot]
        if slot == "rng":
            rng = np.random.RandomState()
            rng.set_state(
                (
                    value["kind"],
                    value["keys"].numpy().astype(np.uint32),
                    value["pos"],
                    value["has_gauss"],
                    value["cached_gaussian"],
                )
            )
            value = rng
        elif isinstance(value, dict):
            value = {index: tensor.to(device, copy=True) for index, tensor in value.items()}
        setattr(state, slot, value)
    if not same_world:
        state.error_dict, state.p_memory_dict, state.q_memory_dict = {}, {}, {}
