"""A profiler that sums the wall time of every action."""

import time
from collections import defaultdict

import pytorch_lightning as L
import torch
from pytorch_lightning.profilers import Profiler
from torch.utils.data import DataLoader, TensorDataset


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
class TotalTimeProfiler(Profiler):
    def __init__(self):
        super().__init__()
        self.started = {}
        self.totals = defaultdict(float)
        self.calls = defaultdict(int)

    def start(self, action_name):
        self.started[action_name] = time.perf_counter()

    def stop(self, action_name):
        self.totals[action_name] += time.perf_counter() - self.started.pop(action_name)
        self.calls[action_name] += 1

    def summary(self):
        return "\n".join(f"{name}: {seconds:.6f} s" for name, seconds in sorted(self.totals.items()))


profiler = TotalTimeProfiler()
# extension: end

x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
trainer = L.Trainer(
    accelerator="cpu",
    profiler=profiler,
    max_steps=5,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(Tiny(), data)
step_calls = [n for name, n in profiler.calls.items() if name.endswith("training_step")]
assert step_calls == [5], dict(profiler.calls)
