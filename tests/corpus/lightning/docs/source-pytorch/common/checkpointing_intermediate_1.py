# Assembled from Lightning's documentation (not a verbatim file):
# docs/source-pytorch/common/checkpointing_intermediate.rst at commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the
# code blocks "Modify checkpointing behavior" (ModelCheckpoint with save_top_k and monitor, best/last paths), the
# LitAutoEncoder logging "val_loss", "Save a checkpoint manually" (save_checkpoint, load_from_checkpoint) and "Resume
# training state" (fit with ckpt_path), in that order, every shown line unchanged. Completed (the blocks use them
# without showing them): the imports, the model's backbone, training step, optimizer, data and hyper-parameters,
# `model`, the names `MyLightningModule`/`hparams`/`LitModel` the later blocks give the same model, and a copy of the
# best checkpoint to the path the resume block names. Each completion is marked.
import os
import shutil

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from lightning.pytorch import LightningModule, Trainer

from lightning.pytorch.callbacks import ModelCheckpoint


class LitAutoEncoder(LightningModule):
    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self.backbone(x)

        # 1. calculate loss
        loss = F.cross_entropy(y_hat, y)

        # 2. log val_loss
        self.log("val_loss", loss)

    # ---- completed: not shown in the docs ----
    def __init__(self, hidden=32):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.backbone(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        return DataLoader(TensorDataset(torch.randn(64, 16, generator=g), torch.randint(0, 4, (64,), generator=g)), batch_size=8)

    def val_dataloader(self):
        g = torch.Generator().manual_seed(2)
        return DataLoader(TensorDataset(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)), batch_size=8)


model = LitAutoEncoder()
MyLightningModule = LitModel = LitAutoEncoder
hparams = 32
# ---- end of completion ----

checkpoint_callback = ModelCheckpoint(dirpath="my/path/", save_top_k=2, monitor="val_loss")
trainer = Trainer(callbacks=[checkpoint_callback])
trainer.fit(model)

# Access best and last model checkpoint directly from the callback
print(checkpoint_callback.best_model_path)
print(checkpoint_callback.last_model_path)
# Or via the trainer
print(trainer.checkpoint_callback.best_model_path)
print(trainer.checkpoint_callback.last_model_path)

model = MyLightningModule(hparams)
trainer.fit(model)
trainer.save_checkpoint("example.ckpt")

# load the checkpoint later as normal
new_model = MyLightningModule.load_from_checkpoint(checkpoint_path="example.ckpt")

# ---- completed: not shown in the docs ----
os.makedirs("path/to", exist_ok=True)
shutil.copy(checkpoint_callback.best_model_path, "path/to/checkpoint")
# ---- end of completion ----

trainer = Trainer()
model = LitModel()

# Will load weights with `.load_state_dict(strict=model.strict_loading)`
trainer.fit(model, ckpt_path="path/to/checkpoint")

# completed: not shown in the docs (the loaded model's weights and hyper-parameters, checked against the saved ones)
print(new_model.hparams, trainer.validate(new_model))
