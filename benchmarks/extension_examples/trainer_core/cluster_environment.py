"""A site scheduler's environment (ranks in MY_RANK/MY_WORLD): the script starts its own 2 processes."""

import os
import socket
import subprocess
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import trainer_core as L
from trainer_core.plugins import ClusterEnvironment


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
class MyClusterEnvironment(ClusterEnvironment):
    creates_processes_externally = True

    @staticmethod
    def detect():
        return "MY_RANK" in os.environ

    def world_size(self):
        return int(os.environ["MY_WORLD"])

    def global_rank(self):
        return int(os.environ["MY_RANK"])

    def local_rank(self):
        return int(os.environ["MY_RANK"])

    def node_rank(self):
        return 0


plugins = [MyClusterEnvironment()]
# extension: end

if "MY_RANK" not in os.environ:  # the scheduler: start both ranks, as a site's launcher would
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "MY_WORLD": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    ranks = [subprocess.Popen([sys.executable, __file__], env={**env, "MY_RANK": str(r)}) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    weights = [torch.load(f"rank{r}.pt") for r in (0, 1)]
    assert torch.equal(weights[0], weights[1])  # one DDP job of two ranks, not two separate runs
    sys.exit(0)

x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    plugins=plugins,
    max_steps=4,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Tiny()
trainer.fit(model, data)
assert (trainer.world_size, trainer.global_rank) == (2, int(os.environ["MY_RANK"]))
torch.save(model.layer.weight.detach(), f"rank{trainer.global_rank}.pt")
