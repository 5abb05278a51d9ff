"""``PipelinePlugin``: pipeline parallelism on ``torch.distributed.pipelining``, optionally times data parallelism.

The module is cut before named submodules (``split_points``) into stages; ``forward(input)`` is
what is split, and ``loss_fn(output, target)`` turns the last stage's output into the loss. A rank
holds one stage (``"GPipe"``, ``"1F1B"``) or several (``"Interleaved1F1B"``: with 2 ranks and 4
stages, rank 0 holds stages 0 and 2).

**Traced split (the default).** ``torch.distributed.pipelining.pipeline`` traces ``forward`` (with
``torch.export``, on one micro-batch of the first training batch, or on the module's
``example_input_array``) and cuts the graph at the split points, so everything ``forward`` computes
between submodules (functional activations, residual additions, a layer called twice) runs once,
on the stage it belongs to, and a stage runs only its own piece. Values a later stage needs (a skip
connection over a stage, the input itself) are passed on by the stages in between. It is traced
twice, in training and in evaluation mode, so dropout and batch norm behave as on one device. The
traced stages use the module's own parameter objects, under their original fully-qualified names.
A ``forward`` the tracer cannot capture (data-dependent control flow such as ``if x.sum() > 0``)
is refused before anything runs, as is a parameter used by two stages (each would train a copy).

**Manual split** (``pipeline_manual_split = True`` on the module's class, torchtitan's model-parts
style): the module declares that its ``forward`` runs its submodules as a chain, in registration
order, or skips the layers a stage lacks. A stage is then the module with every layer it does not
hold replaced by ``nn.Identity``, and it runs the whole ``forward``; nothing is traced.

Either way the user's module keeps its whole name space, with the tensors a rank does not hold
moved to the meta device (no memory), so checkpoints use the original fully-qualified names
(``layers.3.weight``) whichever rank holds them: a checkpoint written at one pipeline degree loads
at another, or under any other plugin.

Ranks are laid out as a ``(pp, dp, tp)`` mesh (``ParallelDims``): global rank = ``(pp_rank * dp +
dp_rank) * tp + tp_rank``. Replicas of a stage average their gradients after the schedule's backward,
before the optimizers step. ``PipelinePlugin`` itself has ``tp = 1``; ``ModelParallelPlugin`` with
``pipeline_parallel_size > 1`` (``PipelineModelParallelPlugin`` below) makes every stage
tensor-parallel inside, with the module's own plan from ``configure_model``.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
import inspect
import re
import traceback
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.fx
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.checkpoint.format import KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.containers import LRSchedulersContainer, OptimizersContainer
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.optim import parse_optimizers
from trainer_core.plugins.parallel import (
    DEFAULT_TIMEOUT,
    ParallelPlugin,
    clip_grads_by_total_norm,
    is_random_sampler,
    with_distributed_sampler,
)
from trainer_core.plugins.parallel_dims import DATA, PIPELINE, ParallelDims

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
#: The class attribute with which a module declares that its forward is a chain of its submodules
#: (or skips the layers a stage lacks), so that stages are built by hand instead of by the tracer.
MANUAL_SPLIT_ATTRIBUTE = "pipeline_manual_split"
_MULTI_STAGE_SCHEDULES = ("Interleaved1F1B",)
_MAX_LISTED = 30


class PipelinePlugin(ParallelPlugin):
    """Split the module at ``split_points`` and run it as a pipeline of ``world_size / data_parallel_size`` ranks.

    The stages come from tracing ``forward`` (see the module docstring); a module whose class sets
    ``pipeline_manual_split = True`` is split by hand instead.

    Args:
        split_points: fully-qualified names of submodules (``"layers.2"``); each begins a new stage.
        schedule: ``"GPipe"``, ``"1F1B"`` (one stage per rank) or ``"Interleaved1F1B"`` (several).
        n_microbatches: micro-batches each batch is cut into (default: the number of stages).
        data_parallel_size: replicas of the whole pipeline; their gradients are averaged.
        kwargs: ``ParallelPlugin``'s own (``start_method``, ``timeout``, ``checkpoint_io``, ...); nothing is
            passed to a wrapper.
    """

    name = "pipeline"
    compiled_module_unsupported = (
        "the stages run the split module's parts, not the compiled training_step, so the compilation would be "
        "lost. Compile the parts instead (`torch.compile` of a submodule in `configure_model`), or pass the "
        "module uncompiled"
    )
    # Each rank loads the weights of the stages it holds, which exist once setup has split the model.
    restore_checkpoint_after_setup = True
    optimizer_in_backward_unsupported = (
        "the pipeline schedule runs each stage's backward once per micro-batch, so a parameter's gradient hook "
        "fires before its gradient is complete (and before data-parallel replicas average it). Use FSDPPlugin or "
        "SingleDevicePlugin"
    )

    def __init__(
        self,
        split_points: Sequence[str] = (),
        schedule: str = "1F1B",
        n_microbatches: Optional[int] = None,
        data_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(split_points, str):
            split_points = [split_points]
        if schedule not in SCHEDULES:
            raise MisconfigurationException(
                f"PipelinePlugin(schedule={schedule!r}): use one of {', '.join(repr(s) for s in SCHEDULES)}."
            )
        if n_microbatches is not None and (not isinstance(n_microbatches, int) or n_microbatches < 1):
            raise MisconfigurationException(
                f"PipelinePlugin(n_microbatches={n_microbatches!r}): use a positive integer."
            )
        if not isinstance(data_parallel_size, int) or data_parallel_size < 1:
            raise MisconfigurationException(
                f"PipelinePlugin(data_parallel_size={data_parallel_size!r}): use a positive integer."
            )
        self.split_points = list(split_points)
        self.schedule_name = schedule
        self.n_microbatches = n_microbatches
        self.data_parallel_size = data_parallel_size
        self._stage_ids: list[int] = []
        self._num_stages = len(self.split_points) + 1
        self._parts: list[nn.Module] = []
        self._stages: list[PipelineStage] = []
        self._schedule: Any = None
        self._held_prefixes: list[str] = []
        self._traced: Optional[_TracedSplit] = None
        self._tp = 1
        self._dims: Optional[ParallelDims] = None
        self._pp_group: Any = None
        self._dp_group: Any = None
        self._sync_grads = True
        self._loss_scale = 1.0
        #: The loss scaler's scale during a training step under precision="16-mixed", else ``None``.
        self._amp_scale: Optional[Tensor] = None
        self._accumulate = 1
        self._batch_sizes: dict[bool, int] = {}

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        # The stages run in torch's pipeline schedule, not inside DistributedDataParallel.
        return "", []

    # ------------------------------------------------------------------ layout
    @property
    def pp_degree(self) -> int:
        return self.world_size // (self.data_parallel_size * self._tp)

    @property
    def pp_rank(self) -> int:
        return self.global_rank // (self.data_parallel_size * self._tp)

    @property
    def dp_rank(self) -> int:
        return (self.global_rank // self._tp) % self.data_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.global_rank % self._tp

    @property
    def parallel_dims(self) -> ParallelDims:
        """The layout: ``pp_degree`` stages x ``data_parallel_size`` replicas x tensor-parallel ranks."""
        if self._dims is None or self._dims.world_size != self.world_size:
            self._check_layout()
            self._dims = ParallelDims(
                self.world_size,
                tp=self._tp,
                pp=self.pp_degree,
                dp_shard=self.data_parallel_size,
                owner=type(self).__name__,
            )
        return self._dims

    @property
    def device_mesh(self) -> Any:
        """The mesh ``("pipeline_parallel", "data_parallel", "tensor_parallel")`` (a collective when first built)."""
        return self.parallel_dims.build_mesh(self.root_device.type)

    @property
    def num_stages(self) -> int:
        return self._num_stages

    @property
    def stage_ids(self) -> list[int]:
        """The stages this rank holds, in pipeline order."""
        return list(self._stage_ids)

    @property
    def has_first_stage(self) -> bool:
        return 0 in self._stage_ids

    @property
    def has_last_stage(self) -> bool:
        return self._num_stages - 1 in self._stage_ids

    @property
    def model_parts(self) -> list[nn.Module]:
        """One module per stage this rank holds, with only that stage's parameters, under their original names."""
        return list(self._parts)

    def _check_layout(self) -> None:
        world, dp = self.world_size, self.data_parallel_size
        if world % (dp * self._tp):
            raise MisconfigurationException(
                f"{type(self).__name__}(data_parallel_size={dp}"
                + (f", tensor_parallel_size={self._tp}" if self._tp > 1 else "")
                + f") does not divide the {world} processes of the run; make devices x num_nodes a multiple of "
                f"{dp * self._tp}."
            )
        pp, stages = world // (dp * self._tp), self._num_stages
        if self.schedule_name in _MULTI_STAGE_SCHEDULES:
            if stages % pp:
                raise MisconfigurationException(
                    f"PipelinePlugin(schedule={self.schedule_name!r}) spreads the {stages} stages of "
                    f"split_points={self.split_points} over {pp} pipeline ranks, which needs the number of stages "
                    "to be a multiple of the pipeline degree; add or remove split points."
                )
        elif stages != pp:
            raise MisconfigurationException(
                f"PipelinePlugin(schedule={self.schedule_name!r}) puts one stage on each pipeline rank, but "
                f"split_points={self.split_points} make {stages} stages for {pp} pipeline ranks "
                f"({world} processes / data_parallel_size={dp}); use {pp - 1} split points, or 'Interleaved1F1B' "
                "for several stages per rank."
            )
        # Loop style: pipeline rank r holds stages r, r + pp, r + 2 pp, ...
        self._stage_ids = list(range(self.pp_rank, stages, pp))

    # ------------------------------------------------------------------ setup
    def connect(self, module: LightningModule) -> None:
        # Checked before any process starts: a wrong split point fails in the user's own process.
        _check_pipelined_module(module)
        if declares_manual_split(module):
            plan_stages(module, self.split_points)
        else:
            check_split_points(module, self.split_points)
        self._check_layout()
        super().connect(module)

    def setup(self, trainer: Trainer) -> None:
        self.trainer = trainer
        module = self._lightning_module
        assert module is not None
        _check_pipelined_module(module)
        self._check_layout()
        self._check_tensor_parallel(module)
        self.precision.convert_module(module)
        if declares_manual_split(module):
            self._setup_manual_parts(module)
        else:
            self._setup_traced_parts(trainer, module)
        self._build_groups()
        self._accumulate = trainer.accumulate_grad_batches
        if trainer.training:
            self.setup_optimizers(trainer)
        self._build_schedule()
        self.model = module

    def _check_tensor_parallel(self, module: LightningModule) -> None:
        """Tensor parallelism inside the stages; ``PipelinePlugin`` itself has none."""

    def _setup_manual_parts(self, module: LightningModule) -> None:
        """Stages the module declared: each part is the module with the other stages' layers ``nn.Identity``."""
        plan = plan_stages(module, self.split_points)
        held = [name for sid in self._stage_ids for name in plan[sid]]
        self._held_prefixes = held
        # Layers this rank does not hold take no memory; their names stay for checkpoints.
        for sid, names in enumerate(plan):
            if sid not in self._stage_ids:
                for name in names:
                    module.get_submodule(name).to(torch.device("meta"))
        device = self.root_device
        _materialise(module, held, device)
        self._parts = [_stage_module(module, set(plan[sid])).to(device) for sid in self._stage_ids]

    def _setup_traced_parts(self, trainer: Trainer, module: LightningModule) -> None:
        """Stages cut from the traced forward: each part runs its own piece of the graph, on its own tensors."""
        traced = self._traced
        if traced is None or traced.module is not module:
            # Traced once per module: a later validate/test in these processes reuses the split
            # (by then the other ranks' tensors are on the meta device and could not be traced).
            example = _example_microbatch(
                trainer, module, self.split_points, self.n_microbatches or self._num_stages
            )
            traced = self._traced = _TracedSplit.trace(module, self.split_points, example)
        held = [name for sid in self._stage_ids for name in traced.tensors[sid]]
        self._held_prefixes = held
        others = [
            name for sid, names in enumerate(traced.tensors) if sid not in self._stage_ids for name in names
        ]
        _tensors_to_meta(module, others)
        device = self.root_device
        _materialise_tensors(module, held, device)
        self._parts = [traced.part(module, sid).to(device) for sid in self._stage_ids]

    def setup_environment(self) -> None:
        super().setup_environment()
        # A collective: every rank builds the mesh here, before the module's configure_model may use it.
        self._build_groups()
        if self._lightning_module is not None and self.world_size > 1:
            self._lightning_module._device_mesh = self.device_mesh

    def _build_groups(self) -> None:
        if self._pp_group is not None:
            return  # a later fit/validate/test in the same processes keeps the groups
        if self.world_size == 1:
            self._pp_group = dist.group.WORLD
            self._dp_group = None
            return
        dims = self.parallel_dims
        mesh = self.device_mesh
        self._pp_group = mesh[PIPELINE].get_group()
        self._dp_group = dims.submesh(DATA).get_group() if dims.dp > 1 else None

    def _build_schedule(self) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self._stages = [
            _without_side_effects_of_inference(
                PipelineStage(part, sid, self._num_stages, self.root_device, group=self._pp_group)
            )
            for part, sid in zip(self._parts, self._stage_ids)
        ]
        n = self.n_microbatches or self._num_stages
        cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}[
            self.schedule_name
        ]
        stages: Any = self._stages if self.schedule_name in _MULTI_STAGE_SCHEDULES else self._stages[0]
        # scale_grads=False: the loss is scaled here instead, so that gradients accumulated over
        # several batches are not divided again at every step.
        self._schedule = cls(stages, n_microbatches=n, loss_fn=self._microbatch_loss, scale_grads=False)
        self._batch_sizes = {}

    def _microbatch_loss(self, output: Tensor, target: Tensor) -> Tensor:
        module = self._lightning_module
        # Weighted by the micro-batch's share of the batch: the sum over micro-batches is the batch mean.
        loss = module.loss_fn(output, target) * (target.shape[0] * self._loss_scale)  # type: ignore[union-attr]
        # precision="16-mixed": the schedule's backward starts from the scaled loss.
        return loss if self._amp_scale is None else loss * self._amp_scale

    def setup_optimizers(self, trainer: Trainer) -> None:
        """One optimizer (and its schedulers) per model part, each from the module's own ``configure_optimizers``.

        ``configure_optimizers`` runs once per part, on the part's module: ``self.parameters()`` there
        is the part's parameters, so the same code gives every part the same optimizer class,
        hyper-parameters and param grouping.
        """
        module = self._lightning_module
        assert module is not None
        if not module.automatic_optimization:
            raise MisconfigurationException(
                f"PipelinePlugin runs the forward and backward of {type(module).__name__} itself (the schedule "
                "interleaves micro-batches), so manual optimization is not supported; remove "
                "`self.automatic_optimization = False`."
            )
        per_part = []
        with trainer.hook_runner.running("configure_optimizers"):
            for part in self._parts:
                per_part.append(parse_optimizers(part.configure_optimizers()))
        counts = {len(optimizers) for optimizers, _ in per_part}
        if counts != {1}:
            raise MisconfigurationException(
                f"configure_optimizers returned {sorted(counts)} optimizers; PipelinePlugin trains with one optimizer "
                "(it builds one per model part from it)."
            )
        container = OptimizersContainer([optimizers[0] for optimizers, _ in per_part])
        configs = []
        for index, config in enumerate(per_part[0][1]):
            schedulers = [part_configs[index].scheduler for _, part_configs in per_part]
            configs.append(
                dataclasses.replace(config, scheduler=LRSchedulersContainer(schedulers, container))
            )
        self.optimizers = [container]
        self.lr_scheduler_configs = configs

    def teardown(self) -> None:
        self._schedule = None
        self._stages = []
        super().teardown()

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.dp_rank}

    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        from torch.utils.data import DataLoader

        if kind == "predict":
            raise MisconfigurationException(
                "PipelinePlugin trains, validates and tests (it reports the loss); `trainer.predict` is not supported "
                "under it. Predict with the module on one device (plugins='single_device')."
            )
        if use_distributed_sampler and isinstance(dataloader, DataLoader):
            # The first and the last stage read the same batches: a shuffled order comes from a seed
            # (DistributedSampler), not from each rank's own global RNG.
            shuffled = is_random_sampler(dataloader.sampler)
            if self.data_parallel_size > 1 or (shuffled and self.world_size > 1):
                dataloader = with_distributed_sampler(dataloader, kind, self.data_parallel_size, self.dp_rank)
        if not self._stage_ids:
            self._check_layout()
        if self.has_first_stage or self.has_last_stage:
            return dataloader
        return _NoData(dataloader)

    # ------------------------------------------------------------------ steps
    def defines_step(self, name: str) -> bool:
        """Training, validation and test run the pipeline (``forward`` and ``loss_fn``), not the module's steps."""
        if name in ("training_step", "validation_step", "test_step"):
            return True
        return super().defines_step(name)

    def grad_scaler(self) -> Any:
        # Each stage holds its own parameters' gradients: an inf in one stage shows on its ranks only.
        return self.sharded_grad_scaler()

    def forward_backward(self) -> Optional[Callable[[Any, int], Tensor]]:
        return self._train_batch

    def _train_batch(self, batch: Any, batch_idx: int) -> Tensor:
        """Forward and backward of one batch through the schedule; returns the batch loss on every rank."""
        args, target = self._split_batch(batch, training=True)
        losses: Optional[list[Tensor]] = [] if self.has_last_stage else None
        scaler = self.precision.scaler
        if scaler is None:
            self._schedule.step(*args, target=target, losses=losses)
        else:
            # Every rank, with a last stage or not, starts the scaler (its scale tensor) for this step.
            self._amp_scale = scaler.scale(torch.ones((), device=self.root_device))
            try:
                self._schedule.step(*args, target=target, losses=losses)
            finally:
                self._amp_scale, scale = None, self._amp_scale
            if losses:
                losses = [item / scale for item in losses]
        if self._dp_group is not None and self._sync_grads:
            self._average_gradients()
        loss = self._reported_loss(losses)
        module = self._lightning_module
        module.log("train_loss", loss * self._accumulate, prog_bar=True)  # type: ignore[union-attr]
        return loss

    def _eval_batch(self, batch: Any, name: str) -> Tensor:
        args, target = self._split_batch(batch, training=False)
        losses: Optional[list[Tensor]] = [] if self.has_last_stage else None
        self._schedule.eval(*args, target=target, losses=losses)
        loss = self._reported_loss(losses)
        self._lightning_module.log(name, loss, prog_bar=True)  # type: ignore[union-attr]
        return loss

    def training_step(self, batch: Any, batch_idx: int, *args: Any) -> Any:
        raise MisconfigurationException(
            "PipelinePlugin runs training through its schedule; the loop calls forward_backward, not training_step."
        )

    def validation_step(self, batch: Any, batch_idx: int = 0, *args: Any) -> Tensor:
        return self._eval_batch(batch, "val_loss")

    def test_step(self, batch: Any, batch_idx: int = 0, *args: Any) -> Tensor:
        return self._eval_batch(batch, "test_loss")

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise MisconfigurationException("PipelinePlugin does not support `trainer.predict`.")

    def _split_batch(self, batch: Any, training: bool) -> tuple[tuple[Any, ...], Optional[Tensor]]:
        """The schedule's inputs on the first stage and target on the last; nothing elsewhere."""
        if not (self.has_first_stage or self.has_last_stage):
            return (), None
        if not (isinstance(batch, (list, tuple)) and len(batch) == 2):
            raise MisconfigurationException(
                f"PipelinePlugin needs each batch to be an (input, target) pair, got a {type(batch).__name__}"
                f"{f' of {len(batch)}' if isinstance(batch, (list, tuple)) else ''}; return pairs from the dataset."
            )
        inputs, target = batch
        size = int(target.shape[0])
        n = self._schedule._n_microbatches
        expected = self._batch_sizes.setdefault(training, size)
        if size != expected or size % n:
            raise MisconfigurationException(
                f"PipelinePlugin: a {'training' if training else 'evaluation'} batch of {size} samples; the pipeline "
                f"needs every batch of one size (the first was {expected}) and divisible by n_microbatches={n}. "
                "Use DataLoader(drop_last=True) and a batch size that is a multiple of n_microbatches."
            )
        # Each micro-batch's loss, weighted by its share of the batch, sums to the batch mean
        # (divided by the accumulation steps, as the loop divides an ordinary loss).
        self._loss_scale = 1.0 / (size * (self._accumulate if training else 1))
        args = (inputs,) if self.has_first_stage else ()
        return args, target if self.has_last_stage else None

    def _reported_loss(self, losses: Optional[list[Tensor]]) -> Tensor:
        """The batch loss (mean over data-parallel replicas) on every rank: one all-reduce over the world."""
        local = torch.stack(losses).sum().detach() if losses else torch.zeros((), device=self.root_device)
        if self.world_size == 1:
            return local
        local = local.to(self.root_device, torch.float32)
        dist.all_reduce(local)
        # Every tensor-parallel rank of the last stage holds the loss of its replica's batch.
        return local / (self.data_parallel_size * self._tp)

    def _average_gradients(self) -> None:
        grads = [_local(p.grad) for part in self._parts for p in part.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self._dp_group)
        flat /= self.data_parallel_size
        for grad, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(synced)

    @contextlib.contextmanager
    def _skip_gradient_sync(self) -> Iterator[None]:
        self._sync_grads = False
        try:
            yield
        finally:
            self._sync_grads = True

    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        if self._dp_group is None:
            return contextlib.nullcontext()
        return self._skip_gradient_sync()

    def clip_gradients(self, optimizer: Optimizer, clip_val: float, algorithm: str) -> None:
        """By value: per parameter. By norm: the norm over every stage (an all-reduce over the pipeline)."""
        self.precision.unscale_gradients(optimizer)
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm != "norm":
            for grad in grads:
                _local(grad).detach().clamp_(-clip_val, clip_val)
            return
        # Tensor-parallel shards are summed over their group; replicas hold equal (averaged) gradients.
        clip_grads_by_total_norm(grads, clip_val, extra_group=self._pp_group if self.pp_degree > 1 else None)

    # ------------------------------------------------------------------ state
    @property
    def _sharded(self) -> bool:
        """Whether checkpoints are folders every rank writes its own parts into (``DistributedCheckpointIO``)."""
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        return isinstance(self.checkpoint_io.unwrapped, DistributedCheckpointIO)

    def _is_held(self, name: str) -> bool:
        return any(
            not prefix or name == prefix or name.startswith(prefix + ".") for prefix in self._held_prefixes
        )

    def _local_state_dict(self) -> dict[str, Any]:
        module = self._lightning_module
        assert module is not None
        return {k: v for k, v in module.state_dict().items() if self._is_held(k)}

    def _gather_to_first(self, local: Any) -> Optional[list[Any]]:
        """``local`` of every pipeline rank of data-parallel replica 0, on global rank 0; ``None`` elsewhere.

        Sharded checkpoints gather nothing: every rank writes its own parts.
        """
        if self.pp_degree == 1:
            return [local]
        if self._sharded:
            return None
        if self.dp_rank != 0 or self.tp_rank != 0:
            return None
        gathered: Optional[list[Any]] = [None] * self.pp_degree if self.pp_rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._pp_group)
        return gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on global rank 0 (every stage's tensors under their original names); local elsewhere."""
        module = self._lightning_module
        assert module is not None
        local = self._local_state_dict()
        if not self._sharded:
            # Tensor-parallel shards become whole tensors (a collective over the group, in name order).
            local = {k: _full(v).detach().cpu() if isinstance(v, Tensor) else v for k, v in local.items()}
        gathered = self._gather_to_first(local)
        if gathered is None:
            return local
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        return {k: merged[k] for k in module.state_dict() if k in merged}

    def load_model_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Each rank takes, by name, the tensors of the layers it holds."""
        module = self._lightning_module
        assert module is not None
        mine = {k: v for k, v in state_dict.items() if self._is_held(k)}
        own = self._local_state_dict()
        missing = [k for k in own if k not in mine]
        if strict and missing:
            raise CheckpointError(
                f"the checkpoint lacks {missing[:_MAX_LISTED]} of the layers this rank holds."
            )
        # Whole tensors go to tensor-parallel parameters as this rank's shard of them.
        mine = {k: _like(v, own[k]) if k in own else v for k, v in mine.items()}
        module.load_state_dict(mine, strict=False)

    def _param_names(self) -> dict[Tensor, str]:
        from trainer_core.checkpoint import parameter_names

        assert self._lightning_module is not None
        return parameter_names(self._lightning_module)

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every part's state keyed by parameter name, gathered to global rank 0, groups merged.

        Merged, the param groups are those of the unsplit module (parts share hyper-parameters), so
        the state is the one a single-device run writes, and loads at any pipeline degree.
        """
        from trainer_core.checkpoint import optimizer_state_to_names

        names = self._param_names()
        parts = list(optimizer.optimizers) if isinstance(optimizer, OptimizersContainer) else [optimizer]
        local = [
            (
                sid,
                optimizer_state_to_names(
                    opt.state_dict() if self._sharded else _full_state(opt.state_dict()), opt, names
                ),
            )
            for sid, opt in zip(self._stage_ids, parts)
        ]
        gathered = self._gather_to_first(local)
        if gathered is not None:
            return _merge_parts([entry for rank_parts in gathered for entry in rank_parts])
        merged = _merge_parts(local)
        if self._sharded and self.pp_degree > 1:
            # Every rank writes the same param groups, naming every stage's parameters (DCP keeps
            # one copy of what all ranks write under one key); the tensors stay each rank's own.
            groups = [None] * self.pp_degree
            dist.all_gather_object(
                groups,
                [(sid, {"param_groups": g["param_groups"]}) for sid, g in local if g],
                group=self._pp_group,
            )
            every = _merge_parts([entry for rank_groups in groups for entry in rank_groups])  # type: ignore[union-attr]
            merged = {"state": merged.get("state", {}), "param_groups": every.get("param_groups", [])}
        return merged

    def prepare_optimizer_state(self, optimizer: Optimizer, named_state: dict[str, Any], path: str) -> Any:
        """Check the name-keyed state against the whole module, then give each part its own parameters' state."""
        from trainer_core.checkpoint import (
            check_named_state_covers,
            optimizer_state_from_names,
            select_named_state,
        )

        module = self._lightning_module
        assert module is not None
        if not named_state:
            return {}
        check_named_state_covers(named_state, module, type(module).__name__, path)
        names = self._param_names()
        parts = list(optimizer.optimizers) if isinstance(optimizer, OptimizersContainer) else [optimizer]
        prepared = []
        for opt in parts:
            mine = [names[p] for group in opt.param_groups for p in group["params"]]
            prepared.append(
                optimizer_state_from_names(select_named_state(named_state, mine), opt, names, path)
            )
        return {"parts": prepared} if isinstance(optimizer, OptimizersContainer) else prepared[0]

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        optimizer.load_state_dict(state_dict)
        # Whole state tensors of tensor-parallel parameters become this rank's shard of them.
        for opt in optimizer.optimizers if isinstance(optimizer, OptimizersContainer) else [optimizer]:
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.dim() and value.shape == param.shape:
                        state[key] = _like(value, param)

    # ------------------------------------------------------------------ checkpoint files
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Optional[Any] = None
    ) -> None:
        if self._sharded:
            # A collective: every rank writes the tensors of its own parts.
            self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        else:
            super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, filepath: str) -> dict[str, Any]:
        """A sharded folder: each rank reads only the tensors of the layers it holds; a file: whole."""
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO, is_sharded_checkpoint

        if not (dist.is_initialized() and is_sharded_checkpoint(filepath)):
            return super().load_checkpoint(filepath)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        module = self._lightning_module
        assert module is not None
        template: dict[str, Any] = {KEY_STATE_DICT: self._local_state_dict()}
        if self.optimizers:
            options = StateDictOptions(full_state_dict=False)
            state: dict[str, Any] = {}
            for part, opt in zip(self._parts, self.optimizers[0]):  # type: ignore[call-overload]
                # Creates the state tensors (lazily built by most optimizers) for DCP to fill.
                state.update(get_optimizer_state_dict(part, opt, options=options)["state"])
            # The groups' layout (DCP stores each entry under its own key); the values come from the file.
            groups = self.named_optimizer_state(self.optimizers[0]).get("param_groups", [])
            template[KEY_OPTIMIZER_STATES] = [{"state": state, "param_groups": groups}]
        io = self.checkpoint_io.unwrapped
        if not isinstance(io, DistributedCheckpointIO):
            io = DistributedCheckpointIO()
        checkpoint = io.load_into(filepath, template)
        # The layers of other ranks stand in with their names, shapes and dtypes for the checks, and
        # no memory (a zero expanded); loading takes only this rank's own.
        others = {
            k: torch.zeros((), dtype=v.dtype).expand(v.shape) if isinstance(v, Tensor) else v
            for k, v in module.state_dict().items()
            if not self._is_held(k)
        }
        checkpoint[KEY_STATE_DICT] = {**others, **checkpoint[KEY_STATE_DICT]}
        return checkpoint


