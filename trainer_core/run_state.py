"""What the core's lower layers see of a run, instead of the ``Trainer``: small protocols and one record.

The Trainer sits at the top of the core; the loops, the hooks, the metrics, the module and the
checkpoint code sit below it and must not import it (no import circle, ``TYPE_CHECKING`` imports
included: ``tests/core/test_layers.py``). They type against these protocols, which name only the
members they use; the Trainer satisfies each of them structurally.

The checkpoint code sees even less: :class:`CheckpointParts`, the named stateful parts of a run
that the Trainer assembles (``Trainer.checkpoint_parts()``), as torchtitan's checkpointer takes a
``dict[str, Stateful]`` and never sees its trainer. The callbacks' checkpoint hooks still receive
the Trainer (Lightning's signature): they are called through :class:`CheckpointHooks`, the hook
runner, which holds it.

This module imports, for its types only, ``loops.progress`` (the loop state, itself a leaf), so
anything in the core may import it. Types that live above it (the plugin, the module, the hook
runner) are ``Any`` here, with their class named in a comment.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from trainer_core.loops.progress import Progress


class CheckpointPlugin(Protocol):
    """What the checkpoint code asks of the training-type plugin (``trainer_core.plugins.TrainingTypePlugin``)."""

    name: str
    precision: Any  # trainer_core.precision.Precision
    checkpoint_io: Any  # trainer_core.plugins.io.CheckpointIO

    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def optimizers(self) -> list[Optimizer]: ...
    @property
    def lr_scheduler_configs(self) -> list[Any]: ...
    @property
    def distributed_sampler_kwargs(self) -> Optional[dict[str, Any]]: ...
    @property
    def mid_accumulation_gradients_unsaved(self) -> Optional[str]: ...
    def layout(self) -> Any: ...
    def lightning_module_state_dict(self) -> dict[str, Any]: ...
    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]: ...
    def all_gather_object(self, obj: Any) -> list[Any]: ...
    def load_checkpoint(self, path: str) -> dict[str, Any]: ...
    def load_model_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None: ...
    def prepare_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any], path: str) -> Any: ...
    def load_optimizer_state_dict(self, optimizer: Optimizer, state: Any) -> None: ...
    def plugin_state_dict(self) -> dict[str, Any]: ...
    def load_plugin_state_dict(self, state: dict[str, Any]) -> None: ...
    def accumulated_gradients(self, module: Any) -> dict[str, Any]: ...


class CheckpointHooks(Protocol):
    """The user's checkpoint hooks, as the hook runner (``trainer_core.hooks.HookRunner``) calls them."""

    def call_module(self, name: str, *args: Any, **kwargs: Any) -> Any: ...
    def call_callbacks_on_checkpoint(self, name: str, checkpoint: dict[str, Any]) -> None: ...
    def setup_callback(self, callback: Any, stage: str) -> None: ...
    def running(self, name: str) -> AbstractContextManager[None]: ...


def _no_metrics() -> Mapping[str, Any]:
    return {}


def _ignore_path(path: str) -> None:
    pass


@dataclass
class CheckpointParts:
    """The named stateful parts of a run that a checkpoint saves and a restore puts back.

    Assembled by ``Trainer.checkpoint_parts()`` when a checkpoint is written or read, so every part is
    the run's current one (its train loader, its data module). The epoch, the step and the loop
    position are ``progress``'s; the ranks, the optimizers and the schedulers are the plugin's.
    """

    #: The ``LightningModule`` being trained (``trainer_core.module.LightningModule``).
    module: Any
    #: Model and optimizer state (under the consolidation rule), collectives, precision, the checkpoint IO.
    plugin: CheckpointPlugin
    #: The loop counters and the resume plan (``trainer.progress``).
    progress: Progress
    #: The user's module and callback hooks (``trainer.hook_runner``).
    hooks: CheckpointHooks
    #: Callbacks in the run's order: their ``state_dict`` / ``load_state_dict`` under ``state_key``.
    callbacks: Sequence[Any] = ()
    #: The run's ``LightningDataModule``, or ``None``.
    datamodule: Any = None
    #: The training loader now in use (its position and batch size are saved), or ``None``.
    train_dataloader: Any = None
    accumulate_grad_batches: int = 1
    #: ``trainer.callback_metrics``, read only when a ReduceLROnPlateau step is pending (reading brings
    #: the step's latest values in).
    callback_metrics: Callable[[], Mapping[str, Any]] = _no_metrics
    #: The ``ModelCheckpoint`` callbacks, whose folders ``ckpt_path="last"`` and ``"best"`` search.
    checkpoint_callbacks: Sequence[Any] = field(default_factory=list)
    #: Why ``fit`` resumes without being given a path (a launcher's restart), for its messages.
    resume_reason: str = ""
    #: Told the path once its weights are loaded (the Trainer records it as ``trainer.ckpt_path``).
    restored_from: Callable[[str], None] = _ignore_path
    #: ``fit/validate/test/predict(weights_only=False)``: the user trusts ``ckpt_path``, which is unpickled whole.
    trusted_checkpoint: bool = False


