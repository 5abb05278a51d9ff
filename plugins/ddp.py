"""``DDPPlugin``: data parallelism with ``DistributedDataParallel``; gloo on CPU, nccl on CUDA.

Every rank holds the whole model; DDP averages gradients during the backward. The training step
goes through the DDP wrapper (which is what makes the gradient hooks fire); validation, test and
prediction call the module directly, so they add no collective. Nothing else runs a collective
on the step: metrics are reduced only when ``self.log(..., sync_dist=True)`` asks for it.

A communication hook (``ddp_comm_hook``, Lightning's argument) replaces DDP's all-reduce of each
gradient bucket: it is registered on the wrapper on every backend, gloo on CPU included (Lightning
registers it on CUDA only and ignores it elsewhere). Its state resumes from checkpoints through
``plugin_state_dict``: a ``PowerSGDState`` is saved field by field, every rank's error feedback
with it; another state object through its own ``state_dict``/``load_state_dict``.

A resume is exact at every world size: DDP reduces its first iteration in one bucket of the
parameters in definition order and then rebuilds its buckets in the order the gradients became
ready, so a wrapper built anew for a resume would sum the first step's gradients in other chunks
(gloo's ring all-reduce adds three or more ranks' values in an order set by a value's place in
the bucket). The checkpoint keeps the rebuilt buckets (``plugin_state_dict``), and the resumed
wrapper is built with them (``wrap_model``): nothing is added to the step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from trainer_core.plugins.base import wrapper_keywords
from trainer_core.plugins.ddp_comm_hooks import (
    BUCKET_LAYOUT_KEY,
    BUCKETS_KEY,
    COMM_STATE_KEY,
    KIND_KEY,
    PER_RANK_KEY,
    POWER_SGD_KIND,
    STATE_DICT_KIND,
    bucket_layout,
    check_comm_hook,
    comm_state_dict,
    hook_name,
    is_power_sgd,
    load_power_sgd,
    same_first_buckets,
)
from trainer_core.plugins.environments import ClusterEnvironment
from trainer_core.plugins.parallel import (
    DEFAULT_TIMEOUT,
    ParallelPlugin,
    UnrepeatedDistributedSampler,
    batch_norm_layers,
    is_random_sampler,
    warn_if_batch_norm,
    with_distributed_sampler,
)

if TYPE_CHECKING:
    from trainer_core.plugins.io import CheckpointIO

# The data-parallel helpers live with ParallelPlugin; they stay importable from here.
__all__ = [
    "DEFAULT_TIMEOUT",
    "DDPPlugin",
    "UnrepeatedDistributedSampler",
    "batch_norm_layers",
    "is_random_sampler",
    "warn_if_batch_norm",
    "with_distributed_sampler",
]

_logger = logging.getLogger("trainer_core")
# Off only to measure what pinning the buckets changes (benchmarks/resume_exact.py); always on otherwise.
_PIN_BUCKETS = True


class _StepRouter(nn.Module):
    """Lets DDP's ``forward`` run a named step of the LightningModule (``training_step``).

    ``reduction_order``: the parameters in the order DDP's reducer is to number them, or ``None``
    for DDP's own (definition) order. DDP numbers the parameters by walking each module's own
    (``recurse=False``) parameters, dropping those seen already; the router, the first module it
    walks, names them all here, in this order, until :meth:`forget_reduction_order` (after DDP is
    built): every other traversal sees the module's parameters with their own names.
    """

    def __init__(self, module: nn.Module, reduction_order: Optional[list[nn.Parameter]] = None) -> None:
        super().__init__()
        self.module = module
        self._reduction_order = reduction_order

    def forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, step)(*args, **kwargs)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        if recurse or not self._reduction_order:
            return super().named_parameters(prefix, recurse, remove_duplicate)
        return ((f"{prefix}_reduced_{index}", param) for index, param in enumerate(self._reduction_order))

    def forget_reduction_order(self) -> None:
        self._reduction_order = None


class DDPPlugin(ParallelPlugin):
    """``DistributedDataParallel`` over ``devices`` processes per node.

    Keyword arguments other than the plugin's own go to ``DistributedDataParallel``
    (``find_unused_parameters=True``, ``static_graph=True``, ``gradient_as_bucket_view=True``, ...);
    names it does not take are refused here, when the plugin is built.

    Communication hooks, with Lightning's arguments: ``ddp_comm_hook(state, bucket)`` returns a
    ``torch.futures.Future`` of the reduced bucket (torch's ``allreduce_hook``, ``powerSGD_hook``, or a
    function of the user's); ``ddp_comm_state`` is the ``state`` it is called with (a
    ``PowerSGDState``, or ``None``); ``ddp_comm_wrapper(hook)`` returns the hook actually registered
    (``fp16_compress_wrapper``). They are registered on the wrapper in :meth:`wrap_model`, on CPU
    (gloo) as on CUDA; the hook's ``bucket`` parameter is named so and, if annotated, annotated with
    the classes themselves (torch compares them; a module with ``from __future__ import annotations``
    leaves them unannotated), which the plugin checks when it is built.

    The state resumes from a full checkpoint (:meth:`plugin_state_dict`). A ``PowerSGDState``: at the
    same world size every rank's error feedback, the warm-start matrices, the generator and the
    iteration, exactly: the resumed wrapper reduces in the buckets the state was saved in (the
    checkpoint keeps DDP's rebuilt buckets). From a checkpoint without them (written before they were
    saved) whose buckets differ from DDP's first ones, the first step after the resume reduces
    uncompressed and the saved state takes over at the next (logged).
    At another world size only the iteration and the generator. Its hyper-parameters are the ones the
    state was built with in this run. On gloo, PowerSGD issues its second all-reduce from a callback,
    so with several buckets the ranks can interleave them differently and hang: keep one bucket
    there (a ``bucket_cap_mb`` above the gradients' size). A state object with ``state_dict()``/``load_state_dict()`` resumes
    through those (each rank its own at the same world size, rank 0's at another); any other state is
    not saved and starts afresh on resume.

    At world size 1 there is no wrapper: :attr:`model` is the module itself (code that registers
    hooks on the wrapper checks ``isinstance(plugin.model, DistributedDataParallel)``), and a hook
    given does not run, which is logged once.
    """

    name = "ddp"
    optimizer_in_backward_unsupported = (
        "a parameter's gradient hook fires before DistributedDataParallel has all-reduced that gradient, so each "
        "rank would step on its own local gradient and the replicas would drift apart. Use FSDPPlugin (its hook "
        "fires on the reduced, sharded gradient) or SingleDevicePlugin"
    )
    #: Why ``ddp_comm_hook`` cannot run under this plugin (its wrapper is no ``DistributedDataParallel``), or ``None``.
    ddp_comm_hook_unsupported: Optional[str] = None

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        ddp_comm_state: Optional[object] = None,
        ddp_comm_hook: Optional[Callable[..., Any]] = None,
        ddp_comm_wrapper: Optional[Callable[..., Any]] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        check_comm_hook(
            type(self).__name__,
            self.ddp_comm_hook_unsupported,
            ddp_comm_state,
            ddp_comm_hook,
            ddp_comm_wrapper,
        )
        self._ddp_comm_state = ddp_comm_state
        self._ddp_comm_hook = ddp_comm_hook
        self._ddp_comm_wrapper = ddp_comm_wrapper
        self._told_hook_idle = False
        self._rebuilt_buckets: Optional[list[list[int]]] = None
        # The rebuilt buckets of the checkpoint being restored, read before setup, used by the next wrapper.
        self._saved_layout: Optional[list[list[int]]] = None
        self._ddp_kwargs = ddp_kwargs

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        # The plugin gives DDP the module and its one device per process.
        return "DistributedDataParallel", wrapper_keywords(
            DistributedDataParallel.__init__, set_by_plugin=("module", "device_ids")
        )

    def _running_stats_note(self) -> str:
        """What becomes of BatchNorm's running statistics across ranks under this plugin."""
        # Newer torch names it forward_sync_buffers (which wins); broadcast_buffers=None means True.
        synced = self._ddp_kwargs.get("forward_sync_buffers")
        if synced is None:
            synced = self._ddp_kwargs.get("broadcast_buffers")
        if synced is not None and not synced:
            return (
                "with broadcast_buffers=False every rank keeps running statistics of its own samples, and the "
                "checkpoint holds rank 0's"
            )
        return (
            "the wrapper broadcasts rank 0's buffers at every training forward, so the running statistics "
            "(and so the checkpoint's) follow rank 0's samples only"
        )

    def wrap_model(self, module: nn.Module) -> nn.Module:
        """``DistributedDataParallel`` around the module, with the communication hook registered on it.

        At world size 1 the module itself: there is nothing to communicate, so :attr:`model` is no
        ``DistributedDataParallel`` (check before registering hooks on it) and a hook given does not run.
        """
        if self.world_size == 1:
            self._tell_hook_idle()
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        layout, self._saved_layout = self._saved_layout, None
        router = _StepRouter(module)
        order = self._reduction_order(router, layout)
        if order is not None:
            router = _StepRouter(module, order)
        model = DistributedDataParallel(router, device_ids=device_ids, **self._ddp_kwargs)
        router.forget_reduction_order()
        self._rebuilt_buckets = None
        if order is not None:
            self._pin_buckets(model, layout)
        hook = self._ddp_comm_hook
        if hook is not None:
            if self._ddp_comm_wrapper is not None:
                hook = self._ddp_comm_wrapper(hook)
            model.register_comm_hook(state=self._ddp_comm_state, hook=hook)
        return model

    def _rebuilds_buckets(self) -> bool:
        """Whether DDP rebuilds its buckets after the first iteration (not while it finds unused parameters)."""
        return not self._ddp_kwargs.get("find_unused_parameters") or bool(
            self._ddp_kwargs.get("static_graph")
        )

    def _reduction_order(
        self, router: _StepRouter, layout: Optional[list[list[int]]]
    ) -> Optional[list[nn.Parameter]]:
        """The parameters in the saved buckets' order, or ``None`` where there are none or they do not fit.

        They fit when they are exactly the parameters DDP reduces here (those that train and that
        ``_set_params_and_buffers_to_ignore_for_model`` leaves to it); else the wrapper starts in
        DDP's own buckets, as a checkpoint written before the layout was saved does.
        """
        if layout is None or not self._rebuilds_buckets() or not _PIN_BUCKETS:
            return None
        params = list(router.parameters())
        reduced = [i for i, p in enumerate(params) if p.requires_grad and not hasattr(p, "_ddp_ignored")]
        flat = [index for bucket in layout for index in bucket]
        if sorted(flat) != reduced:
            return None
        return [params[index] for index in flat]

    def _pin_buckets(self, model: DistributedDataParallel, layout: list[list[int]]) -> None:
        """Rebuild the new wrapper's buckets now, before its first iteration, as the saved run had them.

        DDP rebuilds once, from the parameters in the order they reach its reducer; pushed all at
        once they come in the reducer's own numbering, which :meth:`_reduction_order` made the
        saved order, and the same size limits cut them into the same buckets. Rebuilt once, DDP
        never rebuilds again (the run that went on did not either). These are the two reducer calls
        torch's own join hook (``_DDPJoinHook``) makes; they are collectives, made on every rank alike.
        """
        reducer = model.reducer
        reducer._push_all_rebuilt_params()
        if reducer._rebuild_buckets():
            model._has_rebuilt_buckets = True
        now = bucket_layout(model)
        if now == layout:
            self._rebuilt_buckets = now
        elif self.is_global_zero:
            _logger.warning(
                f"{type(self).__name__}: the resumed DistributedDataParallel could not take the gradient buckets "
                "saved in the checkpoint; its first step sums the ranks' gradients in another order, so from three "
                "ranks on it may differ from the run that went on in the last bits."
            )

    def load_checkpoint(self, filepath: str) -> dict[str, Any]:
        """The checkpoint, whose saved gradient buckets the next wrapper (built after this, in setup) takes."""
        checkpoint = super().load_checkpoint(filepath)
        plugin_state = checkpoint.get("plugin_state") if isinstance(checkpoint, dict) else None
        layout = plugin_state.get(BUCKET_LAYOUT_KEY) if isinstance(plugin_state, dict) else None
        self._saved_layout = layout if _is_layout(layout) else None
        return checkpoint

    def teardown(self) -> None:
        # The buckets are read while the wrapper exists: a checkpoint written after fit returns keeps them too.
        self._rebuilt_layout()
        super().teardown()

    def _tell_hook_idle(self) -> None:
        if self._ddp_comm_hook is None or self._told_hook_idle:
            return
        self._told_hook_idle = True
        wrapped = (
            f" wrapped by {hook_name(self._ddp_comm_wrapper)}" if self._ddp_comm_wrapper is not None else ""
        )
        _logger.info(
            f"{type(self).__name__}(ddp_comm_hook={hook_name(self._ddp_comm_hook)}){wrapped}: one process, so there is "
            "no DistributedDataParallel wrapper and no gradient communication: the communication hook does not run "
            "(plugin.model is the module itself)."
        )

    def plugin_state_dict(self) -> dict[str, Any]:
        """The rebuilt gradient buckets, and the communication hook's state of every rank, or ``{}``.

        The buckets once DDP has rebuilt them (after the first iteration), as :func:`bucket_layout`
        gives them. The hook's state is gathered here, on every rank: a ``PowerSGDState`` field by
        field (the process group left out; the numpy generator as a tensor and numbers, so the file
        loads with ``weights_only=True``), with the gradient buckets its per-bucket state belongs to;
        another state through its ``state_dict()``; a state without one is not saved.
        """
        saved: dict[str, Any] = {}
        layout = self._rebuilt_layout()
        if layout is not None:
            saved[BUCKET_LAYOUT_KEY] = layout
        own = comm_state_dict(self._ddp_comm_state) if self._ddp_comm_hook is not None else None
        if own is None:
            return saved
        kind, state = own
        comm = {KIND_KEY: kind, PER_RANK_KEY: self.all_gather_object(state)}
        if kind == POWER_SGD_KIND:
            comm[BUCKETS_KEY] = self._buckets_now()
        saved[COMM_STATE_KEY] = comm
        return saved

    def _rebuilt_layout(self) -> Optional[list[list[int]]]:
        """The wrapper's buckets once DDP has rebuilt them (read once: they stay so), else ``None``."""
        if self._rebuilt_buckets is None and getattr(self._model, "_has_rebuilt_buckets", False):
            self._rebuilt_buckets = bucket_layout(self._model)
        return self._rebuilt_buckets

    def _buckets_now(self) -> Optional[list[list[int]]]:
        """The wrapper's buckets (:func:`bucket_layout`): the rebuilt ones, or those of its first iteration."""
        return self._rebuilt_layout() or bucket_layout(self._model)

    def load_plugin_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's own hook state at the same world size; at another, what every rank shares."""
        saved = state.get(COMM_STATE_KEY)
        target = self._ddp_comm_state
        if saved is None or target is None or self._ddp_comm_hook is None:
            return
        if saved[KIND_KEY] == POWER_SGD_KIND and is_power_sgd(target):
            self._load_power_sgd(target, saved)
        elif saved[KIND_KEY] == STATE_DICT_KIND and callable(getattr(target, "load_state_dict", None)):
            per_rank = saved[PER_RANK_KEY]
            same_world = len(per_rank) == self.world_size
            target.load_state_dict(per_rank[self.global_rank] if same_world else per_rank[0])

    def _load_power_sgd(self, target: Any, saved: dict[str, Any]) -> None:
        """Put the saved PowerSGD state back; where it cannot continue exactly, the step that changes is logged."""
        per_rank = saved[PER_RANK_KEY]
        same_world = len(per_rank) == self.world_size
        load_power_sgd(
            target, per_rank[self.global_rank] if same_world else per_rank[0], self.root_device, same_world
        )
        notes = []
        if not same_world:
            notes.append(
                f"it was saved by {len(per_rank)} ranks and this run has {self.world_size}: the iteration and the "
                "generator are restored, the error feedback and the warm-start matrices restart from zero"
            )
        model = self._model
        if (
            isinstance(model, DistributedDataParallel)
            and target.iter >= target.start_powerSGD_iter
            and not same_first_buckets(saved.get(BUCKETS_KEY), model)
        ):
            # PowerSGD keeps its state by bucket; this new wrapper's first iteration reduces in other buckets
            # than those it was saved in (its initial ones, rebuilt after that iteration): it must not compress.
            target.iter = target.start_powerSGD_iter - 1
            notes.append(
                "DistributedDataParallel reduces its first iteration in other gradient buckets than the state was "
                "saved in (it rebuilds them after that iteration), so the first step after resuming reduces "
                "uncompressed and compression resumes at the next, with the saved error feedback"
            )
        if notes and self.is_global_zero:
            _logger.info(f"{type(self).__name__}: resuming PowerSGD: {'; '.join(notes)}.")

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model
        if isinstance(model, DistributedDataParallel):
            return model("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        model = self._model
        return model.no_sync() if isinstance(model, DistributedDataParallel) else None

    def backward(self, loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        model = self._model
        module = self._lightning_module
        if (
            isinstance(model, DistributedDataParallel)
            and module is not None
            and not module.automatic_optimization
        ):
            _prepare_for_backward(model, loss)
        return super().backward(loss, optimizer, *args, **kwargs)


def _is_layout(value: Any) -> bool:
    """Whether a checkpoint's value is a bucket layout: lists of parameter positions."""
    return isinstance(value, list) and all(
        isinstance(bucket, list) and all(isinstance(i, int) for i in bucket) for bucket in value
    )


def _prepare_for_backward(model: DistributedDataParallel, loss: Tensor) -> None:
    """Ready DDP's reducer for one more backward of the same forward (manual optimization).

    A manual ``training_step`` (a GAN's) runs one forward through DDP and several backwards; each
    backward needs the reducer prepared, with the loss telling it which parameters took part.
    """
    if not (torch.is_grad_enabled() and model.require_backward_grad_sync):
        model.require_forward_param_sync = False
        return
    from torch.nn.parallel.distributed import _find_tensors

    model.require_forward_param_sync = True
    used = list(_find_tensors(loss)) if model.find_unused_parameters and not model.static_graph else []
    model.reducer._rebuild_buckets()
    model.reducer.prepare_for_backward(used)
