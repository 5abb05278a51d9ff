# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/accelerators/accelerator_prepare.rst
# at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the code block logging a torchmetrics `BinaryF1Score` object
# ("Passing the metric object to self.log ..."), every shown line unchanged. Completed (the block elides them): the
# imports, a layer, forward, a training step, optimizer, data, and a Trainer that fits and validates.
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer

from torchmetrics.classification import BinaryF1Score


class LitModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.val_f1 = BinaryF1Score()
        self.layer = nn.Linear(6, 1)  # completed: not shown in the docs


    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.val_f1.update(logits, y)
        # Passing the metric object to self.log triggers DDP sync at epoch end.
        self.log("val_f1", self.val_f1, on_epoch=True)

    # ---- completed: not shown in the docs ----
    def forward(self, x):
        return self.layer(x).squeeze(1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.binary_cross_entropy_with_logits(self(x), y.float())
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def loader(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 6, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] + 0.5 * x[:, 1] > 0).long()), batch_size=8)


model = LitModel()
trainer = Trainer()
trainer.fit(model, loader(0), loader(1))
trainer.validate(model, loader(2))
