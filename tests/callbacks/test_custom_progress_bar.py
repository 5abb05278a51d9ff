"""Subclasses of ``TQDMProgressBar`` written for Lightning get Lightning's bars.

Each customised bar runs fit (two validation dataloaders, a sanity check), validate, test and
predict under Lightning and under trainer-core in-process; the bars each ``init_*_tqdm`` made
(description, total, batches shown, disabled, leave, position, the postfix at each epoch end) and
the descriptions and totals written to stdout and stderr are compared.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import pytorch_lightning as pl
import torch
import tqdm
from pytorch_lightning.callbacks.progress.tqdm_progress import Tqdm as PLTqdm
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import trainer_core as tc
from trainer_core.callbacks.progress import Tqdm as TCTqdm

FRAMEWORKS = {"lightning": (pl, PLTqdm), "trainer_core": (tc, TCTqdm)}
_LINE = re.compile(r"([^\r\n|]*?):\s+\d+%\|[^|]*\| (\d+)/(\d+|\?)")


def _module(base: type) -> Any:
    class Tiny(base):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = nn.functional.mse_loss(self.layer(batch[0]), batch[1])
            self.log("train_loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
            self.log("val_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]), prog_bar=True)

        def test_step(self, batch: Any, batch_idx: int) -> None:
            self.log("test_loss", nn.functional.mse_loss(self.layer(batch[0]), batch[1]))

        def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.layer(batch[0])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def _loader(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    return DataLoader(
        TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)), batch_size=2
    )


def _state(bar: Any) -> tuple:
    return (getattr(bar, "desc", None), bar.n, bar.total, bar.disable, bar.leave, bar.pos)


def _recording(base: type) -> type:
    """``base`` recording each bar its ``init_*_tqdm`` returns, and their state before they close."""

    class Recording(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.created: list[str] = []
            self.seen: list[tuple] = []
            self.postfixes: list[str] = []

        def _made(self, kind: str, bar: Any) -> Any:
            self.created.append(f"{kind}:{type(bar).__name__}")
            return bar

        def init_sanity_tqdm(self) -> Any:
            return self._made("sanity", super().init_sanity_tqdm())

        def init_train_tqdm(self) -> Any:
            return self._made("train", super().init_train_tqdm())

        def init_validation_tqdm(self) -> Any:
            return self._made("validation", super().init_validation_tqdm())

        def init_test_tqdm(self) -> Any:
            return self._made("test", super().init_test_tqdm())

        def init_predict_tqdm(self) -> Any:
            return self._made("predict", super().init_predict_tqdm())

        def on_sanity_check_end(self, *args: Any) -> None:
            self.seen.append(("sanity", *_state(self.val_progress_bar)))
            super().on_sanity_check_end(*args)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            super().on_train_epoch_end(trainer, pl_module)
            self.seen.append(("train", *_state(self.train_progress_bar)))
            self.postfixes.append(self.train_progress_bar.postfix)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                self.seen.append(("validation", *_state(self.val_progress_bar)))
            super().on_validation_end(trainer, pl_module)

        def on_test_end(self, *args: Any) -> None:
            self.seen.append(("test", *_state(self.test_progress_bar)))
            super().on_test_end(*args)

        def on_predict_end(self, *args: Any) -> None:
            self.seen.append(("predict", *_state(self.predict_progress_bar)))
            super().on_predict_end(*args)

    return Recording


def _default(fw: Any, tqdm_cls: type) -> type:
    return _recording(fw.callbacks.TQDMProgressBar)


def _hidden_validation(fw: Any, tqdm_cls: type) -> type:
    class HiddenValidation(_recording(fw.callbacks.TQDMProgressBar)):
        def init_validation_tqdm(self) -> Any:
            bar = super().init_validation_tqdm()
            bar.disable = True
            return bar

    return HiddenValidation


def _own_train_bar(fw: Any, tqdm_cls: type) -> type:
    """A training bar of plain ``tqdm`` (not the framework's class), to stdout, with its own name."""

    class OwnTrainBar(_recording(fw.callbacks.TQDMProgressBar)):
        def init_train_tqdm(self) -> Any:
            bar = tqdm.tqdm(
                desc="custom training",
                position=2 * self.process_position,
                disable=self.is_disabled,
                leave=True,
                dynamic_ncols=True,
                file=sys.stdout,
            )
            return self._made("train", bar)

    return OwnTrainBar


def _custom_eval_bars(fw: Any, tqdm_cls: type) -> type:
    """Sanity bar hidden, test bar not left, predict bar from the framework's ``Tqdm`` class."""

    class CustomEvalBars(_recording(fw.callbacks.TQDMProgressBar)):
        def init_sanity_tqdm(self) -> Any:
            bar = super().init_sanity_tqdm()
            bar.disable = True
            return bar

        def init_test_tqdm(self) -> Any:
            bar = super().init_test_tqdm()
            bar.leave = False
            return bar

        def init_predict_tqdm(self) -> Any:
            bar = tqdm_cls(
                desc="predicting", position=1, leave=True, file=sys.stdout, bar_format=self.BAR_FORMAT
            )
            return self._made("predict", bar)

    return CustomEvalBars


def _no_version(fw: Any, tqdm_cls: type) -> type:
    class NoVersion(_recording(fw.callbacks.TQDMProgressBar)):
        def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, Any]:
            items = super().get_metrics(trainer, pl_module)
            items.pop("v_num", None)
            items["extra"] = "x"
            return items

    return NoVersion


