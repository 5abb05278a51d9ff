# Assembled from Lightning's documentation (not a verbatim file): docs/source-pytorch/deploy/production_basic.rst at
# commit 7f0c3436cd3f6ad3753125672024fc415cbcb414: the code blocks "Use a LightningModule's predict_step"
# (`MyModel.predict_step`, then `trainer.predict(model, data_loader)`) and "Enable distributed inference"
# (`CustomWriter(BasePredictionWriter)`, predicting `BoringModel` with it), in that order, every shown line unchanged
# but the elided `DataLoader(...)`, completed with a small dataset. Completed (the blocks use them without showing
# them): the imports, `MyModel`'s layer and forward, and the folder the writer saves into. The corpus runs every
# Trainer on one CPU device (`strategy="ddp"` stays, with one process).
import os

from torch import nn
from torch.utils.data import DataLoader
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset


class MyModel(LightningModule):
    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        return self(batch)

    # ---- completed: not shown in the docs ----
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 2)

    def forward(self, x):
        return self.layer(x)
    # ---- end of completion ----


data_loader = DataLoader(RandomDataset(32, 64), batch_size=8)  # completed: the docs show `DataLoader(...)`
model = MyModel()
trainer = Trainer()
predictions = trainer.predict(model, data_loader)

import torch
from lightning.pytorch.callbacks import BasePredictionWriter


class CustomWriter(BasePredictionWriter):
    def __init__(self, output_dir, write_interval):
        super().__init__(write_interval)
        self.output_dir = output_dir

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        # this will create N (num processes) files in `output_dir` each containing
        # the predictions of it's respective rank
        torch.save(predictions, os.path.join(self.output_dir, f"predictions_{trainer.global_rank}.pt"))

        # optionally, you can also save `batch_indices` to get the information about the data index
        # from your prediction data
        torch.save(batch_indices, os.path.join(self.output_dir, f"batch_indices_{trainer.global_rank}.pt"))


os.makedirs("pred_path", exist_ok=True)  # completed: not shown in the docs

# or you can set `write_interval="batch"` and override `write_on_batch_end` to save
# predictions at batch level
pred_writer = CustomWriter(output_dir="pred_path", write_interval="epoch")
trainer = Trainer(accelerator="gpu", strategy="ddp", devices=8, callbacks=[pred_writer])
model = BoringModel()
trainer.predict(model, return_predictions=False)

# ---- completed: not shown in the docs (what the writer saved, for the record) ----
print(
    [float(p.sum()) for p in torch.load("pred_path/predictions_0.pt")],
    torch.load("pred_path/batch_indices_0.pt"),
)
