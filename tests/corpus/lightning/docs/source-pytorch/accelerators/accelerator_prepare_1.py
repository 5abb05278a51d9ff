# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/accelerators/accelerator_prepare.rst
# at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the code blocks "Remove any .cuda() or .to(device) Calls"
# (LitModel registering a buffer) and "Synchronize validation and test logging" (validation and test steps logging
# with on_step=True, on_epoch=True, sync_dist=True), in that order, every shown line unchanged; the second block's
# methods are indented into the first block's class. Completed (the blocks elide them): the imports, the class body
# the first block's `...` stands for (`super().__init__()`, a layer, `self.loss`), forward, a training step, optimizer,
# data, and a Trainer that fits, validates and tests.
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer


class LitModel(LightningModule):
    def __init__(self):
        ...
        # ---- completed: not shown in the docs ----
        super().__init__()
        self.layer = nn.Linear(3, 4)
        self.loss = nn.CrossEntropyLoss()
        # ---- end of completion ----
        self.register_buffer("sigma", torch.eye(3))
        # you can now access self.sigma anywhere in your module

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        # Add sync_dist=True to sync logging across all GPU workers (may have performance impact)
        self.log("validation_loss", loss, on_step=True, on_epoch=True, sync_dist=True)


    def test_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        # Add sync_dist=True to sync logging across all GPU workers (may have performance impact)
        self.log("test_loss", loss, on_step=True, on_epoch=True, sync_dist=True)

    # ---- completed: not shown in the docs ----
    def forward(self, x):
        return self.layer(x @ self.sigma)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader(seed):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(32, 3, generator=g), torch.randint(0, 4, (32,), generator=g)), batch_size=8)


model = LitModel()
trainer = Trainer()
trainer.fit(model, loader(0), loader(1))
trainer.validate(model, loader(1))
trainer.test(model, loader(2))
