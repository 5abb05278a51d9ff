"""``PipelinePlugin``: pipeline parallelism on ``torch.distributed.pipelining``, optionally times data parallelism.

The module is cut at named submodules (``split_points``) into stages, in the order its
submodules are registered; ``forward(input)`` is what is split, and ``loss_fn(output, target)``
turns the last stage's output into the loss. A rank holds one stage (``"GPipe"``, ``"1F1B"``) or
several (``"Interleaved1F1B"``: with 2 ranks and 4 stages, rank 0 holds stages 0 and 2).

A stage is the module with every layer it does not hold replaced by ``nn.Identity`` (torchtitan's
"manual split"): the forward runs unchanged and passes the previous stage's output through the
missing layers, so the module's forward must be a chain of its submodules, in registration order.
The user's module keeps the whole name space, with the layers a rank does not hold moved to the
meta device (no memory), so checkpoints use the original fully-qualified names (``layers.3.weight``)
whichever rank holds them: a checkpoint written at one pipeline degree loads at another, or under
any other plugin.

Ranks are laid out as a ``(pp, dp)`` mesh: global rank = ``pp_rank * dp + dp_rank``. Replicas of a
stage average their gradients after the schedule's backward, before the optimizers step.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.containers import LRSchedulersContainer, OptimizersContainer
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.optim import parse_optimizers
from trainer_core.plugins.ddp import DDPPlugin, with_distributed_sampler

if TYPE_CHECKING:
    from torch.distributed.pipelining import PipelineStage

    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
_MULTI_STAGE_SCHEDULES = ("Interleaved1F1B",)
_MAX_LISTED = 30


class PipelinePlugin(DDPPlugin):
    """Split the module at ``split_points`` and run it as a pipeline of ``world_size / data_parallel_size`` ranks.

    Args:
        split_points: fully-qualified names of submodules (``"layers.2"``); each begins a new stage.
        schedule: ``"GPipe"``, ``"1F1B"`` (one stage per rank) or ``"Interleaved1F1B"`` (several).
        n_microbatches: micro-batches each batch is cut into (default: the number of stages).
        data_parallel_size: replicas of the whole pipeline; their gradients are averaged.
    """

    name = "pipeline"
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
        self._pp_group: Any = None
        self._dp_group: Any = None
        self._sync_grads = True
        self._loss_scale = 1.0
        self._accumulate = 1
        self._batch_sizes: dict[bool, int] = {}

    # ------------------------------------------------------------------ layout
    @property
    def pp_degree(self) -> int:
        return self.world_size // self.data_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.global_rank // self.data_parallel_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank % self.data_parallel_size

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
        """One module per stage this rank holds (layers of other stages are ``nn.Identity``)."""
        return list(self._parts)

    def _check_layout(self) -> None:
        world, dp = self.world_size, self.data_parallel_size
        if world % dp:
            raise MisconfigurationException(
                f"PipelinePlugin(data_parallel_size={dp}) does not divide the {world} processes of the run; make "
                "devices x num_nodes a multiple of it."
            )
        pp, stages = world // dp, self._num_stages
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
        plan_stages(module, self.split_points)
        self._check_layout()
        super().connect(module)

    def setup(self, trainer: Trainer) -> None:
        self._trainer = trainer
        module = self._lightning_module
        assert module is not None
        _check_pipelined_module(module)
        if self.precision.scaler is not None:
            raise MisconfigurationException(
                f"Trainer(precision={self.precision.name!r}) scales the loss, which the pipeline schedule's own "
                "backward cannot; use '32-true' or 'bf16-mixed' with PipelinePlugin."
            )
        self._check_layout()
        plan = plan_stages(module, self.split_points)
        held = [name for sid in self._stage_ids for name in plan[sid]]
        self._held_prefixes = held
        self.precision.convert_module(module)
        # Layers this rank does not hold take no memory; their names stay for checkpoints.
        for sid, names in enumerate(plan):
            if sid not in self._stage_ids:
                for name in names:
                    module.get_submodule(name).to(torch.device("meta"))
        device = self.root_device
        _materialise(module, held, device)
        self._parts = [_stage_module(module, set(plan[sid])).to(device) for sid in self._stage_ids]
        self._build_groups()
        self._accumulate = trainer.accumulate_grad_batches
        if trainer.training:
            self.setup_optimizers(trainer)
        self._build_schedule()
        self.model = module

    def _build_groups(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self._pp_group is not None:
            return  # a later fit/validate/test in the same processes keeps the groups
        if self.world_size == 1:
            self._pp_group = dist.group.WORLD
            self._dp_group = None
            return
        mesh = init_device_mesh(
            self.root_device.type, (self.pp_degree, self.data_parallel_size), mesh_dim_names=("pp", "dp")
        )
        self._pp_group = mesh["pp"].get_group()
        self._dp_group = mesh["dp"].get_group() if self.data_parallel_size > 1 else None

    def _build_schedule(self) -> None:
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        self._stages = [
            PipelineStage(part, sid, self._num_stages, self.root_device, group=self._pp_group)
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
        return module.loss_fn(output, target) * (target.shape[0] * self._loss_scale)  # type: ignore[union-attr]

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
        previous, trainer._current_fx = trainer._current_fx, "configure_optimizers"
        try:
            for part in self._parts:
                per_part.append(parse_optimizers(part.configure_optimizers()))
        finally:
            trainer._current_fx = previous
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

    def model_to_device(self) -> None:
        """The parts move in ``setup``; the layers of other ranks stay on the meta device."""

    def wrap_model(self, module: nn.Module) -> nn.Module:
        return module

    def teardown(self) -> None:
        self._schedule = None
        self._stages = []
        super().teardown()

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.dp_rank}

    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        from torch.utils.data import DataLoader, RandomSampler

        if kind == "predict":
            raise MisconfigurationException(
                "PipelinePlugin trains, validates and tests (it reports the loss); `trainer.predict` is not supported "
                "under it. Predict with the module on one device (plugins='single_device')."
            )
        if use_distributed_sampler and isinstance(dataloader, DataLoader):
            # The first and the last stage read the same batches: a shuffled order comes from a seed
            # (DistributedSampler), not from each rank's own global RNG.
            shuffled = isinstance(dataloader.sampler, RandomSampler)
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

    def forward_backward(self) -> Optional[Callable[[Any, int], Tensor]]:
        return self._train_batch

    def _train_batch(self, batch: Any, batch_idx: int) -> Tensor:
        """Forward and backward of one batch through the schedule; returns the batch loss on every rank."""
        args, target = self._split_batch(batch, training=True)
        losses: Optional[list[Tensor]] = [] if self.has_last_stage else None
        self._schedule.step(*args, target=target, losses=losses)
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

    def validation_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
        return self._eval_batch(batch, "val_loss")

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> Tensor:
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
        return local / self.data_parallel_size

    def _average_gradients(self) -> None:
        grads = [p.grad for part in self._parts for p in part.parameters() if p.grad is not None]
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
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if algorithm != "norm":
            torch.nn.utils.clip_grad_value_(params, clip_val)
            return
        squares = torch.zeros((), device=self.root_device)
        for p in params:
            squares = squares + p.grad.detach().float().pow(2).sum()
        if self.pp_degree > 1:
            dist.all_reduce(squares, group=self._pp_group)
        total = squares.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))

    # ------------------------------------------------------------------ state
    @property
    def _sharded(self) -> bool:
        """Whether checkpoints are folders every rank writes its own parts into (``DistributedCheckpointIO``)."""
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        io = getattr(self.checkpoint_io, "checkpoint_io", self.checkpoint_io)  # through AsyncCheckpointIO
        return isinstance(io, DistributedCheckpointIO)

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
        if self.dp_rank != 0:
            return None
        gathered: Optional[list[Any]] = [None] * self.pp_degree if self.pp_rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._pp_group)
        return gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on global rank 0 (every stage's tensors under their original names); local elsewhere."""
        module = self._lightning_module
        assert module is not None
        local = {
            k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in self._local_state_dict().items()
        }
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
        missing = [k for k in self._local_state_dict() if k not in mine]
        if strict and missing:
            raise CheckpointError(
                f"the checkpoint lacks {missing[:_MAX_LISTED]} of the layers this rank holds."
            )
        module.load_state_dict(mine, strict=False)

    def _param_names(self) -> dict[Tensor, str]:
        from trainer_core.checkpoint import parameter_names

        assert self._lightning_module is not None
        return parameter_names(self._lightning_module)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.named_optimizer_state(optimizer)

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every part's state keyed by parameter name, gathered to global rank 0, groups merged.

        Merged, the param groups are those of the unsplit module (parts share hyper-parameters), so
        the state is the one a single-device run writes, and loads at any pipeline degree.
        """
        from trainer_core.checkpoint import optimizer_state_to_names

        names = self._param_names()
        parts = list(optimizer.optimizers) if isinstance(optimizer, OptimizersContainer) else [optimizer]
        local = [
            (sid, optimizer_state_to_names(opt.state_dict(), opt, names))
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
        if state_dict:
            optimizer.load_state_dict(state_dict)

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
        template: dict[str, Any] = {"state_dict": self._local_state_dict()}
        if self.optimizers:
            options = StateDictOptions(full_state_dict=False)
            state: dict[str, Any] = {}
            for part, opt in zip(self._parts, self.optimizers[0]):  # type: ignore[call-overload]
                # Creates the state tensors (lazily built by most optimizers) for DCP to fill.
                state.update(get_optimizer_state_dict(part, opt, options=options)["state"])
            # The groups' layout (DCP stores each entry under its own key); the values come from the file.
            groups = self.named_optimizer_state(self.optimizers[0]).get("param_groups", [])
            template["optimizer_states"] = [{"state": state, "param_groups": groups}]
        io = getattr(self.checkpoint_io, "checkpoint_io", self.checkpoint_io)
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
        checkpoint["state_dict"] = {**others, **checkpoint["state_dict"]}
        return checkpoint


# ---------------------------------------------------------------------- splitting
def plan_stages(module: nn.Module, split_points: Sequence[str]) -> list[list[str]]:
    """The submodules (fully-qualified names of whole subtrees) of each stage, in pipeline order.

    Submodules are ordered as ``named_modules()`` lists them (registration order); each split point
    begins a stage. A container that spans a split point (``layers``) is not held whole: its
    children are assigned one by one.
    """
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
