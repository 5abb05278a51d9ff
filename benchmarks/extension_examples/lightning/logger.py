"""A logger that keeps every logged row in a list."""

import pytorch_lightning as L
import torch
from pytorch_lightning.loggers import Logger
from pytorch_lightning.utilities import rank_zero_only
from torch.utils.data import DataLoader, TensorDataset


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


# extension: begin
class ListLogger(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []
        self.hparams = {}

    @property
    def name(self):
        return "list"

    @property
    def version(self):
        return 0

    @rank_zero_only
    def log_hyperparams(self, params, *args, **kwargs):
        self.hparams.update(params)

    @rank_zero_only
    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))


logger = ListLogger()
# extension: end

x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
trainer = L.Trainer(
    accelerator="cpu",
    logger=logger,
    log_every_n_steps=1,
    max_steps=4,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Tiny(), data)
assert [step for step, metrics in logger.rows if "train_loss" in metrics] == [0, 1, 2, 3], logger.rows
