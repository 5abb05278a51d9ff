# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/data/datasets/__init__.py
# License: MIT
# Changes (everything that differs from the original):
# - the package's other modules are left out (not used by the corpus programs; some need PIL, requests or scipy): their imports and names are removed from this __init__
from .base import DatasetFW
from .cifar10 import CIFAR10, cifar10_train_transform, cifar10_test_transform

__all__ = [
    "DatasetFW",
    "CIFAR10",
    "cifar10_train_transform",
    "cifar10_test_transform",
]
