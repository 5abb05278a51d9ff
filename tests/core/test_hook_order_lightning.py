"""Every hook, in Lightning's order: the same recording module and callback under Lightning and trainer-core.

``test_hook_order_doc.py`` holds the order to ``docs/architecture.md``; this file holds it to
Lightning 2.x itself. One module class and one callback class are built twice, on each framework's
base classes, overriding every hook both frameworks have (so each calls all of them, as for a user
who overrides everything) to record its name on entry. Each run (fit, validate, test, predict, a
resumed fit, and fit with two validation loaders and gradient accumulation) goes through both
trainers with the same settings, and the two recordings must be equal.
"""

from __future__ import annotations

import inspect
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import trainer_core

pl = pytest.importorskip("pytorch_lightning")

# Methods the user calls (not hooks the trainer calls), and hooks only one framework has.
NOT_HOOKS = {
    "forward",
    "log",
    "log_dict",
    "all_gather",
    "print",
    "save_hyperparameters",
    "optimizers",
    "lr_schedulers",
    "manual_backward",
    "toggle_optimizer",
    "untoggle_optimizer",
    "toggled_optimizer",
    "clip_gradients",
    "freeze",
    "unfreeze",
    "to_torchscript",
    "to_onnx",
    "load_from_checkpoint",
}


def _public(cls: type) -> set[str]:
    return {name for name, fn in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}


def _recording(owner: str, name: str, implementation: Callable[..., Any]) -> Callable[..., Any]:
    def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
        self.called.append(f"{owner}.{name}")
        return implementation(self, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    return hook


def _loader(n: int = 8) -> DataLoader:
    gen = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)), batch_size=2
    )


def build(framework: Any, called: list[str], val_loaders: int = 1) -> tuple[Any, Any]:
    class Tiny(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x), y))

        def test_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("test_loss", nn.functional.mse_loss(self(x), y))

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self(batch[0])

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

        def train_dataloader(self) -> DataLoader:
            return _loader()

        def val_dataloader(self) -> Any:
            return _loader() if val_loaders == 1 else [_loader(), _loader(4)]

        def test_dataloader(self) -> DataLoader:
            return _loader()

        def predict_dataloader(self) -> DataLoader:
            return _loader()

    class Stateful(framework.Callback):
        def state_dict(self) -> dict[str, Any]:
            return {"recorded": True}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            pass

    module_hooks = sorted(
        (_public(trainer_core.LightningModule) & _public(pl.LightningModule)) - NOT_HOOKS - _public(nn.Module)
        | {"configure_model", "setup", "teardown"}
    )
    callback_hooks = sorted(_public(trainer_core.Callback) & _public(pl.Callback))
    module_cls = type(
        "RecordingTiny",
        (Tiny,),
        {n: _recording("LightningModule", n, getattr(Tiny, n)) for n in module_hooks},
    )
    callback_cls = type(
        "Recording", (Stateful,), {n: _recording("Callback", n, getattr(Stateful, n)) for n in callback_hooks}
    )
    torch.manual_seed(0)
    module, callback = module_cls(), callback_cls()
    module.called = callback.called = called
    return module, callback


def trainer(framework: Any, tmp_path: Path, callback: Any, **overrides: Any) -> Any:
    kwargs: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=1,
        limit_test_batches=2,
        limit_predict_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[callback, framework.callbacks.ModelCheckpoint(dirpath=tmp_path / "checkpoints")],
    )
    kwargs.update(overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return framework.Trainer(**kwargs)


def record(framework: Any, tmp_path: Path, run: str) -> list[str]:
    called: list[str] = []
    folder = tmp_path / framework.__name__
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if run == "fit-resumed":
            module, callback = build(framework, [])
            first = trainer(framework, folder, callback, limit_val_batches=0)
            first.fit(module)
            path = first.checkpoint_callback.best_model_path
            module, callback = build(framework, called)
            trainer(framework, folder, callback, limit_val_batches=0, max_epochs=2).fit(
                module, ckpt_path=path
            )
        elif run == "fit-accumulate-two-val-loaders":
            module, callback = build(framework, called, val_loaders=2)
            trainer(framework, folder, callback, limit_train_batches=4, accumulate_grad_batches=2).fit(module)
        else:
            module, callback = build(framework, called)
            t = trainer(framework, folder, callback)
            if run == "fit":
                t.fit(module)
            elif run == "predict":
                t.predict(module)
            else:
                getattr(t, run)(module, verbose=False)
    return called


def _first_difference(ours: list[str], theirs: list[str]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            lo = max(0, i - 4)
            return f"call {i}: trainer-core {ours[lo : i + 4]}, Lightning {theirs[lo : i + 4]}"
    return f"trainer-core made {len(ours)} calls, Lightning {len(theirs)}: {ours[len(theirs) :] or theirs[len(ours) :]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "run", ["fit", "validate", "test", "predict", "fit-resumed", "fit-accumulate-two-val-loaders"]
)
def test_hooks_run_in_lightnings_order(run: str, tmp_path: Path) -> None:
    ours = record(trainer_core, tmp_path, run)
    theirs = record(pl, tmp_path, run)
    assert len(ours) > 20
    assert ours == theirs, _first_difference(ours, theirs)
