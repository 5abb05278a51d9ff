"""A DDP plugin whose communication hook runs (and is counted) on CPU/gloo: 2 processes, 24 steps."""

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.utils.data import DataLoader, TensorDataset

import trainer_core as L
from trainer_core.plugins import DDPPlugin


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


# extension: begin
hook_calls = 0


def counting_allreduce(state, bucket):
    global hook_calls
    hook_calls += 1
    return default_hooks.allreduce_hook(state, bucket)


strategy = DDPPlugin(ddp_comm_hook=counting_allreduce)
# extension: end

x = torch.randn(96, 4, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=strategy,
    max_steps=24,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Tiny(), data)
assert hook_calls == 24, hook_calls  # one bucket per step on every rank
