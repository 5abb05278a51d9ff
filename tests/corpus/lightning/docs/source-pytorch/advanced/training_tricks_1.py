# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/advanced/training_tricks.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414, section "Learning Rate Finder", the code block that runs the
# finder, reads its results and suggestion and fits (every shown line unchanged). Completed above it (the block uses
# them without showing them): the imports, a small `MyModelClass` taking `hparams` whose optimizer reads
# `self.hparams.lr`, the `hparams` it is built with, and its data.
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.tuner import Tuner


# ---- completed: not shown in the docs ----
class MyModelClass(LightningModule):
    def __init__(self, hparams):
        super().__init__()
        self.save_hyperparameters(hparams)
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


hparams = {"lr": 1e-3}
# ---- end of completion ----

model = MyModelClass(hparams)
trainer = Trainer()
tuner = Tuner(trainer)

# Run learning rate finder
lr_finder = tuner.lr_find(model)

# Results can be found in
print(lr_finder.results)

# Plot with
fig = lr_finder.plot(suggest=True)
fig.show()

# Pick point based on plot, or get suggestion
new_lr = lr_finder.suggestion()

# update hparams of the model
model.hparams.lr = new_lr

# Fit model
trainer.fit(model)
