"""``TrainerConfig``: the Trainer's run settings, under Lightning's names, checked where they are given.

``Trainer.__init__`` builds one from its arguments; ``__post_init__`` checks every value (each error
names the argument and what to pass instead) and resolves the settings that depend on others
(``fast_dev_run`` and ``overfit_batches`` override the limits, ``max_epochs`` has no default under a
time limit). The resolved fields become the Trainer's plain attributes (``trainer.max_epochs``,
``trainer.limit_val_batches``...): the loops read several of them on every step, and the tuner and
callbacks change some during a run, so the config is a record of construction, not the live state.
What needs the plugin (``optimizer_in_backward``) or builds parts (plugin, loggers, callbacks) is
checked by the Trainer and ``trainer_core.connectors``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import InitVar, dataclass
from types import MappingProxyType
from typing import Any, Optional, Union

from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

_logger = logging.getLogger("trainer_core")

# The limits ``fast_dev_run`` and ``overfit_batches`` override, each checked as ``limit_*_batches``.
_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")
# The other limit-like argument: a fraction of the data or a number of batches.
_LIMIT_LIKE = (*_LIMITS, "val_check_interval")


def validate_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisconfigurationException(f"Trainer({name}={value!r}): use a positive integer.")
    return value


def validate_non_negative_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MisconfigurationException(f"Trainer({name}={value!r}): use 0 (off) or a positive integer.")
    return value


def validate_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MisconfigurationException(f"Trainer({name}={value!r}): use True or False.")
    return value


def validate_limit(name: str, value: Optional[Union[int, float]]) -> Union[int, float]:
    """``limit_*_batches`` and ``val_check_interval``: a fraction in [0, 1] or a number of batches."""
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MisconfigurationException(
            f"Trainer({name}={value!r}): use a fraction in [0.0, 1.0] or a number of batches."
        )
    if isinstance(value, float):
        if not 0.0 <= value <= 1.0:
            raise MisconfigurationException(
                f"Trainer({name}={value!r}): a float is a fraction of the data in [0.0, 1.0]; pass an int for a number of batches."
            )
        return value
    if value < 0:
        raise MisconfigurationException(f"Trainer({name}={value!r}): a number of batches cannot be negative.")
    return value


@dataclass
class TrainerConfig:
    """The run settings of ``Trainer(...)``, each field named as Lightning's argument and attribute.

    Construct it with the user's values; after ``__post_init__`` every field holds the value the run
    uses (defaults filled in, overrides applied). ``timed`` (not a field): whether a time limit bounds
    the run (``max_time`` or a ``Timer`` among the callbacks), which lifts the default of ``max_epochs``.
    """

    #: ``fast_dev_run``: ``True`` (one batch) or a number of batches of every stage, one epoch, no sanity
    #: check, no loggers: a smoke test of the code. Kept as given; it overrides the limits below.
    fast_dev_run: Union[bool, int] = False
    #: ``max_epochs``: stop after this many epochs (``-1``: no limit). ``None``: 1000, or no limit when
    #: ``max_steps`` or a time limit bounds the run (Lightning's rule).
    max_epochs: Optional[int] = None
    #: ``min_epochs``: train at least this many epochs, even if a callback asks to stop earlier.
    min_epochs: Optional[int] = None
    #: ``max_steps``: stop after this many optimizer steps (``-1``: no limit).
    max_steps: int = -1
    #: ``min_steps``: train at least this many optimizer steps, even if a callback asks to stop earlier.
    min_steps: Optional[int] = None
    #: ``limit_train_batches``: the share (float in [0, 1]) or number (int) of training batches per epoch.
    limit_train_batches: Optional[Union[int, float]] = None
    #: ``limit_val_batches``: the same for each validation run (``0``: no validation).
    limit_val_batches: Optional[Union[int, float]] = None
    #: ``limit_test_batches``: the same for ``trainer.test``.
    limit_test_batches: Optional[Union[int, float]] = None
    #: ``limit_predict_batches``: the same for ``trainer.predict``.
    limit_predict_batches: Optional[Union[int, float]] = None
    #: ``overfit_batches``: train and validate on the same first batches (share or number), in order.
    overfit_batches: Union[int, float] = 0.0
    #: ``val_check_interval``: validate after this share of an epoch (float) or number of batches (int).
    val_check_interval: Optional[Union[int, float]] = None
    #: ``check_val_every_n_epoch``: validate every n-th epoch (``None``: by ``val_check_interval`` only).
    check_val_every_n_epoch: Optional[int] = 1
    #: ``num_sanity_val_steps``: validation batches run before training (``-1``: all); ``None``: 2.
    num_sanity_val_steps: Optional[int] = None
    #: ``log_every_n_steps``: how often values logged in training steps reach the loggers; ``None``: 50.
    log_every_n_steps: Optional[int] = None
    #: ``accumulate_grad_batches``: batches whose gradients add up before each optimizer step.
    accumulate_grad_batches: int = 1
    #: ``gradient_clip_val``: clip gradients to this norm or value before each step (``None``/``0``: no clipping).
    gradient_clip_val: Optional[Union[int, float]] = None
    #: ``gradient_clip_algorithm``: ``"norm"`` (the total norm, the default) or ``"value"`` (each element).
    gradient_clip_algorithm: Optional[str] = None
    #: ``deterministic``: torch's deterministic algorithms (``True``; ``"warn"``: warn where none exists).
    deterministic: Optional[Union[bool, str]] = None
    #: ``benchmark``: ``torch.backends.cudnn.benchmark``; ``None`` keeps the session's setting, off when
    #: ``deterministic`` (cuDNN's benchmark picks algorithms by timing them).
    benchmark: Optional[bool] = None
    #: ``inference_mode``: evaluate under ``torch.inference_mode`` (else ``torch.no_grad``).
    inference_mode: bool = True
    #: ``use_distributed_sampler``: give each rank its share of the data through a distributed sampler.
    use_distributed_sampler: bool = True
    #: ``detect_anomaly``: ``torch.autograd.detect_anomaly`` around training, to find where NaNs come from.
    detect_anomaly: bool = False
    #: ``sync_batchnorm``: batch norm statistics over all ranks (``SyncBatchNorm``).
    sync_batchnorm: bool = False
    #: ``reload_dataloaders_every_n_epochs``: make the dataloaders anew every n epochs (``0``: never).
    reload_dataloaders_every_n_epochs: int = 0
    #: ``enable_model_summary``: print the module's summary when fit starts; ``None``: ``True``.
    enable_model_summary: Optional[bool] = None
    #: ``optimizer_in_backward``: each parameter steps as soon as its gradient is computed (trainer-core's own).
    optimizer_in_backward: bool = False
    #: Not a setting: whether ``max_time`` or a ``Timer`` callback bounds the run (no ``max_epochs`` default then).
    timed: InitVar[bool] = False

    def __post_init__(self, timed: bool) -> None:
        # The order the Trainer has always checked in: of several bad values, the same one is named first.
        self._apply_fast_dev_run()
        self._apply_overfit_batches()
        if self.max_epochs is None:
            self.max_epochs = 1000 if self.max_steps == -1 and not timed else -1
        if not isinstance(self.max_steps, int) or self.max_steps < -1:
            raise MisconfigurationException(
                f"Trainer(max_steps={self.max_steps!r}): use -1 (no limit) or a non-negative integer."
            )
        for name in _LIMIT_LIKE:
            setattr(self, name, validate_limit(name, getattr(self, name)))
        if self.check_val_every_n_epoch is not None:
            validate_positive_int("check_val_every_n_epoch", self.check_val_every_n_epoch)
        self._check_counts()
        self._check_clipping()
        self.optimizer_in_backward = bool(self.optimizer_in_backward)
        self._check_backend_switches()
        if self.enable_model_summary is None:
            self.enable_model_summary = True

    def _apply_fast_dev_run(self) -> None:
        if not self.fast_dev_run:
            return
        if isinstance(self.fast_dev_run, bool):
            n_dev = 1
        elif isinstance(self.fast_dev_run, int) and self.fast_dev_run > 0:
            n_dev = self.fast_dev_run
        else:
            raise MisconfigurationException(
                f"Trainer(fast_dev_run={self.fast_dev_run!r}): use True or a positive number of batches."
            )
        for name in _LIMITS:
            setattr(self, name, n_dev)
        self.max_steps, self.max_epochs, self.num_sanity_val_steps, self.val_check_interval = n_dev, 1, 0, 1.0
        self.check_val_every_n_epoch = 1

    def _apply_overfit_batches(self) -> None:
        overfit = 0.0 if self.overfit_batches is None else self.overfit_batches
        self.overfit_batches = validate_limit("overfit_batches", overfit)
        if self.overfit_batches > 0:
            # Lightning's rule: the same first batches of the train and val loaders, whatever their limits say.
            self.limit_train_batches = self.limit_val_batches = self.overfit_batches

    def _check_counts(self) -> None:
        given = self.num_sanity_val_steps
        self.num_sanity_val_steps = 2 if given is None else given
        if not isinstance(self.num_sanity_val_steps, int) or self.num_sanity_val_steps < -1:
            raise MisconfigurationException(
                f"Trainer(num_sanity_val_steps={given!r}): use -1 (all), 0 (none) or a number of batches."
            )
        self.log_every_n_steps = validate_positive_int(
            "log_every_n_steps", 50 if self.log_every_n_steps is None else self.log_every_n_steps
        )
        self.accumulate_grad_batches = validate_positive_int(
            "accumulate_grad_batches", self.accumulate_grad_batches
        )

    def _check_clipping(self) -> None:
        if self.gradient_clip_algorithm not in (None, "norm", "value"):
            raise MisconfigurationException(
                f"Trainer(gradient_clip_algorithm={self.gradient_clip_algorithm!r}): use 'norm' or 'value'."
            )
        clip = self.gradient_clip_val
        if clip is not None and (not isinstance(clip, (int, float)) or clip < 0):
            raise MisconfigurationException(
                f"Trainer(gradient_clip_val={clip!r}): use a non-negative number."
            )

    def _check_backend_switches(self) -> None:
        self.benchmark = _resolve_benchmark(self.benchmark, self.deterministic)
        self.detect_anomaly = validate_bool("detect_anomaly", self.detect_anomaly)
        if self.detect_anomaly:
            _logger.info(
                "Trainer(detect_anomaly=True) slows training down a lot: use it to debug a model only."
            )
        self.sync_batchnorm = validate_bool("sync_batchnorm", self.sync_batchnorm)
        self.reload_dataloaders_every_n_epochs = validate_non_negative_int(
            "reload_dataloaders_every_n_epochs", self.reload_dataloaders_every_n_epochs
        )

    def attributes(self) -> Mapping[str, Any]:
        """Every field by name, read-only: what ``Trainer.__init__`` sets as its attributes.

        A dataclass's ``__dict__`` holds its fields and nothing else (``timed`` is an ``InitVar``); a view
        of it costs nothing, where ``dataclasses.fields`` would cost more than building the whole config.
        """
        return MappingProxyType(vars(self))


def _resolve_benchmark(benchmark: Any, deterministic: Any) -> Optional[bool]:
    """The value for ``torch.backends.cudnn.benchmark`` as Lightning picks it (``None``: leave it alone).

    ``None`` keeps the session's setting, except that ``deterministic=True`` turns it off: cuDNN's
    benchmark picks algorithms by timing them, so two runs may compute differently.
    """
    if benchmark is not None and not isinstance(benchmark, bool):
        raise MisconfigurationException(f"Trainer(benchmark={benchmark!r}): use True, False or None.")
    if deterministic:
        if benchmark is None:
            return False
        if benchmark:
            rank_zero_warn(
                "Trainer(deterministic=True, benchmark=True): torch ignores cudnn.deterministic while "
                "cudnn.benchmark is on, so cuDNN convolutions may still differ between runs."
            )
    return benchmark