def _run(name: str, make_bar: Callable, tmp_path: Path, **bar_kwargs: Any) -> tuple[Any, str]:
    fw, tqdm_cls = FRAMEWORKS[name]
    bar = make_bar(fw, tqdm_cls)(**bar_kwargs)
    out = io.StringIO()
    # Lightning's bars go to stdout, trainer-core's default ones to stderr: both streams are read.
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        fw.seed_everything(0)
        model = _module(fw.LightningModule)
        trainer = fw.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            num_sanity_val_steps=2,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path / name,
            callbacks=[bar],
        )
        trainer.fit(model, _loader(10), [_loader(6), _loader(4)])
        trainer.validate(model, _loader(6))
        trainer.test(model, _loader(4))
        trainer.predict(model, _loader(6))
    return bar, out.getvalue()


def _drawn(text: str) -> set[tuple[str, str, str]]:
    """(description, batches, total) of every bar line written."""
    return {(d.strip(), n, t) for d, n, t in _LINE.findall(text)}


CUSTOM_BARS = [_default, _hidden_validation, _own_train_bar, _custom_eval_bars, _no_version]


@pytest.mark.parametrize("make_bar", CUSTOM_BARS, ids=lambda f: f.__name__.strip("_"))
def test_customised_bars_match_lightning(make_bar: Callable, tmp_path: Path) -> None:
    (pl_bar, pl_text), (tc_bar, tc_text) = (_run(n, make_bar, tmp_path) for n in FRAMEWORKS)
    assert tc_bar.created == pl_bar.created
    assert tc_bar.seen == pl_bar.seen
    assert tc_bar.postfixes == pl_bar.postfixes
    assert pl_bar.postfixes[-1] in pl_text and pl_bar.postfixes[-1] in tc_text
    # Lightning redraws at every batch, trainer-core at most ten times a second: the final lines agree.
    finished = {line for line in _drawn(pl_text) if line[1] == line[2]}
    assert finished and finished <= _drawn(tc_text)
    assert {(d, t) for d, _, t in _drawn(tc_text)} == {(d, t) for d, _, t in _drawn(pl_text)}


def test_refresh_rate_leave_and_position_match_lightning(tmp_path: Path) -> None:
    kwargs = {"refresh_rate": 3, "leave": True, "process_position": 1}
    (pl_bar, pl_text), (tc_bar, tc_text) = (_run(n, _default, tmp_path, **kwargs) for n in FRAMEWORKS)
    assert (tc_bar.refresh_rate, tc_bar.process_position, tc_bar.leave) == (3, 1, True)
    assert tc_bar.created == pl_bar.created  # leave=True: a new training bar each epoch
    assert tc_bar.seen == pl_bar.seen
    assert tc_bar.postfixes == pl_bar.postfixes
    assert {(d, t) for d, _, t in _drawn(tc_text)} == {(d, t) for d, _, t in _drawn(pl_text)}


