"""Callbacks: the base class and the built-in callbacks."""

from __future__ import annotations

from trainer_core.callbacks.base import Callback
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
