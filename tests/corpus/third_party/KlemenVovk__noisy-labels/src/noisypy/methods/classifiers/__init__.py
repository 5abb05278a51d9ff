# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/methods/classifiers/__init__.py
# License: MIT
# Changes (everything that differs from the original):
# - none
from .base import Classifier
from torchvision.models import resnet34
from .resnet import ResNet18, PreResNet18, ResNet34

__all__ = ["Classifier", "resnet34", "ResNet18", "PreResNet18", "ResNet34"]
