"""Train a small MLP on scikit-learn's bundled digits data set (8x8 images, 10 classes).

The module and data module below are written exactly as for Lightning 2.x; only the imports
differ. Run it with ``make demo`` or::

    python examples/digits.py --max-epochs 15 --default-root-dir demo_runs
    python examples/digits.py --devices 2            # two processes, sharded optimizer state

The data ships inside scikit-learn, so nothing is downloaded. On two CPU cores it reaches about
97% validation accuracy in a few seconds. Metrics go to ``<root>/lightning_logs/version_N/metrics.csv``
(and to TensorBoard under ``<root>/tensorboard`` when it is installed); with matplotlib installed
the run ends by drawing them to ``metrics.png`` beside the CSV (``python -m trainer_core.plot`` does
the same for any run). ``examples/digits.yaml`` describes the same run for
``python -m trainer_core fit --config examples/digits.yaml``.

``build_datamodule`` and ``DigitsClassifier`` are importable, so tests and later examples
(several processes) reuse them.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningDataModule, LightningModule, Trainer, seed_everything
from trainer_core.callbacks import LearningRateMonitor, ModelCheckpoint
from trainer_core.loggers import CSVLogger, TensorBoardLogger, tensorboard_available

NUM_FEATURES = 64  # 8 x 8 pixels
NUM_CLASSES = 10
PIXEL_MAX = 16.0  # digits pixels are integers in [0, 16]


class DigitsDataModule(LightningDataModule):
    """Stratified train / validation / test split of the 1797 digits images.

    The split is made with a fixed ``split_seed`` so that every process (and every run) sees the
    same validation and test images, whatever the global seed.
    """

    def __init__(
        self,
        batch_size: int = 32,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        # A few hundred kilobytes: cheap enough to build every split on every stage.
        features, labels = load_digits(return_X_y=True)
        features = torch.tensor(features / PIXEL_MAX, dtype=torch.float32)
        labels = torch.tensor(labels, dtype=torch.long)
        holdout = self.hparams.val_fraction + self.hparams.test_fraction
        x_train, x_rest, y_train, y_rest = train_test_split(
            features, labels, test_size=holdout, stratify=labels, random_state=self.hparams.split_seed
        )
        x_val, x_test, y_val, y_test = train_test_split(
            x_rest,
            y_rest,
            test_size=self.hparams.test_fraction / holdout,
            stratify=y_rest,
            random_state=self.hparams.split_seed,
        )
        self.train_set = TensorDataset(x_train, y_train)
        self.val_set = TensorDataset(x_val, y_val)
        self.test_set = TensorDataset(x_test, y_test)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=self.hparams.batch_size)


class DigitsClassifier(LightningModule):
    """Two hidden layers with dropout; AdamW with a cosine learning-rate schedule per epoch."""

    def __init__(
        self, hidden_dim: int = 128, dropout: float = 0.1, lr: float = 3e-3, weight_decay: float = 1e-4
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(NUM_FEATURES, hidden_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden_dim, NUM_CLASSES),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def _evaluate(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> None:
        x, y = batch
        logits = self(x)
        # Logged per batch and averaged over the epoch weighted by batch size: the exact accuracy.
        # sync_dist: with several processes each rank sees part of the data; report the whole.
        self.log(f"{stage}_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(dim=-1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._evaluate(batch, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.trainer.max_epochs)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch", "frequency": 1},
        }


def build_datamodule(batch_size: int = 32) -> DigitsDataModule:
    return DigitsDataModule(batch_size=batch_size)


@dataclass
class DemoResult:
    val_acc: float
    test_acc: float
    best_val_acc: float
    checkpoint_dir: str
    best_model_path: str
    last_model_path: str
    fit_seconds: float
    log_dir: str = ""
    plot_path: str | None = None


def run(
    max_epochs: int = 15,
    default_root_dir: str = "demo_runs",
    devices: int = 1,
    seed: int = 42,
    enable_progress_bar: bool = True,
    plugin: str | None = None,
) -> DemoResult | None:
    """Fit, then test; return (on global rank 0) the accuracies and where the checkpoints went."""
    seed_everything(seed, workers=True)
    datamodule = build_datamodule()
    model = DigitsClassifier()
    checkpoint = ModelCheckpoint(monitor="val_acc", mode="max", save_last=True)
    # CSV first: the checkpoints go under its version folder, and the picture is drawn from it.
    loggers: list[Any] = [CSVLogger(default_root_dir)]
    if tensorboard_available():
        loggers.append(TensorBoardLogger(default_root_dir, name="tensorboard"))
    trainer = Trainer(
        max_epochs=max_epochs,
        devices=devices,
        plugins=plugin or ("single_device" if devices == 1 else "ddp_sharded"),
        default_root_dir=default_root_dir,
        callbacks=[checkpoint, LearningRateMonitor(logging_interval="epoch")],
        logger=loggers,
        log_every_n_steps=10,
        enable_progress_bar=enable_progress_bar,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule)
    fit_seconds = time.perf_counter() - start
    val_acc = float(trainer.callback_metrics["val_acc"])
    (test_metrics,) = trainer.test(model, datamodule=datamodule, verbose=False)
    if not trainer.is_global_zero:
        return None
    return DemoResult(
        log_dir=loggers[0].log_dir,
        plot_path=_draw_metrics(loggers[0].log_dir),
        val_acc=val_acc,
        test_acc=float(test_metrics["test_acc"]),
        best_val_acc=float(checkpoint.best_model_score),
        checkpoint_dir=str(checkpoint.dirpath),
        best_model_path=str(checkpoint.best_model_path),
        last_model_path=str(checkpoint.last_model_path),
        fit_seconds=fit_seconds,
    )


def _draw_metrics(log_dir: str) -> str | None:
    """The loss, learning-rate and accuracy curves as a PNG beside metrics.csv (needs matplotlib)."""
    try:
        from trainer_core.plot import plot_metrics

        return plot_metrics(log_dir)
    except ModuleNotFoundError as err:  # matplotlib is optional: the run itself succeeded
        print(f"No plot: {err}")
        return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-epochs", type=int, default=15)
    parser.add_argument("--default-root-dir", default="demo_runs", help="local path or fsspec URL")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--devices", type=int, default=1, help="number of processes on this machine")
    parser.add_argument(
        "--plugin",
        default=None,
        help="training-type plugin (default: single_device for 1 process, ddp_sharded for several)",
    )
    args = parser.parse_args(argv)
    if args.devices < 1:
        parser.error("--devices: use 1 or more")
    return args


def main(argv: Sequence[str] | None = None) -> DemoResult | None:
    args = parse_args(argv)
    result = run(
        max_epochs=args.max_epochs,
        default_root_dir=args.default_root_dir,
        devices=args.devices,
        seed=args.seed,
        plugin=args.plugin,
    )
    if result is None:  # not global rank 0: rank 0 reports
        return result
    print()
    print(f"Final validation accuracy: {result.val_acc:.2%}  (best {result.best_val_acc:.2%})")
    print(f"Test accuracy:             {result.test_acc:.2%}")
    print(f"Training time:             {result.fit_seconds:.1f} s for {args.max_epochs} epochs")
    print(f"Checkpoints in {result.checkpoint_dir}")
    print(f"  best: {result.best_model_path}")
    print(f"  last: {result.last_model_path}")
    print(f"Metrics in {result.log_dir}")
    if result.plot_path:
        print(f"  plot: {result.plot_path}")
    return result


if __name__ == "__main__":
    main()
