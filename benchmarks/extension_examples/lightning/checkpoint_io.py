"""A CheckpointIO that gzips each checkpoint and checks a sha256 on load, through top-k, last, removal and resume."""

import gzip
import hashlib
import io
from pathlib import Path

import pytorch_lightning as L
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.plugins import CheckpointIO
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
class GzipSha256IO(CheckpointIO):
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = gzip.compress(buffer.getvalue())
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(data)
        Path(f"{path}.sha256").write_text(hashlib.sha256(data).hexdigest())

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        data = Path(path).read_bytes()
        if hashlib.sha256(data).hexdigest() != Path(f"{path}.sha256").read_text():
            raise ValueError(f"{path}: sha256 does not match")
        return torch.load(io.BytesIO(gzip.decompress(data)), map_location=map_location, weights_only=False)

    def remove_checkpoint(self, path):
        Path(path).unlink(missing_ok=True)
        Path(f"{path}.sha256").unlink(missing_ok=True)


plugins = [GzipSha256IO()]
# extension: end


def fit(max_steps, ckpt_path=None):
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=2)
    checkpoints = ModelCheckpoint(
        dirpath="ckpts", monitor="train_loss", save_top_k=2, save_last=True, every_n_train_steps=2
    )
    trainer = L.Trainer(
        accelerator="cpu",
        plugins=plugins,
        callbacks=[checkpoints],
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), data, ckpt_path=ckpt_path)
    return trainer


fit(8)
files = sorted(p.name for p in Path("ckpts").glob("*.ckpt"))
assert len(files) == 3 and "last.ckpt" in files, files  # top 2 and last; the others were removed
assert all(Path("ckpts", f).read_bytes()[:2] == b"\x1f\x8b" for f in files)  # gzip
assert sorted(p.name for p in Path("ckpts").glob("*.sha256")) == [f"{f}.sha256" for f in files]
assert fit(10, ckpt_path="ckpts/last.ckpt").global_step == 10
