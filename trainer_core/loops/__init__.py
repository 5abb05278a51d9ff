"""The loops, by phase: fit (``fit.py``), one training batch (``training_step.py``), validation, test
and prediction (``evaluation.py``), where the data comes from (``data.py``), and the loop state they
share with checkpoints (``progress.py``)."""

from __future__ import annotations

from trainer_core.loops.evaluation import run_evaluation, run_loop, run_predict
from trainer_core.loops.fit import FitLoop
from trainer_core.loops.progress import Progress, ResumePlan
from trainer_core.loops.training_step import TrainingStep

__all__ = ["FitLoop", "Progress", "ResumePlan", "TrainingStep", "run_evaluation", "run_loop", "run_predict"]
