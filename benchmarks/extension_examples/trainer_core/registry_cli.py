"""A strategy registered under a name of its own and chosen by that name from the CLI's YAML."""

from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import trainer_core as L
from trainer_core.cli import LightningCLI
from trainer_core.plugins import SingleDevicePlugin, register_plugin


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)

    def train_dataloader(self):
        x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)


# extension: begin
class TaggedSingleDevice(SingleDevicePlugin):
    tag = "site"


register_plugin("tagged_single", TaggedSingleDevice, device="cpu")
Path("run.yaml").write_text("trainer:\n  strategy: tagged_single\n")
# extension: end

Path("trainer.yaml").write_text(
    "trainer:\n  accelerator: cpu\n  max_steps: 3\n  logger: false\n  enable_checkpointing: false\n"
    "  enable_progress_bar: false\n  enable_model_summary: false\n"
)
cli = LightningCLI(Tiny, args=["fit", "--config", "trainer.yaml", "--config", "run.yaml"])
assert isinstance(cli.trainer.strategy, TaggedSingleDevice) and cli.trainer.global_step == 3
