# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/advanced/training_tricks.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414, section "Learning Rate Finder": the code block with the
# `FineTuneLearningRateFinder` callback, every shown line unchanged but the elided `trainer.fit(...)`, completed as
# `trainer.fit(model)`. Completed above it (the block uses them without showing them): the imports and a small model
# with its data whose optimizer reads `self.learning_rate` (the attribute the finder sets).
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer


# ---- completed: not shown in the docs ----
class LitModel(LightningModule):
    def __init__(self, learning_rate=1e-3):
        super().__init__()
        self.learning_rate = learning_rate
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.learning_rate)

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


model = LitModel()
# ---- end of completion ----

from lightning.pytorch.callbacks import LearningRateFinder


class FineTuneLearningRateFinder(LearningRateFinder):
    def __init__(self, milestones, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.milestones = milestones

    def on_fit_start(self, *args, **kwargs):
        return

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch in self.milestones or trainer.current_epoch == 0:
            self.lr_find(trainer, pl_module)


trainer = Trainer(callbacks=[FineTuneLearningRateFinder(milestones=(5, 10))])
trainer.fit(model)  # completed: the docs show `trainer.fit(...)`
