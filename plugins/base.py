"""``TrainingTypePlugin``: the whole contract between the Trainer and a way of running.

The Trainer never calls ``torch.distributed``; it asks the plugin for ranks, collectives,
wrapping, backward, optimizer steps, optimizer state and checkpoint writing. A concrete plugin
overrides only what differs from this base; the rules every plugin shares live here once, above
all the consolidation rule of ``optimizer_state``.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import difflib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.errors import MisconfigurationException
from trainer_core.optim import LRSchedulerConfig, optimizer_defaults, parse_optimizers
from trainer_core.plugins.consolidate import check_optimizer_state_override
from trainer_core.plugins.grad_norm import clip_grads_by_total_norm, clip_grads_by_value
from trainer_core.precision import Precision
from trainer_core.utilities import move_data_to_device
from trainer_core.utilities.arguments import require_instance
from trainer_core.utilities.compiled_names import module_state_dict, plain_named_parameters, plain_state_dict

__all__ = ["TrainingTypePlugin", "optimizer_defaults"]

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.optimizer_in_backward import OptimizerInBackward
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.plugins.parallel_dims import ParallelDims
    from trainer_core.trainer import Trainer


class _RefusesUnknownArguments:
    """Refuses, where a plugin is built, every keyword argument its class would not read.

    Checked before any ``__init__`` runs, so a misspelt name fails with the plugin's own message (a
    close match, the valid names) instead of Python's ``TypeError`` or being passed down to a wrapper
    that never reads it. It sits under ``TrainingTypePlugin`` so that ``inspect.signature`` of every
    plugin class (``help()``, LightningCLI's YAML) reads that class's ``__init__``.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            _check_arguments(cls, kwargs)  # type: ignore[arg-type]
        return super().__new__(cls)


class TrainingTypePlugin(_RefusesUnknownArguments):
    """Base plugin: one process, no collectives; subclasses add processes and wrapping.

    Every plugin takes the keyword arguments of its ``__init__``; a ``**kwargs`` there is passed on to
    its base class's ``__init__``, and the names in ``_wrapper_arguments`` to the module wrapper the
    plugin builds (``DistributedDataParallel``). Any other name is refused when the plugin is built.
    """

    #: The registry name (``Trainer(plugins="...")``).
    name: str = "base"
    #: Why ``Trainer(optimizer_in_backward=True)`` cannot run under this plugin, or ``None`` when it can.
    optimizer_in_backward_unsupported: Optional[str] = None
    #: Why a whole LightningModule given as ``torch.compile(module)`` cannot run compiled under this plugin
    #: (its step methods are not what runs), or ``None``; compiled submodules run under every plugin.
    compiled_module_unsupported: Optional[str] = None
    #: Why a checkpoint written between two optimizer steps of gradient accumulation does not resume
    #: exactly under this plugin (the gradients accumulated so far are not saved), or ``None``.
    mid_accumulation_gradients_unsaved: Optional[str] = None
    #: Why this process cannot write a full checkpoint (one that resumes the run) right now, or ``None``.
    full_checkpoint_unavailable: Optional[str] = None
    #: Whether a checkpoint's weights load only once ``setup`` has wrapped the model (its shards exist):
    #: then the module's and callbacks' ``on_load_checkpoint`` run after ``configure_optimizers`` (Lightning's name).
    restore_checkpoint_after_setup: bool = False
    #: Whether each rank holds only part of the gradients (its shards, its stage, the partition it owns), so
    #: that an inf/NaN shows on some ranks only: then the loss scaler agrees over every rank (``grad_scaler``).
    holds_partial_gradients: bool = False

    def __init__(self, checkpoint_io: Optional[CheckpointIO] = None) -> None:
        check_optimizer_state_override(type(self), TrainingTypePlugin)
        if checkpoint_io is not None:
            _require_checkpoint_io(checkpoint_io, f"{type(self).__name__}(checkpoint_io=...)")
        self._checkpoint_io = checkpoint_io
        self._lightning_module: Optional[LightningModule] = None
        self._model: Optional[nn.Module] = None
        self.optimizers: list[Optimizer] = []
        self.lr_scheduler_configs: list[LRSchedulerConfig] = []
        #: Per-parameter optimizers stepped during backward (``Trainer(optimizer_in_backward=True)``).
        self.in_backward_optimizer: Optional[OptimizerInBackward] = None
        self.precision: Precision = Precision()
        #: The Trainer this plugin runs for: set by the Trainer before it launches the processes.
        self.trainer: Optional[Trainer] = None

    @property
    def precision_plugin(self) -> Precision:
        """Lightning's name for :attr:`precision` (``trainer.strategy.precision_plugin``)."""
        return self.precision

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        """The wrapper this plugin passes its extra keyword arguments to, and the names it takes; none here."""
        return "", []

    # ------------------------------------------------------------------ ranks and device
    @property
    def global_rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def node_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def root_device(self) -> torch.device:
        raise NotImplementedError(f"{type(self).__name__} must define `root_device`.")

    @property
    def parallel_dims(self) -> Optional[ParallelDims]:
        """How the ranks split into pipeline, data-parallel and tensor-parallel groups; ``None``: one process."""
        return None

    def layout(self) -> dict[str, int]:
        """The degrees of the layout, as checkpoints record them (``{"data_parallel": 2, ...}``)."""
        dims = self.parallel_dims
        if dims is None:
            return {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1}
        return {"pipeline_parallel": dims.pp, "data_parallel": dims.dp, "tensor_parallel": dims.tp}

    @property
    def metrics_group(self) -> Optional[Any]:
        """The process group ``self.log(..., sync_dist=True)`` reduces over; ``None``: every process.

        Plugins whose ranks share batches (tensor parallelism) name the group of ranks that see
        different data, so that a logged sum counts each sample once.
        """
        return None

    @property
    def distributed_sampler_kwargs(self) -> Optional[dict[str, Any]]:
        """``num_replicas``/``rank`` for a ``DistributedSampler``, or ``None`` when data is not split."""
        return None

    # ------------------------------------------------------------------ the model
    @property
    def lightning_module(self) -> Optional[LightningModule]:
        return self._lightning_module

    @property
    def model(self) -> Optional[nn.Module]:
        """The module the steps run through: the user's module, or the wrapper around it."""
        return self._model if self._model is not None else self._lightning_module

    @model.setter
    def model(self, model: nn.Module) -> None:
        self._model = model

    @property
    def model_parts(self) -> list[nn.Module]:
        """The model parts this rank holds; one for every plugin but pipeline parallelism."""
        return [self._lightning_module] if self._lightning_module is not None else []

    def connect(self, module: LightningModule) -> None:
        self._lightning_module = module
        self._model = None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            from trainer_core.plugins.io import TorchCheckpointIO

            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        _require_checkpoint_io(io, f"{type(self).__name__}.checkpoint_io = ...")
        self._checkpoint_io = io

    # ------------------------------------------------------------------ lifecycle
    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        """Told by the Trainer which devices it asked for; multi-process plugins size themselves here."""

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``function`` in every process of this plugin; the base runs it here, once."""
        return function(*args, **kwargs)

    def setup_environment(self) -> None:
        """Create the process group or select the device; called before the model is touched."""
        from trainer_core.utilities import rank_zero_only

        rank_zero_only.rank = self.global_rank

    def setup(self, trainer: Trainer) -> None:
        """Move and wrap the model, then create (and wrap) the optimizers."""
        self.trainer = trainer
        module = self._lightning_module
        assert module is not None
        self.precision.convert_module(module)
        self.model_to_device()
        if trainer.state_stage == "fit":
            self.setup_optimizers(trainer)
        self.model = self.wrap_model(module)

    def tensor_init_context(self, empty_init: Optional[bool] = None) -> contextlib.AbstractContextManager:
        """Where ``Trainer.init_module`` creates the module's tensors: on this process's device here.

        Sharding plugins create them on the meta device with ``empty_init=True`` and materialise
        each rank's shards in ``setup``.
        """
        return torch.device(self.root_device)

    def configuring_model(self) -> contextlib.AbstractContextManager:
        """Around the module's ``configure_model``: plugins check there what the module set up; a no-op here."""
        return contextlib.nullcontext()

    def wrap_model(self, module: nn.Module) -> nn.Module:
        """The module the steps run through; distributed plugins return their wrapper."""
        return module

    def model_to_device(self) -> None:
        assert self._lightning_module is not None
        self._lightning_module.to(self.root_device)

    def setup_optimizers(self, trainer: Trainer) -> None:
        returned = trainer.hook_runner.call_module("configure_optimizers")
        optimizers, configs = parse_optimizers(returned)
        if (
            not optimizers
            and self._lightning_module is not None
            and self._lightning_module.automatic_optimization
        ):
            raise MisconfigurationException(
                "configure_optimizers returned None: automatic optimization needs an optimizer. Return one, or set "
                "`self.automatic_optimization = False`."
            )
        self.optimizers = [self.wrap_optimizer(opt) for opt in optimizers]
        for config, original in ((c, c.scheduler.optimizer) for c in configs):
            wrapped = self.optimizers[[id(o) for o in optimizers].index(id(original))]
            if wrapped is not original:
                config.scheduler.optimizer = wrapped
        self.lr_scheduler_configs = configs

    def wrap_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer the run steps; sharded plugins wrap it here (OSS, ZeRO)."""
        return optimizer

    def setup_optimizer_in_backward(self) -> None:
        """Hook per-parameter copies of the optimizer onto the (wrapped, sharded) parameters."""
        from trainer_core.optimizer_in_backward import OptimizerInBackward

        self.in_backward_optimizer = OptimizerInBackward(self.optimizers[0])

    def on_exception(self, exception: BaseException) -> None:
        """The run failed with ``exception`` (called before ``teardown``)."""

    def teardown(self) -> None:
        """Release what ``setup`` created; the module is left on its device, unwrapped."""
        self._model = None
        if self.in_backward_optimizer is not None:
            self.in_backward_optimizer.remove()
            self.in_backward_optimizer = None
        if self._checkpoint_io is not None:
            self._checkpoint_io.teardown()

    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        """The loader this process iterates; data-parallel plugins give each rank its own part."""
        return dataloader

    # ------------------------------------------------------------------ steps
    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        """Skip gradient synchronisation while accumulating (DDP's ``no_sync``); a no-op where nothing syncs."""
        pause = self._gradient_sync_pause()
        return contextlib.nullcontext() if pause is None else pause

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        """The context in which the backward does not synchronise gradients, or ``None``: nothing to pause.

        Each plugin says how its wrapper pauses (DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync``,
        the pipeline's own flag); :meth:`no_backward_sync` is the one rule around it.
        """
        return None

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None) -> Any:
        return move_data_to_device(batch, device or self.root_device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._lightning_module is not None
        return self._lightning_module.training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._lightning_module is not None
        return self._lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._lightning_module is not None
        return self._lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._lightning_module is not None
        return self._lightning_module.predict_step(*args, **kwargs)

    def defines_step(self, name: str) -> bool:
        """Whether the step ``name`` (``"validation_step"``, ...) runs: the module's own, unless the plugin runs it."""
        from trainer_core.module import LightningModule
        from trainer_core.utilities.overrides import is_overridden

        return bool(is_overridden(name, self._lightning_module, LightningModule))

    def forward_backward(self) -> Optional[Callable[[Any, int], Tensor]]:
        """``None``: the loop calls ``training_step``, then ``backward``.

        A plugin whose schedule runs the forward and the backward of a batch together (pipeline
        parallelism interleaves them over micro-batches) returns ``(batch, batch_idx) -> loss``
        instead; the loss it returns is detached, for reporting. Asked once per epoch.
        """
        return None

    def backward(self, loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """``on_before_backward`` hooks, precision scaling, the module's ``backward``, ``on_after_backward``."""
        trainer = self.trainer
        assert trainer is not None and self._lightning_module is not None
        runner = trainer.hook_runner
        hooks = runner.batch
        if hooks.on_before_backward:
            runner.run("on_before_backward", hooks.on_before_backward, loss)
        precision, module = self.precision, self._lightning_module
        scaled = precision.pre_backward(loss, module)
        precision.backward(scaled, module, optimizer, *args, **kwargs)
        precision.post_backward(scaled, module)
        if hooks.on_after_backward:
            runner.run("on_after_backward", hooks.on_after_backward)
        return loss

    def optimizer_step(
        self, optimizer: Optimizer, closure: Optional[Callable[[], Any]] = None, **kwargs: Any
    ) -> Any:
        """Step ``optimizer``; the closure runs the forward and backward first.

        ``on_before_optimizer_step`` and gradient clipping run after the closure (when the
        gradients exist) and before the parameters change, as in Lightning.
        """
        trainer = self.trainer
        assert trainer is not None and self._lightning_module is not None
        return self.precision.optimizer_step(
            optimizer,
            closure,
            trainer.hook_runner.after_closure,
            skip_without_loss=self._lightning_module.automatic_optimization,
            **kwargs,
        )

    def grad_scaler(self) -> torch.amp.GradScaler:
        """The loss scaler of ``precision="16-mixed"``, made once the processes exist.

        Where every rank holds all of its gradients (and data parallelism has already averaged them),
        each rank finds the same inf/NaN, and torch's own ``GradScaler`` suffices. Where ranks hold
        parts (:attr:`holds_partial_gradients`), torch's ``ShardedGradScaler`` agrees over every rank
        whether any gradient is inf/NaN (one tiny all-reduce a step), so every rank skips the same steps.
        """
        if self.holds_partial_gradients and self.world_size > 1:
            return _sharded_grad_scaler(self.root_device.type)
        return torch.amp.GradScaler(self.root_device.type)

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> None:
        """Clip the gradients of ``optimizer``'s parameters, unscaled first under loss scaling.

        By norm: the norm of all the model's gradients together, as one process holding them all
        would compute it (``total_grad_norm``: shards summed over their mesh, the ranks of
        :meth:`_grad_norm_parts` joined); one process clips exactly as torch's ``clip_grad_norm_``.
        By value: every element of the shards this rank holds.
        """
        self.precision.unscale_gradients(optimizer)
        if algorithm == "norm":
            grads, others = self._grad_norm_parts(optimizer)
            clip_grads_by_total_norm(grads, clip_val, extra_group=others)
        else:
            clip_grads_by_value(_gradients(optimizer), clip_val)

    def _grad_norm_parts(self, optimizer: Optimizer) -> tuple[list[Tensor], Optional[Any]]:
        """The gradients this rank adds to the clipping norm, and the group of ranks that hold the rest.

        ``None``: this rank's gradients (``DTensor`` shards included, which carry their own mesh) are
        the whole model's. Plugins whose ranks hold disjoint parts (pipeline stages, OSS partitions)
        name the group that holds the others.
        """
        return _gradients(optimizer), None

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None) -> None:
        """Wait until every process reaches this point; a no-op on one process."""

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def reduce(
        self, tensor: Union[Tensor, float], reduce_op: str = "mean", group: Optional[Any] = None
    ) -> Union[Tensor, float]:
        """Reduce ``tensor`` over the processes of ``group`` (all of them by default)."""
        return tensor

    def all_gather(self, tensor: Tensor, sync_grads: bool = False, group: Optional[Any] = None) -> Tensor:
        """Stack ``tensor`` from every process of ``group`` (all by default) along a new first dimension."""
        return tensor.unsqueeze(0)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """``obj`` from every process, in rank order (pickled; for small non-tensor state)."""
        return [obj]

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Agree on ``decision`` across processes: every one must hold it (``all``) or any."""
        return decision

    # ------------------------------------------------------------------ state
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's full state, as rank 0 writes it; ``{}`` on other ranks for sharded optimizers.

        The consolidation rule for every plugin: an optimizer that shards its state (fairscale
        ``OSS``, torch ``ZeroRedundancyOptimizer``, or anything with ``consolidate_state_dict``)
        is consolidated on *all* ranks, because consolidation is a collective; then only global
        rank 0 reads ``state_dict()`` (on the others it would raise, since the full state was
        gathered to rank 0 alone) and the others return ``{}``. This holds whichever plugin runs,
        also when the user wraps the optimizer inside ``configure_optimizers`` under plain DDP.

        A subclass may add fields next to ``state`` and ``param_groups`` (to what rank 0 returns): they
        are written to the checkpoint as they are and come back, on every rank, in the ``state_dict``
        given to :meth:`load_optimizer_state_dict`, which the subclass overrides to read them.
        """
        consolidate = getattr(optimizer, "consolidate_state_dict", None)
        if callable(consolidate):
            if self.world_size > 1:
                from trainer_core.plugins.consolidate import gather_sharded_state

                # OSS and ZeRO: gathered tensor by tensor, at most one copy of the state on rank 0.
                gathered = gather_sharded_state(optimizer, self.root_device)
                if gathered is not None:
                    return gathered
            consolidate(to=0) if _accepts_to(consolidate) else consolidate()
            return optimizer.state_dict() if self.is_global_zero else {}
        return optimizer.state_dict()

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """``optimizer_state`` keyed by parameter name, the form checkpoints store.

        Names instead of indices make a checkpoint loadable by another plugin at another world
        size: the loading side maps each name to whatever parameter (or shard) it holds.
        """
        from trainer_core.checkpoint import optimizer_state_to_names, parameter_names

        assert self._lightning_module is not None
        return optimizer_state_to_names(
            self.optimizer_state(optimizer), optimizer, parameter_names(self._lightning_module)
        )

    def prepare_optimizer_state(self, optimizer: Optimizer, named_state: dict[str, Any], path: str) -> Any:
        """Check a name-keyed state against ``optimizer`` and turn it into what it loads; raises, changes nothing."""
        from trainer_core.checkpoint import optimizer_state_from_names, parameter_names

        assert self._lightning_module is not None
        return optimizer_state_from_names(
            named_state, optimizer, parameter_names(self._lightning_module), path
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's full state dict (parameters, buffers and extra state), keyed by name.

        Names are the plain ones: a compiled submodule's ``_orig_mod`` is left out (utilities/compile.py).
        """
        assert self._lightning_module is not None
        return plain_state_dict(self._lightning_module.state_dict())  # type: ignore[return-value]

    def load_model_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Load ``state_dict`` (plain names, or ``_orig_mod`` ones) into the module, compiled parts or not."""
        assert self._lightning_module is not None
        module = self._lightning_module
        module.load_state_dict(module_state_dict(module, state_dict), strict=strict)

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        """Load an index-keyed state; the optimizer keeps copies, never the tensors of the loaded file.

        The checkpoint may be a mapped file (``TorchCheckpointIO(mmap=True)``), whose pages the
        optimizer must not hold on to for the rest of the run (a file overwritten in place, or
        deleted by retention, would stay pinned). A sharded optimizer (OSS, ZeRO) also edits the dict
        it loads; it gets copies of its own partition's states only, so a rank never holds a copy of
        the whole optimizer state.
        """
        if state_dict:
            state_dict = _own_partition(optimizer, state_dict)
        optimizer.load_state_dict(state_dict)

    def plugin_state_dict(self) -> dict[str, Any]:
        """State of the plugin's own that a resumed run needs (a communication hook's); ``{}``: none.

        Called on every rank whenever a full checkpoint is written (not for ``weights_only``), so it
        may run collectives; global rank 0's result is stored under the checkpoint key
        ``"plugin_state"``, and an empty dict stores nothing. A plugin whose state differs per rank
        gathers it here (``all_gather_object``, on every rank) and returns every rank's entry.
        Values must load with ``torch.load(weights_only=True)``: tensors, numbers, strings, lists, dicts.
        """
        return {}

    def load_plugin_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what :meth:`plugin_state_dict` returned; by default there is nothing to take.

        Called on every rank after ``setup`` (the model is wrapped and the optimizers exist), where the
        optimizer states load, when the restored checkpoint holds ``"plugin_state"``. ``state`` is
        what global rank 0 returned; each rank picks its own entry from it (at another world size,
        the plugin decides what still applies).
        """

    #: Whether the last optimizer step took effect. A plugin whose steps can be voted down (a quorum of
    #: replica groups, ``"ddp_ft"``) sets it after each step and :attr:`votes_on_steps`; the loop then
    #: counts, and steps the schedulers for, committed steps only.
    step_committed = True
    votes_on_steps = False

    def checkpoint_from_peer(self) -> Optional[tuple[dict[str, Any], str]]:
        """A checkpoint to continue from that another live process sent, with where it came from, or ``None``.

        Called once by ``fit`` after any ``ckpt_path`` is restored and before the first batch; the loop
        restores what it returns as it restores a file (``"ddp_ft"``: a group that joins a running job
        receives a live group's state). The base has none.
        """
        return None

    def accumulated_gradients(self, module: nn.Module) -> dict[str, Tensor]:
        """This rank's gradients of an unfinished accumulation cycle, by plain parameter name (copies).

        Each rank's own under data parallelism, where they are synchronised only at the step; this
        rank's shard of a ``DTensor`` gradient. Called on every rank, so an override may run collectives.
        """
        return {
            name: _local_tensor(p.grad).detach().clone()
            for name, p in plain_named_parameters(module)
            if p.grad is not None
        }

    def put_back_accumulated_gradients(self, module: nn.Module, grads: dict[str, Tensor]) -> None:
        """Give ``module``'s parameters the gradients :meth:`accumulated_gradients` saved (on every rank)."""
        for name, param in plain_named_parameters(module):
            if name in grads:
                grad = grads[name].to(param.device)
                if hasattr(param, "device_mesh"):  # a DTensor shard: the gradient is this rank's shard
                    from torch.distributed.tensor import DTensor

                    grad = DTensor.from_local(
                        grad,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                param.grad = grad

    # ------------------------------------------------------------------ checkpoint files
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Optional[Any] = None
    ) -> None:
        """Write ``checkpoint``; a monolithic file is written by global rank 0 only."""
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, filepath: str) -> dict[str, Any]:
        return self.checkpoint_io.load_checkpoint(filepath)

    def remove_checkpoint(self, filepath: str) -> None:
        if self.is_global_zero:
            self.checkpoint_io.remove_checkpoint(filepath)


def _local_tensor(tensor: Tensor) -> Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _sharded_grad_scaler(device_type: str) -> torch.amp.GradScaler:
    """Torch's ``ShardedGradScaler``, on any device.

    fairscale's own (``fairscale.optim.grad_scaler``) does the same but is built on ``torch.cuda.amp``
    and turns itself off without CUDA.
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)


def _gradients(optimizer: Optimizer) -> list[Tensor]:
    """The gradients of ``optimizer``'s parameters that exist, in the order of its groups."""
    return [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def _require_checkpoint_io(io: Any, argument: str) -> None:
    from trainer_core.plugins.io import CheckpointIO

    require_instance(
        io, CheckpointIO, argument, "a CheckpointIO instance (TorchCheckpointIO() or your subclass)"
    )


def _check_arguments(cls: type[TrainingTypePlugin], given: dict[str, Any]) -> None:
    """Refuse the keyword arguments ``cls`` would not read, naming each, a close match, and the valid ones."""
    own = _keyword_arguments(cls)
    wrapper, forwarded = cls._wrapper_arguments()
    forwarded = [name for name in forwarded if name not in own]
    valid = own + forwarded
    unknown = [name for name in given if name not in valid]
    if not unknown:
        return

    def named(name: str) -> str:
        guess = difflib.get_close_matches(name, valid, n=1)
        return repr(name) + (f" (did you mean {guess[0]!r}?)" if guess else "")

    call = f"{cls.__name__}({', '.join(f'{name}={given[name]!r}' for name in unknown)})"
    what = f"unknown argument{'s' if len(unknown) > 1 else ''} {', '.join(named(name) for name in unknown)}"
    listed = f"Valid arguments: {', '.join(own)}"
    if forwarded:
        listed += f"; passed on to {wrapper}: {', '.join(forwarded)}"
    raise MisconfigurationException(f"{call}: {what}. {listed}.")


def _keyword_arguments(cls: type) -> list[str]:
    """The keyword arguments of ``cls.__init__`` and, through each ``**kwargs`` that passes them on, of its bases'."""
    names: dict[str, None] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        names.update(dict.fromkeys(p.name for p in params if p.name != "self" and p.kind in _NAMED))
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return list(names)


def wrapper_keywords(fn: Callable[..., Any], set_by_plugin: tuple[str, ...]) -> list[str]:
    """The keyword arguments of a wrapper's ``__init__`` that a user may set (the plugin sets ``set_by_plugin``)."""
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind in _NAMED and p.name != "self" and p.name not in set_by_plugin]


_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _accepts_to(fn: Callable[..., Any]) -> bool:
    try:
        return "to" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _own_partition(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with the per-parameter states this rank's ``optimizer`` keeps, none from a mapped file.

    fairscale ``OSS`` and torch ``ZeroRedundancyOptimizer`` map each parameter to the rank that owns
    its state (``_param_to_rank``); the states of other ranks' parameters become empty here, as both
    would make them anyway, so only the rank's own partition is copied. Every other optimizer keeps
    every state. The dicts are new (sharded optimizers edit the dict they load); tensors are copied
    when they live in a file mapping, else passed as they are (``load_state_dict`` copies what it
    must cast or move).
    """
    mapped = _file_mapped_ranges()
    sharded = hasattr(optimizer, "consolidate_state_dict")
    owner = getattr(optimizer, "_param_to_rank", None) if sharded else None
    rank = getattr(optimizer, "rank", None)
    if sharded and not (isinstance(owner, dict) and isinstance(rank, int)):
        return copy.deepcopy(state_dict)  # a sharded optimizer whose partition is unknown here
    mine = None
    if owner is not None:
        # Indices number the parameters in the order of the optimizer's groups (torch's and OSS's convention).
        params = [p for group in optimizer.param_groups for p in group["params"]]
        ordered = [index for group in state_dict["param_groups"] for index in group["params"]]
        mine = {index for index, param in zip(ordered, params) if owner.get(param) == rank}
    state = {
        index: _unmapped(value, mapped) if mine is None or index in mine else {}
        for index, value in state_dict["state"].items()
    }
    rest = {key: value for key, value in state_dict.items() if key != "state"}
    return {**copy.deepcopy(rest), "state": state}


def _unmapped(value: Any, mapped: Optional[list[tuple[int, int]]]) -> Any:
    """``value`` with new containers, and a private copy of each tensor that lives in a file mapping."""
    if isinstance(value, Tensor):
        if mapped is None:
            return value.clone()
        address = value.untyped_storage().data_ptr()
        at = bisect.bisect_right(mapped, (address, float("inf"))) - 1
        return value.clone() if at >= 0 and address < mapped[at][1] else value
    if isinstance(value, dict):
        return {key: _unmapped(item, mapped) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_unmapped(item, mapped) for item in value)
    return copy.deepcopy(value)


def _file_mapped_ranges() -> Optional[list[tuple[int, int]]]:
    """Address ranges of this process mapped from files (``/proc/self/maps``); ``None`` where unknown.

    A tensor of a checkpoint read with ``torch.load(mmap=True)`` lies in one of them.
    """
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):  # inode, path: a file
            start, end = fields[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return sorted(ranges)
