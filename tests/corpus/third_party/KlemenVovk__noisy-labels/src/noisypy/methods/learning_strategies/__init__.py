# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/methods/learning_strategies/__init__.py
# License: MIT
# Changes (everything that differs from the original):
# - the package's other modules are left out (not used by the corpus programs; some need PIL, requests or scipy): their imports and names are removed from this __init__
from .base import (
    LearningStrategyModule,
    LearningStrategyWithWarmupModule,
    MultiStageLearningStrategyModule,
)
from .co_teaching.co_teaching import CoTeaching, CoTeachingPlus
from .FBT.FBT import ForwardT, BackwardT
from .divide_mix.divide_mix import DivideMix

__all__ = [
    "LearningStrategyModule",
    "LearningStrategyWithWarmupModule",
    "MultiStageLearningStrategyModule",
    "CoTeaching",
    "CoTeachingPlus",
    "ForwardT",
    "BackwardT",
    "DivideMix",
]
