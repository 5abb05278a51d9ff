# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/advanced/training_tricks.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414, section "Batch Size Finder": the first half of the code block
# "using LightningModule" (the model whose `train_dataloader` reads the batch size, and the tuner run on it), every
# shown line unchanged. Completed around it (the block uses them without showing them): the imports, `train_dataset`,
# the model's layer, `training_step` and `configure_optimizers`, and the `trainer.fit(model)` the section's first
# block ends with ("Fit as normal with new batch size"); the elided `Trainer(...)` is `Trainer()`.
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.tuner import Tuner

# ---- completed: not shown in the docs ----
x = torch.randn(96, 16)
train_dataset = TensorDataset(x, x.sum(1, keepdim=True))
# ---- end of completion ----


# using LightningModule
class LitModel(LightningModule):
    def __init__(self, batch_size):
        super().__init__()
        self.save_hyperparameters()
        # or
        self.batch_size = batch_size
        self.layer = torch.nn.Linear(16, 1)  # completed: not shown in the docs

    def train_dataloader(self):
        return DataLoader(train_dataset, batch_size=self.batch_size | self.hparams.batch_size)

    # ---- completed: not shown in the docs ----
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
    # ---- end of completion ----


model = LitModel(batch_size=32)
trainer = Trainer()  # completed: the docs show `Trainer(...)`, arguments elided
tuner = Tuner(trainer)
tuner.scale_batch_size(model)

# Fit as normal with new batch size
trainer.fit(model)
