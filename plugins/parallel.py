"""``ParallelPlugin``: what every multi-process plugin shares, and the data-parallel helpers.

Processes (the cluster environment, ranks, the launcher, the process group), the collectives the
Trainer asks for, the split of the data across ranks and the warning for layers that mix samples
live here once. ``DDPPlugin`` adds the ``DistributedDataParallel`` wrapper; ``FSDPPlugin``,
``PipelinePlugin`` and ``ModelParallelPlugin`` add their own sharding. Which ranks form which group
of an N-D layout is ``ParallelDims``'s business (``plugins/parallel_dims.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import tempfile
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler, SequentialSampler

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.base import TrainingTypePlugin
from trainer_core.plugins.environments import (
    ClusterEnvironment,
    check_environment_argument,
    detect_environment,
)

# Kept importable from here (job scripts measure norms with it); it lives with the clipping rule.
from trainer_core.plugins.grad_norm import total_grad_norm as total_grad_norm
from trainer_core.plugins.launchers import ScriptLauncher, SpawnLauncher, refuse_relaunch
from trainer_core.plugins.parallel_dims import DATA, ParallelDims
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO
    from trainer_core.trainer import Trainer

#: How long a rank waits in a collective for the others before giving up with an error.
DEFAULT_TIMEOUT = timedelta(minutes=10)

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class ParallelPlugin(TrainingTypePlugin):
    """Several processes, ``devices`` per node on ``num_nodes`` nodes, in one process group.

    Started by re-running the script (``"popen"``, the default), by ``spawn``/``fork``/``forkserver``,
    or by an outside launcher (torchrun, SLURM: ``cluster_environment``). Collectives run over the
    whole world unless a ``group`` is given.
    """

    name = "parallel"

    def __init__(
        self,
        start_method: str = "popen",
        process_group_backend: Optional[str] = None,
        timeout: timedelta = DEFAULT_TIMEOUT,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise MisconfigurationException(
                f"{type(self).__name__}(start_method={start_method!r}): use 'popen' (re-run the script), 'spawn', "
                "'fork' or 'forkserver'."
            )
        self.start_method = start_method
        self.process_group_backend = process_group_backend
        self.timeout = timeout
        self.cluster_environment = check_environment_argument(type(self).__name__, cluster_environment)
        self._device_type = "cpu"
        self._num_devices = 1
        self._num_nodes = 1
        self._launcher: Any = None
        # (parent, attribute, original layer) for each BatchNorm that sync_batchnorm replaced this run.
        self._replaced_batch_norm: list[tuple[nn.Module, str, nn.Module]] = []

    # ------------------------------------------------------------------ processes
    def configure_devices(self, device_type: str, num_devices: int, num_nodes: int) -> None:
        self._device_type = device_type
        self._num_devices = num_devices
        self._num_nodes = num_nodes
        if self.cluster_environment is None:
            self.cluster_environment = detect_environment(num_devices, num_nodes)
        env = self.cluster_environment
        self._tell_environment_ranks()
        if env.creates_processes_externally and not dist.is_initialized():
            env.validate(num_devices, num_nodes)
        if self._starts_processes():
            refuse_relaunch(env)

    def _tell_environment_ranks(self) -> None:
        """Lightning's ``set_world_size``/``set_global_rank``, for an environment that learns its ranks from us."""
        env = self._env
        own = type(env)
        if (
            own.set_world_size is ClusterEnvironment.set_world_size
            and own.set_global_rank is ClusterEnvironment.set_global_rank
        ):
            return
        env.set_world_size(self._num_devices * self._num_nodes)
        env.set_global_rank(env.node_rank() * self._num_devices + env.local_rank())

    def _starts_processes(self) -> bool:
        """Whether ``launch`` starts the ranks here: no one else started them and none runs yet."""
        env = self._env
        return not (env.creates_processes_externally or self.world_size == 1 or dist.is_initialized())

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
        if not self._starts_processes():
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
        self._tell_environment_ranks()
        os.environ.setdefault("MASTER_ADDR", env.main_address)
        os.environ.setdefault("MASTER_PORT", str(env.main_port))
        if self._device_type == "cuda":
            torch.cuda.set_device(self.root_device)
        store = env.process_group_store(self.timeout)
        dist.init_process_group(
            self.backend,
            init_method=None if store is not None else "env://",
            store=store,
            rank=self.global_rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        # Kept for later fit/test calls in this process, but destroyed before the interpreter
        # exits: left to static destructors, gloo can abort the process at exit (SIGABRT).
        atexit.register(_destroy_process_group)

    @property
    def parallel_dims(self) -> ParallelDims:
        """Every rank a data-parallel replica; plugins that split the model override this."""
        return ParallelDims(self.world_size, owner=type(self).__name__)

    # ------------------------------------------------------------------ model
    def setup(self, trainer: Trainer) -> None:
        if trainer.state_stage == "fit":
            self.check_module_for_data_parallel()
        super().setup(trainer)

    def check_module_for_data_parallel(self) -> None:
        """Say, before training, where this module computes another function than one process would.

        Every data-parallel plugin (DDP, ShardedDDP, ZeRO, FSDP, model parallel) calls this from its ``setup``,
        before it moves, wraps or shards the module: gradients are averaged, so a module whose forward
        treats samples independently trains exactly as one process on the combined batch; a layer that
        mixes samples (BatchNorm) does not, unless ``Trainer(sync_batchnorm=True)`` converts it here to
        :class:`SyncBatchNorm` over the data-parallel ranks (undone in ``teardown``, as in Lightning).
        """
        module = self._lightning_module
        if module is None or self.world_size == 1:
            return
        trainer = self.trainer
        dims = self.parallel_dims
        if trainer is not None and getattr(trainer, "sync_batchnorm", False) and dims.dp > 1:
            group = None if dims.dp == self.world_size else dims.submesh(DATA).get_group()
            self._replaced_batch_norm += convert_sync_batch_norm(module, self.root_device.type, group)
        warn_if_batch_norm(module, type(self).__name__, self.world_size, self._running_stats_note())

    def _running_stats_note(self) -> str:
        """What becomes of BatchNorm's running statistics across ranks under this plugin."""
        return "every rank keeps running statistics of its own samples, and the checkpoint holds rank 0's"

    def on_exception(self, exception: BaseException) -> None:
        global _RUN_FAILED
        _RUN_FAILED = True
        if self.world_size > 1 and _is_peer_failure(exception):
            # gloo/nccl say only "Timed out waiting 15000ms for recv" or "Connection closed by peer".
            exception.add_note(
                f"[trainer-core] rank {self.global_rank}: a collective with the other ranks failed "
                f"({type(self).__name__} timeout={self.timeout}). Another rank has died or is hung: its own output says "
                "which and why. Raise `timeout` only if a rank legitimately needs longer (a long rank-0 save)."
            )

    def teardown(self) -> None:
        super().teardown()
        revert_sync_batch_norm(self._replaced_batch_norm)
        self._replaced_batch_norm = []
        if self._launcher is not None and not self._launcher.children:
            self._launcher = None

    # ------------------------------------------------------------------ data
    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """The data-parallel share of this rank, as ``ParallelDims`` places it in the layout."""
        return self.parallel_dims.distributed_sampler_kwargs(self.global_rank)

    def process_dataloader(self, dataloader: Any, kind: str, use_distributed_sampler: bool) -> Any:
        # At world size 1 too, as Lightning: the sampler's order (seed + epoch) is the one of every world
        # size, so a run that shrank to one process (torchrun --nnodes 1:N) or grows from one continues
        # after exactly the samples the checkpoint had seen; a RandomSampler would draw another order.
        if not use_distributed_sampler or not isinstance(dataloader, DataLoader):
            return dataloader
        return with_distributed_sampler(dataloader, kind, **self.distributed_sampler_kwargs)

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
        if hasattr(
            value, "full_tensor"
        ):  # a DTensor (a loss under loss_parallel): all_reduce takes plain tensors
            value = value.full_tensor()
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

    # ------------------------------------------------------------------ checkpoint files
    @property
    def _writes_sharded_checkpoints(self) -> bool:
        """Whether a checkpoint is a folder every rank writes its own shards into (``DistributedCheckpointIO``).

        ``False`` here: every rank holds the whole state and global rank 0 writes one file. Plugins
        that shard the state say when they write shards instead.
        """
        return False

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str, storage_options: Optional[Any] = None
    ) -> None:
        """The one rule for every plugin: a folder of shards written by every rank, or one file by global rank 0."""
        if not self._writes_sharded_checkpoints:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        io = self.checkpoint_io.unwrapped
        if not isinstance(io, DistributedCheckpointIO):
            raise MisconfigurationException(
                f"{type(self).__name__} writes sharded checkpoints with DistributedCheckpointIO, but the run was "
                f"given {type(io).__name__}; drop that CheckpointIO from `plugins=`, or write full checkpoints "
                "(FSDPPlugin(state_dict_type='full'), ModelParallelPlugin(save_distributed_checkpoint=False))."
            )
        from trainer_core.checkpoint import KEY_OPTIMIZER_STATES, refuse_fields_of_sharded_states

        refuse_fields_of_sharded_states(checkpoint.get(KEY_OPTIMIZER_STATES, []), type(self).__name__)
        # A collective: every rank writes its own shards.
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def _sharded_state_template(self, io: DistributedCheckpointIO, filepath: str) -> dict[str, Any]:
        """This rank's own tensors and optimizer states, for ``io`` (DCP) to fill from the sharded folder ``filepath``.

        Asked of plugins whose state loads only into the shards ``setup`` makes
        (``restore_checkpoint_after_setup``); the keys are the checkpoint's, the tensors this rank's.
        """
        raise NotImplementedError(f"{type(self).__name__} must define `_sharded_state_template`.")

    def _load_sharded(self, filepath: str) -> dict[str, Any]:
        """The sharded folder ``filepath`` read straight into this rank's shards (resharded by DCP)."""
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        io = self.checkpoint_io.unwrapped
        if not isinstance(io, DistributedCheckpointIO):
            io = DistributedCheckpointIO()
        return io.load_into(filepath, self._sharded_state_template(io, filepath))

    def load_checkpoint(self, filepath: str) -> dict[str, Any]:
        """A sharded folder loads into this rank's shards where the plugin holds shards; a file whole.

        A file on an object store is downloaded once per node and mapped by every rank there
        (:meth:`_load_downloaded_once_per_node`); local files, folders and one-process runs load whole.
        """
        if self.restore_checkpoint_after_setup and dist.is_initialized():
            from trainer_core.plugins.io.readers import is_sharded_checkpoint

            if is_sharded_checkpoint(filepath):
                return self._load_sharded(filepath)
        shared = self._shared_download(filepath)
        if shared is None:
            return super().load_checkpoint(filepath)
        return self._load_downloaded_once_per_node(filepath, *shared)

    def _load_downloaded_once_per_node(self, filepath: str, fs: Any, fs_path: str) -> dict[str, Any]:
        """The object-store file ``filepath``, downloaded by the node's local rank 0 and loaded by every rank.

        Each rank reading the store itself would fetch the file once per rank and hold as many
        copies in the node's memory; instead the node's local rank 0 downloads it to a local
        temporary file, every rank of the node loads that file (mapped: its pages sit once in the
        page cache, and each rank copies out only what it keeps), and the file is removed once all
        have loaded.
        """
        from trainer_core.errors import CheckpointError
        from trainer_core.plugins.io.object_store import download_to_local
        from trainer_core.plugins.io.torch_io import prefetched

        token = self.broadcast(uuid.uuid4().hex if self.is_global_zero else None)
        name = f".trainer-core-load-{token}-node{self.node_rank}.ckpt"
        local_path = os.path.join(tempfile.gettempdir(), name)
        try:
            error: Optional[str] = None
            if self.local_rank == 0:
                try:
                    concurrency = getattr(self.checkpoint_io.unwrapped, "transfer_concurrency", None)
                    options = {"concurrency": concurrency} if concurrency else {}
                    download_to_local(fs, fs_path, local_path, **options)
                except Exception as err:
                    error = f"Could not download the checkpoint {filepath} (node {self.node_rank}): {err}"
            # Also the barrier after which every node has its copy.
            failed = [e for e in self.all_gather_object(error) if e is not None]
            if failed:
                raise CheckpointError(
                    f"{failed[0]}. Nothing was loaded; check the connection and credentials and load again."
                )
            checkpoint: Optional[dict[str, Any]] = None
            load_error: Optional[Exception] = None
            try:
                with prefetched(fs, fs_path, local_path):
                    checkpoint = self.checkpoint_io.load_checkpoint(filepath)
            except Exception as err:
                load_error = err
            # Every rank has mapped (or read) the file before it is removed.
            failed = [e for e in self.all_gather_object(None if load_error is None else str(load_error)) if e]
        finally:
            if self.local_rank == 0:
                with contextlib.suppress(OSError):
                    os.remove(local_path)
        if load_error is not None:
            raise load_error
        if failed:
            raise CheckpointError(f"Another rank could not load the checkpoint {filepath}: {failed[0]}")
        assert checkpoint is not None
        return checkpoint

    def _shared_download(self, filepath: str) -> Optional[tuple[Any, str]]:
        """``(filesystem, path)`` of a single checkpoint file on an object store, for a run of several processes."""
        from fsspec.implementations.memory import MemoryFileSystem

        from trainer_core.paths import is_local

        if self.world_size == 1 or not dist.is_initialized():
            return None
        try:
            fs, fs_path = self.checkpoint_io.unwrapped._resolve(filepath)
            # Local disk (mapped directly), a sharded folder (DCP), or missing (the plain load says so).
            if is_local(fs) or isinstance(fs, MemoryFileSystem) or not fs.isfile(fs_path):
                return None
        except Exception:
            return None  # an unknown protocol or unreachable store: the plain load reports it
        return fs, fs_path


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
    return [
        name or "<root>"
        for name, layer in module.named_modules()
        if isinstance(layer, _BatchNorm) and not isinstance(layer, _SYNCED)
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
        f"{running_stats_note}. To normalise over the whole batch pass `Trainer(sync_batchnorm=True)` (on CPU "
        "too; torch's `torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)` runs on GPUs only), "
        "or use a normalisation without batch statistics (LayerNorm, GroupNorm).",
        category=UserWarning,
    )


