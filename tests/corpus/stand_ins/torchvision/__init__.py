"""A stand-in for the few torchvision names Lightning's example programs use (the real one is not installable
beside this torch build without pulling another one). Only what the corpus programs call, in plain torch."""

from torchvision import datasets, models, transforms, utils

__version__ = "0.0.0"
__all__ = ["datasets", "models", "transforms", "utils"]
