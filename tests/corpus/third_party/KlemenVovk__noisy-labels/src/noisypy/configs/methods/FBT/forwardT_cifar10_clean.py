# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/configs/methods/FBT/forwardT_cifar10_clean.py
# License: MIT
# Changes (everything that differs from the original):
# - classifier: `resnet34` (imported from noisypy.methods.classifiers.resnet, which does not define it) is a tiny CNN of the same signature defined here (size: a ResNet-34 takes minutes per epoch on a CPU)
# - sizes: warmup_epochs 120 -> 1 (the harness runs 2 epochs: the switch to the corrected loss happens after the first)
# - CSVLogger("../logs", ...) -> CSVLogger("logs", ...): the run keeps its files in its own folder
from torch.optim import SGD
from torch.optim.lr_scheduler import MultiStepLR
from lightning.pytorch.loggers import CSVLogger

import torch.nn as nn


def resnet34(num_classes, weights=None):
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, num_classes),
    )
from noisypy.methods.learning_strategies.FBT.FBT import ForwardT
from noisypy.configs.base.method import MethodConfig
from noisypy.configs.data.cifar10 import cifar10_base_config


class forwardT_cifar10_clean_config(MethodConfig):
    data_config = cifar10_base_config

    classifier = resnet34
    classifier_args = dict(
        weights=None,
        num_classes=10,
    )

    learning_strategy_cls = ForwardT
    learning_strategy_args = dict(
        warmup_epochs=1,
        filter_outliers=False,
    )

    optimizer_cls = SGD
    optimizer_args = dict(lr=0.1, momentum=0.9, weight_decay=5e-4)
    scheduler_cls = MultiStepLR
    scheduler_args = dict(milestones=[40, 80], gamma=0.1)

    trainer_args = dict(
        max_epochs=240,
        deterministic=True,
        num_sanity_val_steps=0,
        logger=CSVLogger("logs", name="forwardT_cifar10_clean"),
    )

    seed = 1337
