# Source: https://github.com/Jaesu26/vime, commit 6afbcfd3ec2b4b1f9ecab2727b6d1f681e207d50, path vime/datasets.py
# License: MIT License (Copyright (c) 2023 Jaesu Han)
# Changes (everything that differs from the original):
# - none

from typing import Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset


class LabeledDataset(Dataset):
    def __init__(self, X: np.ndarray, y: np.ndarray) -> None:
        self.X = torch.tensor(X, dtype=torch.float32)
        self.y = torch.tensor(y)

    def __getitem__(self, index: int) -> Tuple[Tensor, Tensor]:
        x = self.X[index]
        y = self.y[index]
        return x, y

    def __len__(self) -> int:
        return self.X.shape[0]


class UnlabeledDataset(Dataset):
    def __init__(self, X: np.ndarray) -> None:
        self.X = torch.tensor(X, dtype=torch.float32)

    def __getitem__(self, index: int) -> Tensor:
        x = self.X[index]
        return x

    def __len__(self) -> int:
        return self.X.shape[0]