class PipelineModelParallelPlugin(PipelinePlugin):
    """``ModelParallelPlugin`` with ``pipeline_parallel_size > 1``: pipeline stages, tensor-parallel inside.

    Built by ``ModelParallelPlugin(pipeline_parallel_size=N, ...)``, with its arguments. The module
    declares its stages (``pipeline_manual_split = True``: its ``forward`` runs its layers as a chain)
    and applies its tensor-parallel plan in ``configure_model`` over ``self.device_mesh["tensor_parallel"]``,
    as for ``ModelParallelPlugin``; each rank then keeps the layers of its stages. Data-parallel
    replicas of a stage average their gradients after the backward, as under ``PipelinePlugin``.
    """

    name = "model_parallel"

    def __init__(
        self,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = "auto",
        pipeline_parallel_size: int = 2,
        save_distributed_checkpoint: bool = True,
        mixed_precision: Any = None,
        reshard_after_forward: bool = True,
        split_points: Sequence[str] = (),
        schedule: str = "1F1B",
        n_microbatches: Optional[int] = None,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
    ) -> None:
        from trainer_core.plugins.model_parallel import check_sizes

        check_sizes("ModelParallelPlugin", data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        if mixed_precision is not None or not reshard_after_forward:
            raise MisconfigurationException(
                f"ModelParallelPlugin(pipeline_parallel_size={pipeline_parallel_size}) averages the gradients of "
                "data-parallel replicas itself instead of sharding with FSDP, so `mixed_precision` and "
                "`reshard_after_forward` (FSDP's options) do not apply; use Trainer(precision='bf16-mixed') for "
                "mixed precision."
            )
        if not split_points:
            raise MisconfigurationException(
                f"ModelParallelPlugin(pipeline_parallel_size={pipeline_parallel_size}) needs `split_points`: the "
                "names of the layers that begin each stage after the first (e.g. split_points=['layers.2'])."
            )
        if save_distributed_checkpoint and checkpoint_io is None:
            from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

            checkpoint_io = DistributedCheckpointIO()
        super().__init__(
            split_points=split_points,
            schedule=schedule,
            n_microbatches=n_microbatches,
            start_method=start_method,
            process_group_backend=process_group_backend,
            timeout=timeout,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
        )
        self.requested_sizes = (data_parallel_size, tensor_parallel_size, pipeline_parallel_size)
        self.pipeline_parallel_size = pipeline_parallel_size
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._resolve_sizes(world_size=None)

    def _resolve_sizes(self, world_size: Optional[int]) -> None:
        from trainer_core.plugins.model_parallel import resolve_sizes

        dp, tp, pp = self.requested_sizes
        if world_size is None:
            # Until the world is known: as many ranks as the given sizes name (checked again then).
            world_size = (dp if isinstance(dp, int) else 1) * (tp if isinstance(tp, int) else 1) * pp
            self._num_devices = max(self._num_devices, world_size)
        dp, tp, pp = resolve_sizes("ModelParallelPlugin", world_size, self._num_devices, dp, tp, pp)
        self.data_parallel_size, self._tp = dp, tp
        self._dims = None

    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        super().configure_devices(device_type, num_devices, num_nodes)
        self._resolve_sizes(self.world_size)

    def connect(self, module: LightningModule) -> None:
        if self._tp > 1 and not declares_manual_split(module):
            raise MisconfigurationException(
                f"ModelParallelPlugin(pipeline_parallel_size={self.pipeline_parallel_size}, tensor_parallel_size="
                f"{self._tp}) needs {type(module).__name__} to declare its stages (`{MANUAL_SPLIT_ATTRIBUTE} = True` "
                "on the class, its forward running its layers as a chain): the traced split runs the layers' "
                "tensors directly and would bypass the tensor-parallel plan of configure_model."
            )
        super().connect(module)

    @property
    def metrics_group(self) -> Optional[Any]:
        """None: every rank holds the same reported loss; user values are reduced over all ranks."""
        return None

    def configuring_model(self) -> contextlib.AbstractContextManager:
        from trainer_core.plugins.model_parallel import refuse_skipped_plan_entries

        return refuse_skipped_plan_entries(self._lightning_module)

    def _check_tensor_parallel(self, module: LightningModule) -> None:
        from trainer_core.plugins.model_parallel import check_tensor_parallel_applied

        check_tensor_parallel_applied(module, self._tp, "ModelParallelPlugin")


# ---------------------------------------------------------------------- splitting
def plan_stages(module: nn.Module, split_points: Sequence[str]) -> list[list[str]]:
    """The submodules (fully-qualified names of whole subtrees) of each stage, in pipeline order.

    Submodules are ordered as ``named_modules()`` lists them (registration order); each split point
    begins a stage. A container that spans a split point (``layers``) is not held whole: its
    children are assigned one by one.
    """
    named = dict(module.named_modules())
    order = {name: index for index, name in enumerate(named)}
    check_split_points(module, split_points)
    positions = [order[p] for p in split_points]
    subtree_end: dict[str, int] = {}
    names = list(named)
    for name in reversed(names):
        children = [f"{name}.{c}" if name else c for c, _ in named[name].named_children()]
        children = [c for c in children if c in order and order[c] > order[name]]
        subtree_end[name] = max([subtree_end[c] for c in children], default=order[name])

    stages: list[list[str]] = [[] for _ in range(len(split_points) + 1)]

    def assign(name: str) -> None:
        start, end = order[name], subtree_end[name]
        if not any(start < p <= end for p in positions):
            stages[bisect.bisect_right(positions, start)].append(name)
            return
        mod = named[name]
        own = [n for n, _ in mod.named_parameters(recurse=False)] + [
            n for n, _ in mod.named_buffers(recurse=False)
        ]
        if own:
            raise MisconfigurationException(
                f"PipelinePlugin: {name or type(module).__name__!r} spans split points but holds tensors itself "
                f"({', '.join(own)}), which no single stage can own; move them into a submodule."
            )
        for child, _ in mod.named_children():
            full = f"{name}.{child}" if name else child
            if full in order and order[full] > start:
                assign(full)

    assign("")
    for index, held in enumerate(stages):
        if not held:
            raise MisconfigurationException(
                f"PipelinePlugin(split_points={list(split_points)}): stage {index} would hold no submodule; "
                "remove a split point."
            )
    return stages


def check_split_points(module: nn.Module, split_points: Sequence[str]) -> None:
    """Each split point names a submodule, once, in registration order (the order a chain runs them)."""
    named = dict(module.named_modules())
    order = {name: index for index, name in enumerate(named)}
    for point in split_points:
        if point not in named or point == "":
            raise MisconfigurationException(
                f"PipelinePlugin(split_points={list(split_points)}): {point!r} names no submodule of "
                f"{type(module).__name__}. Its submodules: {_submodule_listing(module)}."
            )
    positions = [order[p] for p in split_points]
    if positions != sorted(set(positions)):
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): list each split point once, in the order the "
            f"module's forward runs them ({', '.join(p for p in sorted(split_points, key=order.get))})."
        )


