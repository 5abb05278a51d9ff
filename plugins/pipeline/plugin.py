"""``PipelinePlugin``: the stages of a split module run by ``torch.distributed.pipelining``'s schedules.

Layout, setup (cutting the module, building the stages and the schedule), the data each rank reads,
and the step through the schedule live here; what a stage holds is ``stages.py``, where the module
is cut ``split.py``, and its state in checkpoints ``state.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.containers import LRSchedulersContainer, OptimizersContainer
from trainer_core.errors import MisconfigurationException
from trainer_core.optim import parse_optimizers
from trainer_core.plugins.parallel import (
    DEFAULT_TIMEOUT,
    ParallelPlugin,
    is_random_sampler,
    with_distributed_sampler,
)
from trainer_core.plugins.parallel_dims import DATA, PIPELINE, ParallelDims
from trainer_core.plugins.pipeline.split import (
    _example_microbatch,
    _TracedSplit,
    check_split_points,
    declares_manual_split,
    plan_stages,
)
from trainer_core.plugins.pipeline.stages import (
    _check_pipelined_module,
    _local,
    _materialise,
    _materialise_tensors,
    _NoData,
    _stage_module,
    _tensors_to_meta,
    _without_side_effects_of_inference,
)
from trainer_core.plugins.pipeline.state import StageState

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from trainer_core.module import LightningModule
    from trainer_core.plugins.environments import ClusterEnvironment
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.precision import Precision
    from trainer_core.trainer import Trainer

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
_MULTI_STAGE_SCHEDULES = ("Interleaved1F1B",)


class PipelinePlugin(StageState, ParallelPlugin):
    """Split the module at ``split_points`` and run it as a pipeline of ``world_size / data_parallel_size`` ranks.

    The stages come from tracing ``forward`` (see the module docstring); a module whose class sets
    ``pipeline_manual_split = True`` is split by hand instead.

    Args:
        split_points: fully-qualified names of submodules (``"layers.2"``); each begins a new stage.
        schedule: ``"GPipe"``, ``"1F1B"`` (one stage per rank) or ``"Interleaved1F1B"`` (several).
        n_microbatches: micro-batches each batch is cut into (default: the number of stages).
        data_parallel_size: replicas of the whole pipeline; their gradients are averaged.
        start_method, process_group_backend, timeout, cluster_environment, checkpoint_io: as for every
            multi-process plugin (``ParallelPlugin``); nothing is passed to a wrapper.
    """

    name = "pipeline"
    compiled_module_unsupported = (
        "the stages run the split module's parts, not the compiled training_step, so the compilation would be "
        "lost. Compile the parts instead (`torch.compile` of a submodule in `configure_model`), or pass the "
        "module uncompiled"
    )
    # Each rank loads the weights of the stages it holds, which exist once setup has split the model.
    restore_checkpoint_after_setup = True
    # Each stage holds its own parameters' gradients: an inf in one stage shows on its ranks only.
    holds_partial_gradients = True
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
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
    ) -> None:
        super().__init__(start_method, process_group_backend, timeout, cluster_environment, checkpoint_io)
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
        return self.parallel_dims.coordinates(self.global_rank)[PIPELINE]

    @property
    def parallel_dims(self) -> ParallelDims:
        """The layout: ``pp_degree`` stages x ``data_parallel_size`` replicas x tensor-parallel ranks."""
        if self._dims is None or self._dims.world_size != self.world_size:
            self._check_divides_the_world()
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

    def _check_divides_the_world(self) -> None:
        world, dp = self.world_size, self.data_parallel_size
        if world % (dp * self._tp):
            raise MisconfigurationException(
                f"{type(self).__name__}(data_parallel_size={dp}"
                + (f", tensor_parallel_size={self._tp}" if self._tp > 1 else "")
                + f") does not divide the {world} processes of the run; make devices x num_nodes a multiple of "
                f"{dp * self._tp}."
            )

    def _check_layout(self) -> None:
        self._check_divides_the_world()
        world, dp = self.world_size, self.data_parallel_size
        pp, stages = self.pp_degree, self._num_stages
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
        _check_precision(self.precision)
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
        if trainer.state_stage == "fit":
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
                dataloader = with_distributed_sampler(dataloader, kind, **self.distributed_sampler_kwargs)
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

    def _gradient_sync_pause(self) -> Optional[contextlib.AbstractContextManager]:
        return None if self._dp_group is None else self._skip_gradient_sync()

    def _grad_norm_parts(self, optimizer: Optimizer) -> tuple[list[Tensor], Optional[Any]]:
        """This rank's stages' gradients, with the other stages' ranks (an all-reduce over the pipeline).

        Tensor-parallel shards are summed over their group; replicas hold equal (averaged) gradients.
        """
        grads, _ = super()._grad_norm_parts(optimizer)
        return grads, self._pp_group if self.pp_degree > 1 else None


def _check_precision(precision: Precision) -> None:
    """Refuse a precision whose backward the schedule would bypass (it runs each micro-batch's backward itself)."""
    if precision.custom_backward:
        name = type(precision).__name__
        raise MisconfigurationException(
            f"PipelinePlugin runs each micro-batch's backward inside its schedule, so {name}'s pre_backward, "
            f"backward and post_backward would never run. Move that work into {name}.optimizer_step or the "
            "module's loss_fn, or use a plugin that calls the precision's backward (DDPPlugin, FSDPPlugin)."
        )