class _Unsized(IterableDataset):
    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(0)
        for _ in range(6):
            yield torch.randn(4, generator=g), torch.randn(1, generator=g)


@pytest.mark.parametrize(
    ("trainer_kwargs", "unsized"),
    [({"val_check_interval": 2}, False), ({}, True), ({"max_epochs": -1, "max_steps": 7}, False)],
    ids=["mid_epoch_validation", "unsized_loader", "max_steps"],
)
def test_fit_variants_match_lightning(trainer_kwargs: dict, unsized: bool, tmp_path: Path) -> None:
    """Bars without a total, validation inside an epoch, a total capped by ``max_steps``."""
    seen = {}
    for name, (fw, tqdm_cls) in FRAMEWORKS.items():
        bar = _default(fw, tqdm_cls)()
        fw.seed_everything(0)
        kwargs = {"max_epochs": 1, "logger": False, **trainer_kwargs}
        trainer = fw.Trainer(
            accelerator="cpu",
            devices=1,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=tmp_path / name,
            callbacks=[bar],
            **kwargs,
        )
        train = DataLoader(_Unsized(), batch_size=2) if unsized else _loader(10)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            trainer.fit(_module(fw.LightningModule), train, _loader(6))
        seen[name] = (bar.created, bar.seen, bar.postfixes)
    assert seen["trainer_core"] == seen["lightning"]


def test_members_before_use_and_disabled_bar() -> None:
    for fw, _ in FRAMEWORKS.values():
        bar = fw.callbacks.TQDMProgressBar(refresh_rate=0)
        assert (bar.is_enabled, bar.is_disabled) == (False, True)
        bar = fw.callbacks.TQDMProgressBar()
        assert bar.BAR_FORMAT == pl.callbacks.TQDMProgressBar.BAR_FORMAT
        bar.disable()
        assert bar.is_disabled
        bar.enable()
        assert bar.is_enabled
        with pytest.raises(TypeError, match="_train_progress_bar"):
            _ = bar.train_progress_bar
        with pytest.raises(TypeError, match="_trainer"):
            _ = bar.trainer


RICH_MODULE = {"lightning": "progress.rich_progress", "trainer_core": "rich_progress"}


def _rich_run(name: str, tmp_path: Path) -> str:
    fw, _ = FRAMEWORKS[name]
    theme_cls = importlib.import_module(f"{fw.__name__}.callbacks.{RICH_MODULE[name]}").RichProgressBarTheme
    out = io.StringIO()
    theme = theme_cls(metrics="bold red", metrics_format=".2e", metrics_text_delimiter=" | ")
    bar = fw.callbacks.RichProgressBar(
        refresh_rate=5, theme=theme, console_kwargs={"file": out, "force_terminal": True, "width": 200}
    )
    fw.seed_everything(0)
    trainer = fw.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path / name,
        callbacks=[bar],
    )
    trainer.fit(_module(fw.LightningModule), _loader(10), _loader(6))
    return out.getvalue()


def test_rich_theme_and_metrics_match_lightning(tmp_path: Path) -> None:
    pytest.importorskip("rich")
    pl_text, tc_text = (_rich_run(name, tmp_path) for name in FRAMEWORKS)
    # The theme's metrics style (bold red = ESC[1;31m), format and delimiter, on the final training line.
    styled = re.compile(r"\x1b\[1;31m(v_num[^\x1b]*)\x1b\[0m")
    final = styled.findall(pl_text)[-1]
    number = r"\d\.\d\de[+-]\d\d"
    assert re.fullmatch(rf"v_num: 0\.00e\+00 \| train_loss: {number} \| val_loss: {number}", final), final
    assert styled.findall(tc_text)[-1] == final
    assert "5/5" in pl_text and "5/5" in tc_text
