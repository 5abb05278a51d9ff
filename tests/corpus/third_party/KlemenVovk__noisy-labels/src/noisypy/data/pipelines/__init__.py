# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/data/pipelines/__init__.py
# License: MIT
# Changes (everything that differs from the original):
# - the package's other modules are left out (not used by the corpus programs; some need PIL, requests or scipy): their imports and names are removed from this __init__
from .base import AugmentationPipeline, Compose, Identity
from .divide_mix import DivideMixify
from .index import AddIndex
from .split import Split

__all__ = [
    "AugmentationPipeline",
    "Compose",
    "Identity",
    "DivideMixify",
    "AddIndex",
    "Split",
]