class MetricsRunState(Protocol):
    """What ``trainer_core.metrics.Metrics`` reads of the run."""

    progress: Progress
    loggers: list[Any]

    @property
    def current_epoch(self) -> int: ...


class HookRunState(Protocol):
    """What the hook runner (``trainer_core.hooks``) reads of the run."""

    callbacks: list[Any]
    datamodule: Any
    lightning_module: Any
    hook_runner: Any  # trainer_core.hooks.HookRunner
    gradient_clip_val: Optional[Union[int, float]]
    gradient_clip_algorithm: Optional[str]


class RunState(HookRunState, MetricsRunState, Protocol):
    """The run as the loops, the module, the data module and the signal handling see it (the ``Trainer``).

    Lightning's attribute names; the members these modules use, and those a ``LightningModule``'s
    ``self.trainer`` offers its user most (``trainer_core.trainer.Trainer`` documents each).
    """

    plugin: Any  # trainer_core.plugins.TrainingTypePlugin
    metrics: Any  # trainer_core.metrics.Metrics
    profiler: Any  # trainer_core.profilers.Profiler
    lightning_optimizers: list[Any]
    fit_loop: Any
    predict_loop: Any
    state_stage: Optional[str]
    training: bool
    sanity_checking: bool
    validating_in_fit: bool
    should_stop: bool
    interrupted: bool
    preempted: bool
    train_dataloader: Any
    val_dataloaders: Any
    test_dataloaders: Any
    predict_dataloaders: Any
    num_training_batches: Union[int, float]
    num_val_batches: list[Union[int, float]]
    num_test_batches: list[Union[int, float]]
    num_predict_batches: list[Union[int, float]]
    val_check_batch: Union[int, float]
    max_epochs: int
    min_epochs: Optional[int]
    max_steps: int
    min_steps: Optional[int]
    limit_train_batches: Union[int, float]
    limit_val_batches: Union[int, float]
    limit_test_batches: Union[int, float]
    limit_predict_batches: Union[int, float]
    overfit_batches: Union[int, float]
    val_check_interval: Union[int, float]
    check_val_every_n_epoch: Optional[int]
    num_sanity_val_steps: int
    log_every_n_steps: int
    accumulate_grad_batches: int
    reload_dataloaders_every_n_epochs: int
    inference_mode: bool
    use_distributed_sampler: bool
    detect_anomaly: bool
    ckpt_path: Optional[str]

    @property
    def global_step(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def local_rank(self) -> int: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def optimizers(self) -> list[Optimizer]: ...
    @property
    def lr_scheduler_configs(self) -> list[Any]: ...
    @property
    def callback_metrics(self) -> dict[str, Any]: ...
    @property
    def logger(self) -> Any: ...
    @property
    def log_dir(self) -> Optional[str]: ...
    @property
    def default_root_dir(self) -> str: ...
    @property
    def checkpoint_callback(self) -> Any: ...
    @property
    def estimated_stepping_batches(self) -> Union[int, float]: ...
    def checkpoint_parts(self) -> CheckpointParts: ...
    def save_checkpoint(
        self, filepath: Any, weights_only: bool = False, storage_options: Any = None
    ) -> None: ...


__all__ = [
    "CheckpointHooks",
    "CheckpointParts",
    "CheckpointPlugin",
    "HookRunState",
    "MetricsRunState",
    "RunState",
]