class CPUSyncBatchNorm(_BatchNorm):
    """What torch's ``SyncBatchNorm`` computes, on CPU (gloo), where torch's layer and DDP refuse it.

    In training, each rank's layer normalises with the mean and variance of the whole batch across
    ``process_group`` (two differentiable all-reduces: the sums, then the squared deviations from the
    mean) and updates its running statistics with them, as one process on the whole batch would; its
    backward sums the gradients of those statistics over the ranks. In evaluation, and on one
    process, it is a plain BatchNorm layer of any dimension.
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Optional[Any] = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: Tensor) -> Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(input)
        group = self.process_group or dist.group.WORLD
        if dist.get_world_size(group) == 1:
            return super().forward(input)
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average, as torch's layer
                factor = 1.0 / float(self.num_batches_tracked)
        dims = [0, *range(2, input.dim())]
        shape = [1, -1] + [1] * (input.dim() - 2)
        count = input.new_tensor([input.numel() // input.shape[1]])
        sums = _SumOverRanks.apply(torch.cat([input.sum(dims), count]), group)
        total = sums[-1]
        mean = sums[:-1] / total
        centered = input - mean.view(shape)
        var = _SumOverRanks.apply(centered.pow(2).sum(dims), group) / total
        output = centered * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            output = output * self.weight.view(shape) + self.bias.view(shape)
        if self.track_running_stats:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.detach(), alpha=factor)
                unbiased = var.detach() * total / (total - 1)
                self.running_var.mul_(1 - factor).add_(unbiased, alpha=factor)
        return output


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over the ranks of ``group``; its gradient is the sum of the ranks' gradients."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        total = tensor.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def convert_sync_batch_norm(
    module: nn.Module, device_type: str, process_group: Optional[Any] = None
) -> list[tuple[nn.Module, str, nn.Module]]:
    """Replace every BatchNorm layer under ``module`` by a synchronised one over ``process_group``.

    torch's ``SyncBatchNorm`` on GPUs, :class:`CPUSyncBatchNorm` on CPU. The new layers hold the same
    parameters (so optimizers made later see them) and buffers. Returns (parent, attribute, original
    layer) per replacement, for :func:`revert_sync_batch_norm`.
    """
    layer_class = CPUSyncBatchNorm if device_type == "cpu" else nn.SyncBatchNorm
    replaced: list[tuple[nn.Module, str, nn.Module]] = []
    for parent in list(module.modules()):
        for name, layer in list(parent.named_children()):
            if not isinstance(layer, _BatchNorm) or isinstance(layer, _SYNCED):
                continue
            sync = layer_class(
                layer.num_features,
                layer.eps,
                layer.momentum,
                layer.affine,
                layer.track_running_stats,
                process_group,
            )
            _move_state(layer, sync)
            setattr(parent, name, sync)
            replaced.append((parent, name, layer))
    return replaced


def revert_sync_batch_norm(replaced: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """Put the original BatchNorm layers back, holding the parameters and statistics the run reached."""
    for parent, name, original in reversed(replaced):
        sync = getattr(parent, name)
        if isinstance(sync, _SYNCED):
            _move_state(sync, original)
            setattr(parent, name, original)


def _move_state(source: nn.Module, target: nn.Module) -> None:
    """``target`` takes ``source``'s parameters and buffers (the same tensors) and its train/eval mode."""
    for key, param in source._parameters.items():
        target._parameters[key] = param
    for key, buffer in source._buffers.items():
        target._buffers[key] = buffer
    target.train(source.training)
    if hasattr(source, "qconfig"):
        target.qconfig = source.qconfig


