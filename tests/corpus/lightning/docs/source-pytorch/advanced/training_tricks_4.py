# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/advanced/training_tricks.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414, section "Weight Averaging": the code block with
# `EMAWeightAveraging` and `StochasticWeightAveraging`, every shown line unchanged. Completed (the block builds the
# trainers but shows neither a model nor a fit): the imports, a small model with a batch-norm layer and its data, and
# a `trainer.fit(model)` after each Trainer. The corpus gives this program 12 epochs of 10 batches, so that EMA
# (after step 100) and SWA (from epoch 10) both take part.
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer


# ---- completed: not shown in the docs ----
class LitModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(80, 16, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


model = LitModel()
# ---- end of completion ----

from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from torch.optim.swa_utils import get_ema_avg_fn

# Enable Exponential Moving Average after 100 steps
class EMAWeightAveraging(WeightAveraging):
    def __init__(self):
        super().__init__(avg_fn=get_ema_avg_fn())
    def should_update(self, step_idx=None, epoch_idx=None):
        return (step_idx is not None) and (step_idx >= 100)
trainer = Trainer(callbacks=EMAWeightAveraging())
trainer.fit(model)  # completed: not shown in the docs

# Enable Stochastic Weight Averaging after 10 epochs with learning rate 0.01
trainer = Trainer(callbacks=StochasticWeightAveraging(swa_epoch_start=10, swa_lrs=0.01))
trainer.fit(LitModel())  # completed: not shown in the docs
