"""Callbacks: the base class and the built-in callbacks.

Each built-in callback loads on first use (``from trainer_core.callbacks import ModelCheckpoint``,
``trainer_core.callbacks.EarlyStopping``): importing all of them would add their imports (tqdm, rich,
``statistics``, pruning, the FLOP counter) to ``import trainer_core``, which every rank and every CLI
call pays. Only the base class loads with the package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer_core.callbacks.base import Callback
from trainer_core.utilities.lazy import lazy_attributes

if TYPE_CHECKING:
    from trainer_core.callbacks.batch_size_finder import BatchSizeFinder
    from trainer_core.callbacks.device_stats_monitor import DeviceStatsMonitor
    from trainer_core.callbacks.early_stopping import EarlyStopping
    from trainer_core.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
    from trainer_core.callbacks.gradient_accumulation import GradientAccumulationScheduler
    from trainer_core.callbacks.hang_watchdog import HangWatchdog
    from trainer_core.callbacks.lambda_function import LambdaCallback
    from trainer_core.callbacks.lr_finder import LearningRateFinder
    from trainer_core.callbacks.lr_monitor import LearningRateMonitor
    from trainer_core.callbacks.model_checkpoint import ModelCheckpoint
    from trainer_core.callbacks.model_summary import ModelSummary, RichModelSummary
    from trainer_core.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
    from trainer_core.callbacks.prediction_writer import BasePredictionWriter
    from trainer_core.callbacks.progress import ProgressBar, TQDMProgressBar
    from trainer_core.callbacks.pruning import ModelPruning
    from trainer_core.callbacks.rich_progress import RichProgressBar
    from trainer_core.callbacks.stochastic_weight_avg import StochasticWeightAveraging
    from trainer_core.callbacks.straggler import StragglerMonitor
    from trainer_core.callbacks.throughput_monitor import ThroughputMonitor
    from trainer_core.callbacks.timer import Timer
    from trainer_core.callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging

# Public name -> the module of this package that defines it.
_LAZY = {
    "BackboneFinetuning": "finetuning",
    "BaseFinetuning": "finetuning",
    "BasePredictionWriter": "prediction_writer",
    "BatchSizeFinder": "batch_size_finder",
    "DeviceStatsMonitor": "device_stats_monitor",
    "EMAWeightAveraging": "weight_averaging",
    "EarlyStopping": "early_stopping",
    "GradientAccumulationScheduler": "gradient_accumulation",
    "HangWatchdog": "hang_watchdog",
    "LambdaCallback": "lambda_function",
    "LearningRateFinder": "lr_finder",
    "LearningRateMonitor": "lr_monitor",
    "ModelCheckpoint": "model_checkpoint",
    "ModelPruning": "pruning",
    "ModelSummary": "model_summary",
    "OnExceptionCheckpoint": "on_exception_checkpoint",
    "ProgressBar": "progress",
    "RichModelSummary": "model_summary",
    "RichProgressBar": "rich_progress",
    "StochasticWeightAveraging": "stochastic_weight_avg",
    "StragglerMonitor": "straggler",
    "TQDMProgressBar": "progress",
    "ThroughputMonitor": "throughput_monitor",
    "Timer": "timer",
    "WeightAveraging": "weight_averaging",
}

__all__ = [
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "BatchSizeFinder",
    "Callback",
    "DeviceStatsMonitor",
    "EMAWeightAveraging",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "HangWatchdog",
    "LambdaCallback",
    "LearningRateFinder",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelPruning",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "RichModelSummary",
    "RichProgressBar",
    "StochasticWeightAveraging",
    "StragglerMonitor",
    "TQDMProgressBar",
    "ThroughputMonitor",
    "Timer",
    "WeightAveraging",
]


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, globals())