def declares_manual_split(module: nn.Module) -> bool:
    """Whether the module's class set ``pipeline_manual_split = True`` (stages by hand, no tracing)."""
    return getattr(module, MANUAL_SPLIT_ATTRIBUTE, False) is True


def _submodule_listing(module: nn.Module) -> str:
    names = [name for name, _ in module.named_modules() if name and name.count(".") < 2]
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


def _stage_module(root: nn.Module, held: set[str]) -> nn.Module:
    """``root`` with the subtrees of ``held`` shared and every other layer an ``nn.Identity``.

    Containers on the way are shallow copies with their own child dicts, so several stages of one
    rank can be built from the same module without copying any tensor.
    """

    def build(name: str, mod: nn.Module) -> nn.Module:
        if name in held:
            return mod
        prefix = f"{name}." if name else ""
        if not any(h.startswith(prefix) for h in held):
            return nn.Identity()
        new = copy.copy(mod)
        new._modules = {}
        new._parameters = {}
        new._buffers = {}
        for child_name, child in mod._modules.items():
            new._modules[child_name] = None if child is None else build(prefix + child_name, child)
        return new

    return build("", root)


def _materialise(module: nn.Module, held: Sequence[str], device: torch.device) -> None:
    """Give the layers this rank holds real memory when the module was built on the meta device.

    A module built under ``torch.device("meta")`` takes no memory on any rank; each rank allocates
    only its own layers here and initialises them with their ``reset_parameters`` (a checkpoint
    loaded afterwards, ``ckpt_path=...``, overwrites them).
    """
    for name in held:
        sub = module.get_submodule(name)
        if not any(t.is_meta for t in [*sub.parameters(), *sub.buffers()]):
            continue
        sub.to_empty(device=device)
        for inner in sub.modules():
            reset = getattr(inner, "reset_parameters", None)
            if callable(reset):
                reset()


