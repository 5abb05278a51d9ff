"""``DDPPlugin``: data parallelism with ``DistributedDataParallel``; gloo on CPU, nccl on CUDA.

Every rank holds the whole model; DDP averages gradients during the backward. The training step
goes through the DDP wrapper (which is what makes the gradient hooks fire); validation, test and
prediction call the module directly, so they add no collective. Nothing else runs a collective
on the step: metrics are reduced only when ``self.log(..., sync_dist=True)`` asks for it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.base import TrainingTypePlugin, wrapper_keywords
from trainer_core.plugins.environments import ClusterEnvironment, detect_environment
from trainer_core.plugins.launchers import ScriptLauncher, SpawnLauncher
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.trainer import Trainer

#: How long a rank waits in a collective for the others before giving up with an error.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class _StepRouter(nn.Module):
    """Lets DDP's ``forward`` run a named step of the LightningModule (``training_step``)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.module, step)(*args, **kwargs)


class DDPPlugin(TrainingTypePlugin):
    """``DistributedDataParallel`` over ``devices`` processes per node.

    Keyword arguments other than the plugin's own go to ``DistributedDataParallel``
    (``find_unused_parameters=True``, ``static_graph=True``, ``gradient_as_bucket_view=True``, ...);
    names it does not take are refused here, when the plugin is built.
    """

    name = "ddp"
    optimizer_in_backward_unsupported = (
        "a parameter's gradient hook fires before DistributedDataParallel has all-reduced that gradient, so each "
        "rank would step on its own local gradient and the replicas would drift apart. Use FSDPPlugin (its hook "
        "fires on the reduced, sharded gradient) or SingleDevicePlugin"
    )

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise MisconfigurationException(
                f"DDPPlugin(start_method={start_method!r}): use 'popen' (re-run the script), 'spawn', 'fork' or "
                "'forkserver'."
            )
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.cluster_environment = cluster_environment
        self._ddp_kwargs = ddp_kwargs
        self._device_type = "cpu"
        self._num_devices = 1
        self._num_nodes = 1
        self._launcher: Any = None

    @classmethod
    def _wrapper_arguments(cls) -> tuple[str, list[str]]:
        # The plugin gives DDP the module and its one device per process.
        return "DistributedDataParallel", wrapper_keywords(
            DistributedDataParallel.__init__, set_by_plugin=("module", "device_ids")
        )

    # ------------------------------------------------------------------ processes
    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        self._device_type = device_type
        self._num_devices = num_devices
        self._num_nodes = num_nodes
        if self.cluster_environment is None:
            self.cluster_environment = detect_environment(num_devices, num_nodes)
        if self.cluster_environment.creates_processes_externally and not dist.is_initialized():
            self.cluster_environment.validate(num_devices, num_nodes)

    @property
    def _env(self) -> ClusterEnvironment:
        if self.cluster_environment is None:
            self.configure_devices(self._device_type, self._num_devices, self._num_nodes)
        assert self.cluster_environment is not None
        return self.cluster_environment

    @property
    def global_rank(self) -> int:
        return self._env.global_rank()

    @property
    def local_rank(self) -> int:
        return self._env.local_rank()

    @property
    def node_rank(self) -> int:
        return self._env.node_rank()

    @property
    def world_size(self) -> int:
        return self._env.world_size()

    @property
    def root_device(self) -> torch.device:
        if self._device_type == "cuda":
            return torch.device("cuda", self.local_rank)
        return torch.device("cpu")

    @property
    def backend(self) -> str:
        return self.process_group_backend or ("nccl" if self._device_type == "cuda" else "gloo")

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        env = self._env
        if env.creates_processes_externally or self.world_size == 1 or dist.is_initialized():
            return function(*args, **kwargs)
        if self.start_method == "popen":
            if self._launcher is None:
                self._launcher = ScriptLauncher(env, self._num_devices, self._num_nodes)
            return self._launcher.launch(function, *args, **kwargs)
        launcher = SpawnLauncher(env, self._num_devices, self.start_method)
        return launcher.launch(function, *args, trainer=self.trainer, **kwargs)

    def setup_environment(self) -> None:
        super().setup_environment()
        if dist.is_initialized():
            return
        env = self._env
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        if self._device_type == "cuda":
            torch.cuda.set_device(self.root_device)
        dist.init_process_group(
            self.backend,
            init_method="env://",
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        # Kept for later fit/test calls in this process, but destroyed before the interpreter
        # exits: left to static destructors, gloo can abort the process at exit (SIGABRT).
        atexit.register(_destroy_process_group)

    # ------------------------------------------------------------------ model
    def setup(self, trainer: Trainer) -> None:
        if trainer.training:
            self.check_module_for_data_parallel()
        super().setup(trainer)

    def check_module_for_data_parallel(self) -> None:
        """Say, before training, where this module computes another function than one process would.

        Every data-parallel plugin (DDP, ShardedDDP, ZeRO, FSDP) calls this from its ``setup``:
        gradients are averaged, so a module whose forward treats samples independently trains
        exactly as one process on the combined batch; a layer that mixes samples (BatchNorm) does not.
        """
        module = self._lightning_module
        if module is not None and self.world_size > 1:
            warn_if_batch_norm(module, type(self).__name__, self.world_size, self._running_stats_note())

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
        if self.world_size == 1:
            return module
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        return DistributedDataParallel(_StepRouter(module), device_ids=device_ids, **self._ddp_kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        model = self._model
        if isinstance(model, DistributedDataParallel):
            return model("training_step", *args, **kwargs)
        return super().training_step(*args, **kwargs)

    def no_backward_sync(self) -> contextlib.AbstractContextManager:
        model = self._model
        if isinstance(model, DistributedDataParallel):
            return model.no_sync()
        return contextlib.nullcontext()

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

    def on_exception(self, exception: BaseException) -> None:
        global _RUN_FAILED
        _RUN_FAILED = True
        if self.world_size > 1 and _is_peer_failure(exception):
            # gloo/nccl say only "Timed out waiting 15000ms for recv" or "Connection closed by peer".
            exception.add_note(
                f"[trainer-core] rank {self.global_rank}: a collective with the other ranks failed "
                f"(DDPPlugin timeout={self.timeout}). Another rank has died or is hung: its own output says "
                "which and why. Raise `timeout` only if a rank legitimately needs longer (a long rank-0 save)."
            )

    def teardown(self) -> None:
        super().teardown()
        if self._launcher is not None and not self._launcher.children:
            self._launcher = None

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        if not use_distributed_sampler or self.world_size == 1 or not isinstance(dataloader, DataLoader):
            return dataloader
        return with_distributed_sampler(dataloader, kind, self.world_size, self.global_rank)

    # ------------------------------------------------------------------ collectives
    def barrier(self, name: Optional[str] = None) -> None:
        if dist.is_initialized() and self.world_size > 1:
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized() or self.world_size == 1:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src)
        return holder[0]

    def reduce(
        self, tensor: Union[Tensor, float], reduce_op: str = "mean", group: Optional[Any] = None
    ) -> Union[Tensor, float]:
        if not dist.is_initialized() or self.world_size == 1:
            return tensor
        if reduce_op not in _REDUCE_OPS:
            raise MisconfigurationException(f"reduce_op={reduce_op!r}: use one of {', '.join(_REDUCE_OPS)}.")
        value = tensor if isinstance(tensor, Tensor) else torch.tensor(float(tensor))
        value = (
            value.detach()
            .clone()
            .to(self.root_device, dtype=torch.float32 if not value.is_floating_point() else value.dtype)
        )
        dist.all_reduce(value, op=_REDUCE_OPS[reduce_op], group=group)
        if reduce_op == "mean":
            value = value / (self.world_size if group is None else dist.get_world_size(group))
        return value

    def all_gather(self, tensor: Tensor, sync_grads: bool = False, group: Optional[Any] = None) -> Tensor:
        if not dist.is_initialized() or self.world_size == 1:
            return tensor.unsqueeze(0)
        if sync_grads:
            from torch.distributed.nn.functional import all_gather

            return torch.stack(
                all_gather(tensor.contiguous(), group=dist.group.WORLD if group is None else group)
            )
        size = self.world_size if group is None else dist.get_world_size(group)
        gathered = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(gathered, tensor.contiguous(), group=group)
        return torch.stack(gathered)

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not dist.is_initialized() or self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not dist.is_initialized() or self.world_size == 1:
            return decision
        flag = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        return bool(flag.item() == self.world_size) if all else bool(flag.item() > 0)


# Set when this process's run failed: its peers may be gone or blocked, so exit must not wait for them.
_RUN_FAILED = False


def _is_peer_failure(exception: BaseException) -> bool:
    """Whether ``exception`` says a collective timed out or lost its connection to another rank."""
    if isinstance(exception, getattr(dist, "DistBackendError", ())) or isinstance(exception, RuntimeError):
        text = str(exception).lower()
        return any(
            words in text
            for words in ("timed out", "timeout", "connection closed by peer", "connection reset by peer")
        )
    return False


#: How many BatchNorm layer names the warning lists before it says how many more there are.
_NAMES_SHOWN = 3


def batch_norm_layers(module: nn.Module) -> list[str]:
    """Names of the layers that normalise with the statistics of the batch they see (SyncBatchNorm excluded)."""
    from torch.nn.modules.batchnorm import _BatchNorm

    return [
        name or "<root>"
        for name, layer in module.named_modules()
        if isinstance(layer, _BatchNorm) and not isinstance(layer, nn.SyncBatchNorm)
    ]


def warn_if_batch_norm(module: nn.Module, plugin: str, world_size: int, running_stats_note: str) -> None:
    """Warn (rank 0) that BatchNorm under data parallelism is not the one-process function.

    Each rank normalises with the mean and variance of its own part of the global batch, so the
    losses, gradients and weights differ from one process on the whole batch; torch's
    ``SyncBatchNorm`` (which would fix it) runs on GPUs only, so the plugin cannot convert on its own.
    """
    names = batch_norm_layers(module)
    if not names:
        return
    shown = ", ".join(names[:_NAMES_SHOWN]) + (
        f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    )
    rank_zero_warn(
        f"{type(module).__name__} has BatchNorm layers ({shown}) and {plugin} trains it on {world_size} processes: "
        "each process normalises with the mean and variance of its own part of the batch, not of the whole "
        f"batch one process would see, so this run trains a different function than one process; "
        f"{running_stats_note}. To normalise over the whole batch convert the module with "
        "`torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` (on GPUs: SyncBatchNorm does not run on CPU), "
        "or use a normalisation without batch statistics (LayerNorm, GroupNorm).",
        category=UserWarning,
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


def _destroy_process_group() -> None:
    """At interpreter exit: wait for every rank to get here, then tear the groups down together.

    A rank that closes its connections while a peer still uses them makes gloo abort that peer
    ("terminate called without an active exception"), so the teardown waits (10 s at most) for
    all; a process whose run failed does not wait.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if _RUN_FAILED:
        return  # the launcher or the peers' own errors end the others; waiting here would only delay that
    try:
        if dist.get_world_size() > 1:
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=timedelta(seconds=10))
            else:
                dist.barrier()
    except Exception:
        pass  # a rank is gone: nothing to wait for
    dist.destroy_process_group()


class UnrepeatedDistributedSampler(Sampler[int]):
    """Each sample once across ranks (``indices[rank::world]``), for prediction, where padding would duplicate outputs."""

    def __init__(self, length: int, num_replicas: int, rank: int) -> None:
        self.indices = list(range(length))[rank::num_replicas]

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def with_distributed_sampler(loader: DataLoader, kind: str, num_replicas: int, rank: int) -> DataLoader:
    """The same loader with each rank drawing its own part of the data set (Lightning's rule).

    Training shuffles if the user's loader did (seeded from ``seed_everything``, reshuffled per
    epoch through ``set_epoch``); evaluation keeps the order; prediction gives each sample to one
    rank only. A loader with a custom sampler or batch sampler is left alone.
    """
    sampler = loader.sampler
    shuffled = is_random_sampler(sampler)
    if isinstance(sampler, DistributedSampler) or not (shuffled or isinstance(sampler, SequentialSampler)):
        return loader
    if loader.batch_sampler is not None and type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader
    dataset = loader.dataset
    if kind == "predict":
        new_sampler: Sampler = UnrepeatedDistributedSampler(len(dataset), num_replicas, rank)
    else:
        new_sampler = DistributedSampler(
            dataset,
            num_replicas=num_replicas,
            rank=rank,
            shuffle=shuffled and kind == "train",
            seed=int(os.environ.get("PL_GLOBAL_SEED", 0)),
            drop_last=loader.drop_last if kind == "train" else False,
        )
    kwargs: dict[str, Any] = dict(
        batch_size=loader.batch_size,
        sampler=new_sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    if type(loader) is DataLoader:
        return DataLoader(dataset, **kwargs)
    if _is_stateful_loader(loader):
        # A StatefulDataLoader stays one, so that checkpoints keep its position.
        return type(loader)(dataset, **kwargs, snapshot_every_n_steps=loader.snapshot_every_n_steps)
    return DataLoader(dataset, **kwargs)


def is_random_sampler(sampler: Any) -> bool:
    """torch's ``RandomSampler``, or torchdata's stateful one (which does not derive from it)."""
    if isinstance(sampler, RandomSampler):
        return True
    cls = type(sampler)
    return cls.__name__ == "RandomSampler" and cls.__module__.startswith("torchdata.")


def _is_stateful_loader(loader: Any) -> bool:
    cls = type(loader)
    return cls.__name__ == "StatefulDataLoader" and cls.__module__.startswith("torchdata.")