#: Layers that already normalise over every data-parallel rank.
_SYNCED = (nn.SyncBatchNorm, CPUSyncBatchNorm)


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
    """The same loader with each rank drawing its own part of the data set.

    Training shuffles if the user's loader did (seeded from ``seed_everything``, reshuffled per
    epoch through ``set_epoch``); evaluation keeps the order; prediction gives each sample to one
    rank only. A loader with a custom sampler is left alone; a custom batch sampler is made again around
    the rank's sampler, as Lightning does (``_rebuilt_batch_sampler``). Unlike Lightning, which
    shuffles every distributed training loader, a loader the user did not shuffle stays in order, so
    that a run on several processes sees the batches one process would.
    """
    batch_sampler = loader.batch_sampler
    custom = batch_sampler is not None and type(batch_sampler).__name__ != "BatchSampler"
    # A batch sampler of the user's own draws from the sampler it was given (the loader's is a placeholder).
    sampler = getattr(batch_sampler, "sampler", loader.sampler) if custom else loader.sampler
    shuffled = is_random_sampler(sampler)
    if isinstance(sampler, DistributedSampler) or not (shuffled or isinstance(sampler, SequentialSampler)):
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
    if custom:
        rebuilt = _rebuilt_batch_sampler(batch_sampler, new_sampler, kind)
        return loader if rebuilt is None else loader_with_sampler(loader, new_sampler, batch_sampler=rebuilt)
    return loader_with_sampler(loader, new_sampler)