# ---------------------------------------------------------------------- traced split
_MODES = (True, False)  # training, evaluation


@dataclasses.dataclass
class _StageProgram:
    """One stage's piece of the traced forward, and the values it receives and passes on.

    The split graph may hand a stage values from any earlier stage (a skip connection) or the
    input itself, but a schedule connects a stage only to the next one; so every stage passes on,
    after its own results, whatever a later stage still needs (``outputs``), in one fixed order.
    """

    graph: nn.Module  # the tracer's module for this stage (parameters under their original names)
    call: str  # the stage's node in the split graph
    inputs: list[str]  # the values received, in order
    args: list[str]  # the values the stage's graph takes, in order
    picks: dict[str, int]  # values that are one element of the stage's results: their index
    outputs: Any  # names passed on; on the last stage, the forward's output structure of names

    def run(self, *values: Any) -> Any:
        env = dict(zip(self.inputs, values))
        result = self.graph(*(env[name] for name in self.args))
        env[self.call] = result
        for name, index in self.picks.items():
            env[name] = result[index]
        if isinstance(self.outputs, list):
            passed = tuple(env[name] for name in self.outputs)
            return passed[0] if len(passed) == 1 else passed
        out = torch.fx.node.map_aggregate(
            self.outputs, lambda name: env[name] if isinstance(name, str) else name
        )
        # The tracer returns the forward's outputs flattened; a single one is what loss_fn expects.
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


