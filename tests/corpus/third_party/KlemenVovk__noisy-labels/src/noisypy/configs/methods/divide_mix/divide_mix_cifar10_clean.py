# Source: https://github.com/KlemenVovk/noisy-labels, commit 3d92600c7fdb8477cbc4b8d64688cb5249f30498, path src/noisypy/configs/methods/divide_mix/divide_mix_cifar10_clean.py
# License: MIT
# Changes (everything that differs from the original):
# - classifier: `resnet34` (imported from noisypy.methods.classifiers.resnet, which does not define it) is a tiny CNN of the same signature defined here (size: a ResNet-34 takes minutes per epoch on a CPU)
# - learning_strategy_args gain lambda_u=25: DivideMix requires it and the config predates the argument (25 is
#   SemiLoss's own default)
# - sizes: warmup_epochs 10 -> 1 (the harness runs 2 epochs: one warm-up, one co-divide epoch)
# - CSVLogger("../logs", ...) -> CSVLogger("logs", ...): the run keeps its files in its own folder
from pytorch_lightning.loggers import CSVLogger
from torch.optim import SGD
from torch.optim.lr_scheduler import LambdaLR

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
from noisypy.methods.learning_strategies.divide_mix.divide_mix import DivideMix
from noisypy.data.pipelines.divide_mix import DivideMixify
from noisypy.configs.base.method import MethodConfig
from noisypy.configs.data.cifar10 import (
    cifar10_base_config,
    cifar10_train_transform,
    cifar10_test_transform,
)


class cifar10_clean_divide_mix_config(cifar10_base_config):
    dataset_train_args = [
        dict(mode="all", transform=cifar10_train_transform),
        dict(mode="all", transform=cifar10_train_transform),
        dict(mode="unlabeled", transform=cifar10_train_transform),
        dict(mode="unlabeled", transform=cifar10_train_transform),
        dict(mode="all", transform=cifar10_test_transform),
    ]

    dataset_train_augmentation = DivideMixify()


class divide_mix_cifar10_clean_config(MethodConfig):
    data_config = cifar10_clean_divide_mix_config

    classifier = resnet34
    classifier_args = dict(num_classes=10)

    learning_strategy_cls = DivideMix
    learning_strategy_args = dict(
        warmup_epochs=1,
        noise_type="clean",
        noise_rate=0,
        p_thresh=0.5,
        temperature=0.5,
        alpha=4,
        lambda_u=25,
    )

    optimizer_cls = SGD
    optimizer_args = dict(lr=0.02, momentum=0.9, weight_decay=5e-4)
    scheduler_cls = LambdaLR
    scheduler_args = dict(lr_lambda=lambda epoch: 0.1 if epoch >= 150 else 1)

    trainer_args = dict(
        max_epochs=100,
        reload_dataloaders_every_n_epochs=1,
        deterministic=True,
        logger=CSVLogger("logs", name="divide_mix_cifar10_clean"),
    )

    seed = 1337