def _rebuilt_batch_sampler(batch_sampler: Any, sampler: Sampler, kind: str) -> Any:
    """The user's batch sampler, of its own class, around this rank's ``sampler`` (Lightning's rule).

    A class that follows torch's ``BatchSampler(sampler, batch_size, drop_last)`` is made again with the
    rank's sampler; another cannot be split, which is an error (prediction keeps it, with a warning).
    """
    cls = type(batch_sampler)
    problem = None
    if hasattr(batch_sampler, "batch_size") and hasattr(batch_sampler, "drop_last"):
        drop_last = False if kind == "predict" else batch_sampler.drop_last
        try:
            return cls(sampler, batch_size=batch_sampler.batch_size, drop_last=drop_last)
        except TypeError as error:
            problem = f"`{cls.__name__}(sampler, batch_size=..., drop_last=...)` failed ({error})"
    else:
        problem = f"`{cls.__name__}` has no `batch_size` and `drop_last`, as torch's `BatchSampler` does"
    if kind == "predict":
        rank_zero_warn(
            f"The predict dataloader's batch sampler {problem}: every process predicts all its batches."
        )
        return None
    raise MisconfigurationException(
        f"The {kind} dataloader's batch sampler cannot be given each process's part of the data: {problem}. "
        f"Make `{cls.__name__}` take `(sampler, batch_size, drop_last)` like torch's `BatchSampler`, or set "
        "`Trainer(use_distributed_sampler=False)` and split the data across processes in the batch sampler."
    )


def loader_with_sampler(loader: DataLoader, sampler: Sampler, batch_sampler: Any = None) -> DataLoader:
    """A copy of ``loader`` (batch size, workers, collate function, ...) that draws its indices from ``sampler``.

    For a loader with torch's own ``BatchSampler``, or with ``batch_sampler`` (a user's own, made again
    around ``sampler``); the distributed split and ``Trainer(overfit_batches=...)`` (which turns
    shuffling off) build their loaders here.
    """
    batching: dict[str, Any] = (
        dict(batch_sampler=batch_sampler)
        if batch_sampler is not None
        else dict(batch_size=loader.batch_size, sampler=sampler, drop_last=loader.drop_last)
    )
    kwargs: dict[str, Any] = dict(
        **batching,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    dataset = loader.dataset
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