class _TracedSplit:
    """``forward`` traced by ``torch.distributed.pipelining.pipeline`` and cut at the split points.

    ``tensors[s]`` are the fully-qualified names of the module's state that stage ``s`` holds:
    what its graph uses, and for the first stage also what no stage uses (unused parameters and
    non-tensor state still need an owner, for the optimizer and for checkpoints).
    """

    def __init__(
        self, module: nn.Module, programs: dict[bool, list[_StageProgram]], tensors: list[list[str]]
    ):
        self.module = module
        self.programs = programs
        self.tensors = tensors

    @classmethod
    def trace(cls, module: LightningModule, split_points: Sequence[str], example: Any) -> _TracedSplit:
        num_stages = len(split_points) + 1
        was_training = module.training
        programs: dict[bool, list[_StageProgram]] = {}
        used: dict[bool, list[list[str]]] = {}
        try:
            for mode in _MODES:
                module.train(mode)
                pipe = _run_tracer(module, split_points, example)
                if pipe.num_stages != num_stages:
                    raise MisconfigurationException(
                        f"PipelinePlugin(split_points={list(split_points)}): the traced "
                        f"{type(module).__name__}.forward makes {pipe.num_stages} stages, not {num_stages}: a split "
                        "point that forward never calls (or calls inside another split point) begins no stage. "
                        "Split at submodules that forward calls, one after another."
                    )
                _refuse_shared_parameters(module, split_points, pipe)
                programs[mode] = _stage_programs(pipe)
                used[mode] = [_state_names(program.graph, module) for program in programs[mode]]
        finally:
            module.train(was_training)
        # A tensor may be used in one mode only (batch norm counts batches only in training), but
        # never by one stage in training and another in evaluation: a rank holds it in both.
        stage_of: dict[str, int] = {}
        for mode in _MODES:
            for stage, names in enumerate(used[mode]):
                for name in names:
                    if stage_of.setdefault(name, stage) != stage:
                        raise MisconfigurationException(
                            f"PipelinePlugin(split_points={list(split_points)}): {type(module).__name__}.forward "
                            f"uses {name} in stage {stage_of[name]} in one mode and in stage {stage} in the other "
                            "(training, evaluation), but a rank holds it for both. Use it at the same place in both, "
                            f"or declare the stages yourself ({MANUAL_SPLIT_ATTRIBUTE} = True)."
                        )
        tensors: list[list[str]] = [[] for _ in range(num_stages)]
        for name in _all_state_names(module):
            # What no stage uses (unused parameters, non-tensor state) goes to the first stage.
            tensors[stage_of.get(name, 0)].append(name)
        return cls(module, programs, tensors)

    def part(self, module: LightningModule, stage: int) -> nn.Module:
        """The model part of ``stage``: the module with only the stage's tensors, running the stage's graph.

        It is a shallow copy of the user's module, so ``configure_optimizers`` answers with the
        stage's parameters under their original names; its ``forward`` is the stage's graph.
        """
        programs = {mode: self.programs[mode][stage] for mode in _MODES}
        for program in programs.values():
            _rebind(program.graph, module)
        part = _tensor_part(module, set(self.tensors[stage]))

        def forward(*values: Any) -> Any:
            # The Trainer switches the user's module between train and eval; the part follows it.
            return programs[module.training].run(*values)

        part.forward = forward  # type: ignore[method-assign]
        return part


