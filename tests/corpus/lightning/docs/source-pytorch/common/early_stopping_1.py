# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/common/early_stopping.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the first code block (a model logging "val_loss", fit with
# EarlyStopping) and the "stopping_reason" code block, concatenated in order, every shown line unchanged. Completed
# (the blocks elide them): the imports, the model's layer, training step, optimizer and data, and the value of the
# elided `loss = ...` (the line stays; the next line computes it).
import torch
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer

from lightning.pytorch.callbacks.early_stopping import EarlyStopping


class LitModel(LightningModule):
    def validation_step(self, batch, batch_idx):
        loss = ...
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])  # completed: not shown in the docs
        self.log("val_loss", loss)

    # ---- completed: not shown in the docs ----
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(64, 16, generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

    def val_dataloader(self):
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(6))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    # ---- end of completion ----


model = LitModel()
trainer = Trainer(callbacks=[EarlyStopping(monitor="val_loss", mode="min")])
trainer.fit(model)

from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

early_stopping = EarlyStopping(monitor="val_loss", patience=3)
trainer = Trainer(callbacks=[early_stopping])
trainer.fit(model)

# Check why training stopped
if early_stopping.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED:
    print("Training stopped due to patience exhaustion")
elif early_stopping.stopping_reason == EarlyStoppingReason.STOPPING_THRESHOLD:
    print("Training stopped due to reaching stopping threshold")
elif early_stopping.stopping_reason == EarlyStoppingReason.NOT_STOPPED:
    print("Training completed normally without early stopping")

# Access human-readable message
if early_stopping.stopping_reason_message:
    print(f"Details: {early_stopping.stopping_reason_message}")
