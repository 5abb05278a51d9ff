"""A precision plugin with a constant loss scale (1024): the same weights as full precision, scaled backward."""

import pytorch_lightning as L
import torch
from pytorch_lightning.plugins.precision import Precision
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
class ConstantLossScale(Precision):
    scale = 1024.0
    scaled_backwards = 0

    def backward(self, tensor, model, optimizer, *args, **kwargs):
        super().backward(tensor * self.scale, model, optimizer, *args, **kwargs)
        for param in model.parameters():
            if param.grad is not None:
                param.grad.div_(self.scale)
        self.scaled_backwards += 1


plugins = [ConstantLossScale()]
# extension: end


def fit(plugins):
    torch.manual_seed(0)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    model = Tiny()
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=plugins,
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    return model.layer.weight.detach()


assert torch.equal(fit(plugins), fit(None))  # a power-of-two scale changes no bit of the result
assert plugins[0].scaled_backwards == 6
