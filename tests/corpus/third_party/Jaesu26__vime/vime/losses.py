# Source: https://github.com/Jaesu26/vime, commit 6afbcfd3ec2b4b1f9ecab2727b6d1f681e207d50, path vime/losses.py
# License: MIT License (Copyright (c) 2023 Jaesu Han)
# Changes (everything that differs from the original):
# - none

import torch
import torch.nn as nn
from torch import Tensor


class CELoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nll_loss = nn.NLLLoss()

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        input = torch.log(input)
        input = torch.clamp(input, -100)  # Improve numerical stability
        loss = self.nll_loss(input, target)
        return loss


class ConsistencyLoss(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.mean(torch.var(x, dim=0))
