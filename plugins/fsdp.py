"""``FSDPPlugin``: fully sharded data parallelism with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Parameters, gradients and optimizer state are sharded across ranks (``DTensor`` shards);
each wrapped block gathers its parameters for its forward and backward only. FSDP2 runs on CPU
with gloo, so everything here is tested without an accelerator. The checkpoint keeps the same
name-keyed format as every other plugin: ``"full"`` gathers model and optimizer state to rank 0
(``torch.distributed.checkpoint.state_dict``); ``"sharded"`` lets every rank write its own
shards through ``DistributedCheckpointIO``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from lightning_utilities.core.overrides import is_overridden
from torch import nn
from torch.optim import Optimizer

from trainer_core.checkpoint.format import KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.module import LightningModule
from trainer_core.plugins.parallel import DEFAULT_TIMEOUT, ParallelPlugin
from trainer_core.plugins.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainer_core.plugins.environments import ClusterEnvironment
    from trainer_core.plugins.fsdp_gather import StreamedGather
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
    from trainer_core.trainer import Trainer

_STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
STATE_DICT_TYPES = ("full", "sharded")


class FSDPPlugin(ParallelPlugin):
    """Shard the model with ``fully_shard``: per block of ``auto_wrap_policy`` classes, then the root.

    ``hybrid_shard=(replicas, shards)`` builds a 2-D mesh (HSDP): parameters are sharded within a
    group of ``shards`` ranks and replicated across ``replicas`` groups. A module may instead call
    ``fully_shard`` itself in ``configure_model`` (with ``self.trainer.strategy.device_mesh``);
    the plugin then shards only the root. The process arguments (``start_method``, ``timeout``,
    ``checkpoint_io``, ...) are ``ParallelPlugin``'s; nothing is passed to a wrapper.
    """

    name = "fsdp"
    # FSDP2 runs post-accumulate-grad hooks on the sharded gradient after its reduce-scatter.
    optimizer_in_backward_unsupported = None
    # A sharded folder loads into the shards, which exist once fully_shard has run (and a meta-device model is materialised).
    restore_checkpoint_after_setup = True
    # Each rank holds the gradient shards of its parameter shards: an inf shows on one rank only.
    holds_partial_gradients = True

    def __init__(
        self,
        auto_wrap_policy: Optional[Union[set[type[nn.Module]], list[type[nn.Module]]]] = None,
        mixed_precision: Optional[MixedPrecisionPolicy] = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        state_dict_type: str = "full",
        hybrid_shard: Optional[tuple[int, int]] = None,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
    ) -> None:
        super().__init__(start_method, process_group_backend, timeout, cluster_environment, checkpoint_io)
        if state_dict_type not in STATE_DICT_TYPES:
            raise MisconfigurationException(
                f"FSDPPlugin(state_dict_type={state_dict_type!r}): use 'full' (one file, written by rank 0) or "
                "'sharded' (a folder, every rank writes its shard)."
            )
        self.auto_wrap_policy = set(auto_wrap_policy or ())
        self.mixed_precision = mixed_precision
        self.reshard_after_forward = reshard_after_forward
        self.cpu_offload = cpu_offload
        self.state_dict_type = state_dict_type
        self.hybrid_shard = hybrid_shard
        self._dims: Optional[ParallelDims] = None
        self._streamed_save: Optional[StreamedGather] = None  # a full save's gather, open until it is written
        if state_dict_type == "sharded" and self._checkpoint_io is None:
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

            self._checkpoint_io = DistributedCheckpointIO()

    # ------------------------------------------------------------------ mesh and sharding
    @property
    def parallel_dims(self) -> ParallelDims:
        """The layout: ``world_size`` shards, or ``hybrid_shard=(replicas, shards)``."""
        if self._dims is None or self._dims.world_size != self.world_size:
            if self.hybrid_shard is not None:
                replicas, shards = self.hybrid_shard
                if replicas * shards != self.world_size:
                    raise MisconfigurationException(
                        f"FSDPPlugin(hybrid_shard={self.hybrid_shard}) needs {replicas * shards} processes, but the "
                        f"run has {self.world_size}; make replicas x shards equal devices x num_nodes."
                    )
                self._dims = ParallelDims(
                    self.world_size, dp_replicate=replicas, dp_shard=shards, owner="FSDPPlugin"
                )
            else:
                self._dims = ParallelDims(self.world_size, owner="FSDPPlugin")
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` shards over: 1-D ``("data_parallel",)``, or 2-D under hybrid sharding.

        Under hybrid sharding its dimensions are ``("data_parallel_replicate", "data_parallel_shard")``.
        """
        dims = self.parallel_dims
        dims.build_mesh(self.root_device.type)
        return dims.sharding_mesh()

    def teardown(self) -> None:
        super().teardown()
        if self._lightning_module is not None:
            self._lightning_module._device_mesh = None

    def _sharding_mesh(self) -> DeviceMesh:
        return self.device_mesh

    def setup_environment(self) -> None:
        super().setup_environment()
        # Built by every rank together (a collective), before the module's configure_model may use it.
        if self._lightning_module is not None:
            self._lightning_module._device_mesh = self.device_mesh

    def setup(self, trainer: Trainer) -> None:
        # FSDP2 turns parameters into DTensor shards, so the optimizers are built after sharding.
        self.trainer = trainer
        module = self._lightning_module
        assert module is not None
        if trainer.state_stage == "fit":
            self.check_module_for_data_parallel()
        self.precision.convert_module(module)
        if has_meta_tensors(module):
            # Built on the meta device (Trainer.init_module(empty_init=True)): shard first, then give
            # each rank memory for its own shards only, initialised by the layers' reset_parameters.
            self._shard(module)
            materialize_module(module, self.root_device)
        else:
            self.model_to_device()
            self._shard(module)
        if trainer.state_stage == "fit":
            self.setup_optimizers(trainer)
        self.model = module

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """``empty_init=True``: layers are created on the meta device, without memory, and materialised
        shard by shard after sharding."""
        return torch.device("meta") if empty_init else contextlib.nullcontext()

    def _shard_kwargs(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

        return {
            "mesh": self._sharding_mesh(),
            "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": self.mixed_precision or MixedPrecisionPolicy(),
            # Pinned host memory needs an accelerator; on a CPU-only machine offload keeps plain memory.
            "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
            if self.cpu_offload
            else OffloadPolicy(),
        }

    def _shard(self, module: nn.Module) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

        kwargs = self._shard_kwargs()
        already = any(isinstance(m, FSDPModule) for m in module.modules())
        if not already:
            for sub in list(module.modules()):
                if sub is not module and type(sub) in self.auto_wrap_policy:
                    fully_shard(sub, **kwargs)
        if not isinstance(module, FSDPModule):
            fully_shard(module, **kwargs)
        # The steps are not `forward`: register them so FSDP gathers the root's parameters for them.
        for name in _STEP_METHODS:
            if is_overridden(name, module, LightningModule):
                register_fsdp_forward_method(module, name)

    def _running_stats_note(self) -> str:
        return (
            "FSDP does not synchronise buffers, so every rank keeps running statistics of its own samples, and "
            "the checkpoint holds rank 0's"
        )

    @contextlib.contextmanager
    def _skip_gradient_sync(self) -> Iterator[None]:
        module = self._lightning_module
        module.set_requires_gradient_sync(False)  # type: ignore[union-attr]
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)  # type: ignore[union-attr]

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        return None if self.world_size == 1 else self._skip_gradient_sync()

    # ------------------------------------------------------------------ accumulation
    @property
    def mid_accumulation_gradients_unsaved(self) -> Optional[str]:  # type: ignore[override]
        """Why the gradients of an unfinished accumulation cycle cannot be saved: a ``reduce_dtype`` of its own."""
        policy = self.mixed_precision
        if policy is None or policy.reduce_dtype is None or policy.reduce_dtype == policy.param_dtype:
            return None
        return (
            f"with MixedPrecisionPolicy(reduce_dtype={policy.reduce_dtype}) FSDP adds the cycle's gradients up in "
            "a buffer of its own, which no public torch API reads or writes"
        )

    def accumulated_gradients(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """This rank's gradients of the unfinished cycle: whole tensors, this rank's own sum, by name.

        While gradient synchronisation is off, each FSDP module leaves a backward's gradients on its
        unsharded parameters, which it keeps out of the module between forwards, and reduce-scatters
        them at the cycle's last backward. ``FSDPModule.unshard()`` puts those parameters back on the
        module for a moment (an all-gather of the weights: a collective, made on every rank), so they
        are read as any module's; as large as DDP's, which saves every rank's gradients too. One
        process reduces at every backward (nothing to pause): its gradients are the shards' own.
        """
        if self.world_size == 1:
            return super().accumulated_gradients(module)
        with _unsharded(module):
            return super().accumulated_gradients(module)

    def put_back_accumulated_gradients(self, module: nn.Module, grads: dict[str, torch.Tensor]) -> None:
        """The saved cycle's gradients on the unsharded parameters, where the next backward adds to them."""
        if self.world_size == 1:
            super().put_back_accumulated_gradients(module, grads)
            return
        with _unsharded(module):
            super().put_back_accumulated_gradients(module, grads)

    # ------------------------------------------------------------------ state
    def _options(self, full: bool) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        if full:
            return StateDictOptions(full_state_dict=True, cpu_offload=True)
        return StateDictOptions(full_state_dict=False)

    @property
    def _full(self) -> bool:
        return self.state_dict_type == "full"

    @property
    def _writes_sharded_checkpoints(self) -> bool:
        return not self._full

    def _full_state(self, state_dict: Callable[[Any], dict[str, Any]]) -> dict[str, Any]:
        """The full state on rank 0 (``{}`` elsewhere) of ``state_dict(options)``, torch's getter of a state.

        torch's full state dict gathers one tensor at a time to every rank; this takes torch's sharded
        state dict (same keys, same order) and gathers its shards to rank 0 in buckets of bounded size
        (``fsdp_gather``), with the same result bit for bit. torch's own path remains for states the
        buckets do not know, and when ``fsdp_gather.GATHER_BUCKET_BYTES`` is ``None``. Inside a
        streamed save (:meth:`start_streamed_save`) the bucketed tensors stay lazy until written.
        """
        from trainer_core.plugins import fsdp_gather

        if fsdp_gather.GATHER_BUCKET_BYTES is not None:
            sharded = state_dict(self._options(full=False))
            if fsdp_gather.can_gather(sharded):
                if self._streamed_save is not None:
                    return self._streamed_save.add(sharded)
                return fsdp_gather.gather_full_state_dict(sharded)
        return state_dict(self._options(full=True))

    def start_streamed_save(self) -> None:
        """Gather the full state of the checkpoint being built while rank 0 writes it (``dump_checkpoint``
        calls this as it starts, when no hook reads the dict).

        Until :meth:`save_checkpoint`, the model's and optimizers' bucketed tensors are lazy on rank 0
        (``fsdp_gather.StreamedGather``) and are gathered record by record as the file is written, so
        the write overlaps the gather and rank 0 holds about a bucket, not the whole state. Only for
        ``TorchCheckpointIO`` itself (local disk and object stores), which writes them with the same
        bytes; other IOs (async, frozen weights), sharded checkpoints and torch's gather keep the full dict.
        """
        from trainer_core.plugins import fsdp_gather
        from trainer_core.plugins.io.torch_io import TorchCheckpointIO

        self._streamed_save = None  # one a failed save left
        if (
            self._full
            and self.world_size > 1
            and fsdp_gather.GATHER_BUCKET_BYTES is not None
            and fsdp_gather.STREAM_FULL_SAVES
            and type(self.checkpoint_io) is TorchCheckpointIO
        ):
            self._streamed_save = fsdp_gather.StreamedGather()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint``; a streamed save's buckets are gathered while rank 0 writes (a collective then)."""
        streamed, self._streamed_save = self._streamed_save, None
        if streamed is None:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            # The other ranks send every bucket here; rank 0 receives what its write left (all of it
            # when the write failed), so the collectives match whatever happened to the file.
            streamed.finish()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        module = self._lightning_module
        if self._full:
            return self._full_state(lambda options: get_model_state_dict(module, options=options))
        return get_model_state_dict(module, options=self._options(full=False))

    def load_model_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from_rank0 = _from_rank0(state_dict)
        options = StateDictOptions(
            full_state_dict=_is_full(state_dict), broadcast_from_rank0=from_rank0, strict=strict
        )
        # torch puts this rank's shards of a full state into the dict it is given: a copy of the dict,
        # so that the checkpoint (kept until the optimizers load) does not hold them as well. Broadcast
        # from rank 0, the other ranks give torch nothing: it maps names (``_orig_mod``) on rank 0 only.
        given = {} if from_rank0 and self.global_rank != 0 else dict(state_dict)
        set_model_state_dict(self._lightning_module, given, options=options)

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Keyed by parameter name already (torch's fully-qualified names of the module)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        module = self._lightning_module
        with _no_state_initialisation(optimizer):
            if self._full:
                return self._full_state(
                    lambda options: get_optimizer_state_dict(module, optimizer, options=options)
                )
            return get_optimizer_state_dict(module, optimizer, options=self._options(full=False))

    def prepare_optimizer_state(self, optimizer: Optimizer, named_state: dict[str, Any], path: str) -> Any:
        from trainer_core.checkpoint import check_named_state_covers

        assert self._lightning_module is not None
        check_named_state_covers(named_state, self._lightning_module, type(optimizer).__name__, path)
        return named_state

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        from_rank0 = _from_rank0(state_dict)
        options = StateDictOptions(full_state_dict=_is_full(state_dict), broadcast_from_rank0=from_rank0)
        given = {} if from_rank0 and self.global_rank != 0 else state_dict
        set_optimizer_state_dict(self._lightning_module, optimizer, given, options=options)

    def _sharded_state_template(self, io: DistributedCheckpointIO, filepath: str) -> dict[str, Any]:
        """This rank's model shards and optimizer states: DCP reshards the folder's into them."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        options = self._options(full=False)
        template: dict[str, Any] = {
            KEY_STATE_DICT: get_model_state_dict(self._lightning_module, options=options)
        }
        if self.optimizers:
            stored = io.stored_keys(filepath)
            states = []
            for index, opt in enumerate(self.optimizers):
                # torch's helper creates the state tensors for DCP to fill; an optimizer saved before
                # its first step has none to fill, and must not be stepped to make them.
                saved_state = any(key.startswith(f"{KEY_OPTIMIZER_STATES}.{index}.state.") for key in stored)
                with contextlib.nullcontext() if saved_state else _no_state_initialisation(opt):
                    states.append(get_optimizer_state_dict(self._lightning_module, opt, options=options))
            template[KEY_OPTIMIZER_STATES] = states
        return template


@contextlib.contextmanager
def _unsharded(module: nn.Module) -> Iterator[None]:
    """Every FSDP module of ``module`` with its unsharded parameters registered (and their gradients)."""
    from torch.distributed.fsdp import FSDPModule

    parts = [sub for sub in module.modules() if isinstance(sub, FSDPModule)]
    for part in parts:
        part.unshard()
    try:
        yield
    finally:
        for part in parts:
            part.reshard()


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize_module(module: nn.Module, device: torch.device) -> None:
    """Give a module built on the meta device memory on ``device`` and initialise it.

    Each submodule that holds parameters or buffers of its own is re-initialised with its
    ``reset_parameters``; one without that method cannot be, and is named in a warning (its tensors
    hold whatever the memory held: load a checkpoint, or give it ``reset_parameters``).
    """
    from trainer_core.utilities import rank_zero_warn

    module.to_empty(device=device)
    uninitialised = []
    for name, sub in module.named_modules():
        own = [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]
        if not own:
            continue
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialised.append(name or type(sub).__name__)
    if uninitialised:
        rank_zero_warn(
            f"{type(module).__name__} was built on the meta device and these layers have no reset_parameters, so "
            f"their tensors are uninitialised: {', '.join(uninitialised[:5])}"
            f"{f' and {len(uninitialised) - 5} more' if len(uninitialised) > 5 else ''}. Give them "
            "reset_parameters, or load their weights (ckpt_path=...).",
            category=UserWarning,
        )


def _is_full(state: dict[str, Any]) -> bool:
    """Whether a loaded state holds plain tensors (a full checkpoint) rather than DTensor shards."""
    from torch.distributed.tensor import DTensor

    for value in _tensors(state):
        return not isinstance(value, DTensor)
    # No tensors at all (the state of SGD without momentum): torch's full-state path needs a tensor
    # to find the device, while the sharded path loads the parameter groups alone.
    return False


def _from_rank0(state: dict[str, Any]) -> bool:
    """Whether a state is loaded from rank 0's full tensors: only plain tensors, at least one.

    Rank 0 sends each full tensor in turn and every rank copies its own slice into the shard it
    already holds, so a rank adds one tensor in flight, not a copy of its shards (torch's default
    for a full state builds new shards from every rank's own full tensors, then replaces the old).
    Every rank has the same file mapped, so only rank 0's pages of it are ever read.
    """
    from torch.distributed.tensor import DTensor

    found = False
    for value in _tensors(state):
        if isinstance(value, DTensor):
            return False
        found = True
    return found


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


@contextlib.contextmanager
def _no_state_initialisation(optimizer: Optimizer) -> Iterator[None]:
    """Keep torch's ``get_optimizer_state_dict`` from stepping an optimizer that has not stepped yet.

    Given an optimizer without state and without gradients, it initialises the state by stepping
    with zero gradients (Adam's step count becomes 1) and then drops every gradient, so a
    checkpoint written before the first step (between two batches that accumulate, say) would
    change the run. With one gradient in sight it leaves the optimizer as it is.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if optimizer.state or not params or any(p.grad is not None for p in params):
        yield
        return
    params[0].grad = torch.zeros_like(params[0])
    try:
        yield
    finally:
        params[0].grad = None