def _run_tracer(module: nn.Module, split_points: Sequence[str], example: Any) -> Any:
    """``pipeline(module, (example,), split_spec)``, leaving the module as it was; refuse what cannot be traced."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    tensors = [*module.parameters(), *module.buffers()]
    on_meta = {t.is_meta for t in tensors}
    if on_meta == {True, False}:
        raise MisconfigurationException(
            f"PipelinePlugin: {type(module).__name__} has some tensors on the meta device and others not, so its "
            "forward cannot be traced; build the whole module on one device (or all under torch.device('meta'))."
        )
    if on_meta == {True}:
        # A module built on the meta device is traced on meta inputs: shapes are all the tracer needs.
        example = apply_to_collection(example, Tensor, lambda t: t.to("meta"))
    # ``pipeline`` marks the split points by replacing their ``forward``; put back what was there.
    saved = {name: dict(module.get_submodule(name).__dict__) for name in split_points}
    try:
        return pipeline(module, (example,), split_spec={name: SplitPoint.BEGINNING for name in split_points})
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first_line = next((line for line in str(cause).splitlines() if line.strip()), "")
        first_line = first_line.rstrip(". ") + _user_code_line(cause, module)
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): the tracer (torch.distributed.pipelining.pipeline, "
            f"on torch.export) could not trace {type(module).__name__}.forward: {type(cause).__name__}: {first_line}. "
            "Without a traced graph the stages cannot be cut out of forward, and running the whole forward on "
            "every stage would train a different function. Make forward traceable (no control flow that depends "
            "on tensor values, such as `if x.sum() > 0`; see https://pytorch.org/docs/stable/export.html), or "
            f"declare the stages yourself: set `{MANUAL_SPLIT_ATTRIBUTE} = True` on {type(module).__name__} if "
            "its forward runs its submodules as a chain (each stage then runs forward with the layers of other "
            "stages replaced by nn.Identity)."
        ) from exc
    finally:
        for name, attributes in saved.items():
            sub = module.get_submodule(name)
            for key in ("forward", "_orig_forward"):
                if key in attributes:
                    sub.__dict__[key] = attributes[key]
                else:
                    sub.__dict__.pop(key, None)


def _user_code_line(exc: BaseException, module: nn.Module) -> str:
    """`` (at file:line: `code`)``: the line of the module's own source where tracing failed, if it is known."""
    try:
        source = inspect.getsourcefile(type(module))
    except TypeError:
        return ""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == source]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`)"


def _refuse_shared_parameters(module: nn.Module, split_points: Sequence[str], pipe: Any) -> None:
    """A tensor two stages use would be copied into each (the tracer's REPLICATE) and trained twice, apart."""
    # The tracer names a stage's copy ``layers@1.weight``; the module's own name has no ``@n``.
    shared = sorted(
        {re.sub(r"@\d+", "", name) for mapping in pipe.replicated_params for name in mapping.values()}
    )
    if shared:
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): {type(module).__name__}.forward uses "
            f"{', '.join(shared[:_MAX_LISTED])} in more than one stage (a module called twice, or tied weights); "
            "each stage would train its own copy, unlike one process. Move the split points so that every use of "
            "them falls in one stage."
        )


def _stage_programs(pipe: Any) -> list[_StageProgram]:
    """Each stage's graph, with the values it receives and passes on (see ``_StageProgram``)."""
    graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    stage_of: dict[str, int] = {node.name: -1 for node in graph.nodes if node.op == "placeholder"}
    picks: dict[str, tuple[str, int]] = {}
    for index, node in enumerate(calls):
        stage_of[node.name] = index
    for node in graph.nodes:
        if node.op == "call_function" and node.args and getattr(node.args[0], "name", None) in stage_of:
            source = node.args[0].name
            stage_of[node.name] = stage_of[source]
            picks[node.name] = (source, node.args[1])
    output = next(node for node in graph.nodes if node.op == "output")
    result = torch.fx.node.map_arg(output.args[0], lambda node: node.name)
    result_names: list[str] = []
    torch.fx.node.map_arg(output.args[0], lambda node: result_names.append(node.name))
    needs = [[arg.name for arg in call.args] for call in calls]
    order = list(stage_of)  # definition order: placeholders, then each stage's results
    programs = []
    inputs = [name for name in order if stage_of[name] == -1]
    for index, call in enumerate(calls):
        last = index == len(calls) - 1
        later = {name for names in needs[index + 1 :] for name in names} | set(result_names)
        passed = [name for name in order if stage_of[name] <= index and name in later]
        mine = {name: at for name, (source, at) in picks.items() if source == call.name and name in later}
        programs.append(
            _StageProgram(
                graph=pipe.get_stage_module(index),
                call=call.name,
                inputs=inputs,
                args=needs[index],
                picks=mine,
                outputs=result if last else passed,
            )
        )
        inputs = passed
    return programs


def _state_names(graph: nn.Module, module: nn.Module) -> list[str]:
    """The names of the module's tensors that a stage's graph holds (the tracer keeps their original names)."""
    own = _all_state_names(module)
    held = {name for name, _ in graph.named_parameters()} | {name for name, _ in graph.named_buffers()}
    return [name for name in own if name in held]


def _all_state_names(module: nn.Module) -> list[str]:
    """Every entry of the module's state: its state dict, and non-persistent buffers, in the module's order."""
    names = dict.fromkeys(module.state_dict(keep_vars=True))
    names.update(dict.fromkeys(name for name, _ in module.named_parameters()))
    names.update(dict.fromkeys(name for name, _ in module.named_buffers()))
    return list(names)


def _rebind(graph: nn.Module, module: nn.Module) -> None:
    """Point a stage's graph at the module's current tensors (materialising or moving a layer replaces them)."""
    for name, _ in list(graph.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        graph.get_submodule(owner)._parameters[leaf] = module.get_parameter(name)
    for name, _ in list(graph.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        try:
            graph.get_submodule(owner)._buffers[leaf] = module.get_buffer(name)
        except AttributeError:
            continue  # a constant the tracer lifted, not one of the module's buffers


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    prefix, _, leaf = name.rpartition(".")
    return module.get_submodule(prefix), leaf


def _tensor_part(root: nn.Module, held: set[str]) -> nn.Module:
    """``root`` with only the tensors named in ``held``, under their names, and no other.

    Modules on the way are shallow copies with their own dicts; the tensors are the root's.
    """

    def build(prefix: str, mod: nn.Module) -> Optional[nn.Module]:
        new = copy.copy(mod)
        new._parameters = {k: v for k, v in mod._parameters.items() if prefix + k in held}
        new._buffers = {k: v for k, v in mod._buffers.items() if prefix + k in held}
        new._modules = {}
        for child_name, child in mod._modules.items():
            if child is not None:
                built = build(f"{prefix}{child_name}.", child)
                if built is not None:
                    new._modules[child_name] = built
        empty = not (new._parameters or new._buffers or new._modules)
        return None if empty and prefix else new

    part = build("", root)
    assert part is not None
    return part


def _tensors_to_meta(module: nn.Module, names: Sequence[str]) -> None:
    """The named tensors take no memory on this rank; their names, shapes and dtypes stay."""
    for name in names:
        try:
            owner, leaf = _owner(module, name)
        except AttributeError:
            continue  # non-tensor state (``_extra_state``)
        if leaf in owner._parameters and owner._parameters[leaf] is not None:
            param = owner._parameters[leaf]
            if not param.is_meta:
                owner._parameters[leaf] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        elif leaf in owner._buffers and owner._buffers[leaf] is not None:
            owner._buffers[leaf] = owner._buffers[leaf].to("meta")


def _materialise_tensors(module: nn.Module, names: Sequence[str], device: torch.device) -> None:
    """Give the named tensors memory when the module was built on the meta device (see ``_materialise``)."""
    owners: dict[int, nn.Module] = {}
    for name in names:
        try:
            owner, leaf = _owner(module, name)
        except AttributeError:
            continue
        if (
            leaf in owner._parameters
            and owner._parameters[leaf] is not None
            and owner._parameters[leaf].is_meta
        ):
            param = owner._parameters[leaf]
            owner._parameters[leaf] = nn.Parameter(
                torch.empty_like(param, device=device), requires_grad=param.requires_grad
            )
            owners[id(owner)] = owner
        elif leaf in owner._buffers and owner._buffers[leaf] is not None and owner._buffers[leaf].is_meta:
            owner._buffers[leaf] = torch.empty_like(owner._buffers[leaf], device=device)
            owners[id(owner)] = owner
    for owner in owners.values():
        reset = getattr(owner, "reset_parameters", None)
        if callable(reset):
            reset()


def _example_microbatch(
    trainer: Trainer, module: LightningModule, split_points: Sequence[str], n: int
) -> Any:
    """One micro-batch to trace with: the first of the first training batch, else ``example_input_array``.

    The training loader is read once before the run, with every random generator put back
    afterwards, so the run draws the same batches as it would have.
    """
    from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states

    if trainer.training:
        loader = _training_loader(trainer, module)
        if loader is not None:
            states = collect_rng_states()
            try:
                batch = next(iter(loader))
            finally:
                apply_rng_states(states)
            if isinstance(batch, (list, tuple)) and len(batch) == 2:
                return apply_to_collection(batch[0], Tensor, lambda t: torch.tensor_split(t, n)[0])
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example
    raise MisconfigurationException(
        f"PipelinePlugin(split_points={list(split_points)}) traces {type(module).__name__}.forward on one "
        f"micro-batch before the run, and `trainer.{trainer.state_stage}` gives it none before it starts; set "
        f"`{type(module).__name__}.example_input_array` to one micro-batch of inputs, run `trainer.fit` first in "
        f"this process, or declare the stages yourself (`{MANUAL_SPLIT_ATTRIBUTE} = True`)."
    )


def _training_loader(trainer: Trainer, module: LightningModule) -> Any:
    """The training dataloader as ``fit`` will resolve it (given, else the datamodule's, else the module's)."""
    from lightning_utilities.core.overrides import is_overridden

    from trainer_core.datamodule import LightningDataModule
    from trainer_core.module import LightningModule as BaseModule

    # Read during fit only (``trainer.training``), when ``trainer.fit_loop`` holds this fit's sources.
    source = trainer.fit_loop.train_source
    if source is None:
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("train_dataloader", datamodule, LightningDataModule):
            source = datamodule.train_dataloader()
        elif is_overridden("train_dataloader", module, BaseModule):
            source = module.train_dataloader()
    if isinstance(source, (list, tuple)):
        source = source[0] if len(source) == 1 else None
    return source if hasattr(source, "__iter__") else None


def _without_side_effects_of_inference(stage: PipelineStage) -> PipelineStage:
    """Undo what the stage's shape inference changes in the module: buffers and random state.

    Before the first micro-batch a ``PipelineStage`` runs its module once more to learn the shapes
    it exchanges; batch norm would count that batch twice (and dropout draw twice) compared with
    one process. The buffers and the random generators are put back afterwards.
    """
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:
        return stage

    def inference(*args: Any, **kwargs: Any) -> Any:
        saved = [(buffer, buffer.detach().clone()) for buffer in stage.submod.buffers() if not buffer.is_meta]
        with torch.random.fork_rng(devices=[stage.device] if stage.device.type == "cuda" else []):
            try:
                return infer(*args, **kwargs)
            finally:
                with torch.no_grad():
                    for buffer, value in saved:
                        buffer.copy_(value)

    stage._forward_metadata_inference = inference  # type: ignore[method-assign]
    return stage


def _check_pipelined_module(module: LightningModule) -> None:
    if not callable(getattr(module, "loss_fn", None)):
        raise MisconfigurationException(
            f"PipelinePlugin: {type(module).__name__} must define `loss_fn(output, target)`. The pipeline splits "
            "`forward(input)` across stages and turns the last stage's output into the loss with `loss_fn`; "
            "`training_step` is not called."
        )


def _merge_parts(parts: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    """Name-keyed states of several ``(stage id, state)`` parts as one, in stage order."""
    from trainer_core.checkpoint import merge_named_states

    merged = merge_named_states(part for _, part in sorted(parts, key=lambda entry: entry[0]))
    return merged if merged["param_groups"] else {}


class _NoData:
    """A loader for a rank that holds neither the first nor the last stage: as many batches, none read."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.batch_size = getattr(loader, "batch_size", None)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[None]:
        return iter([None] * len(self.loader))


# ---------------------------------------------------------------------- tensor-parallel shards
def _local(tensor: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor``; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _full(tensor: Tensor) -> Tensor:
    """A ``DTensor`` gathered whole (a collective over its mesh); any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _full_state(obj: Any) -> Any:
    """An optimizer state with every ``DTensor`` gathered whole, in the state's own (deterministic) order."""
    if isinstance(obj, Tensor):
        return _full(obj)
    if isinstance(obj, dict):
        return {k: _full_state(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full_state(v) for v in obj]
    return obj


def _like(value: Any, target: Any) -> Any:
    """A whole tensor as ``target`` holds it: this rank's shard when ``target`` is a ``DTensor``.

    Every rank holds the same whole tensor (read from the same checkpoint), so each takes its own
    shard without communicating.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(target, DTensor) or isinstance(value, DTensor) or not isinstance(value, Tensor):
        return value
    return distribute_tensor(
        value.to(target.device, target.dtype), target.device_mesh, target.placements, src_data_rank=None
    )
