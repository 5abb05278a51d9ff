"""Two instances of one stateful callback, each resumed with its own state."""

import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import Callback
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
class Counter(Callback):
    def __init__(self, what):
        self.what = what
        self.count = 0

    @property
    def state_key(self):
        return self._generate_state_key(what=self.what)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.count += 1 if self.what == "steps" else len(batch[0])

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state_dict):
        self.count = state_dict["count"]


def make_callbacks():
    return [Counter("steps"), Counter("samples")]


# extension: end


def fit(max_steps, ckpt_path=None):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    callbacks = make_callbacks()
    trainer = L.Trainer(
        accelerator="cpu",
        callbacks=callbacks,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data, ckpt_path=ckpt_path)
    return trainer, callbacks


trainer, _ = fit(4)
trainer.save_checkpoint("four.ckpt")
_, (steps, samples) = fit(6, ckpt_path="four.ckpt")
assert (steps.count, samples.count) == (6, 12), (steps.count, samples.count)
