"""The scalar event writer: the bytes SummaryWriter writes, TensorBoard's reader reads them, no TensorBoard import."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from trainer_core.hparams import hparams_to_yaml
from trainer_core.loggers import TensorBoardLogger
from trainer_core.loggers.tfevents import ScalarEventWriter, record, scalar_event

VALUES = [0.0, -0.0, 1.5, -2.25, 1e40, -1e40, 1e-45, math.inf, math.nan, 3, True]
STEPS = [None, 0, 1, 49, 2**40, -3]


class _Bytes:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("value", VALUES)
def test_a_scalar_event_is_the_record_tensorboard_writes(value: float, step: int) -> None:
    """Byte for byte: protobuf's serialization of the event SummaryWriter.add_scalar builds, in TensorBoard's framing."""
    summary = summary_pb2.Summary(
        value=[summary_pb2.Summary.Value(tag="train/loss", simple_value=float(value))]
    )
    event = event_pb2.Event(wall_time=1733250000.125, summary=summary)
    if step is not None:
        event.step = step
    framed = _Bytes()
    RecordWriter(framed).write(event.SerializeToString())
    assert record(scalar_event("train/loss", float(value), step, 1733250000.125)) == framed.data


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {t: [(e.step, e.value) for e in accumulator.Scalars(t)] for t in accumulator.Tags()["scalars"]}


def test_tensorboard_reads_the_file_and_its_first_event_is_tensorboards(tmp_path: Path) -> None:
    writer = ScalarEventWriter(str(tmp_path), filename_suffix=".v2")
    for step in range(5):
        writer.add_scalar("loss", torch.tensor(1.0 / (step + 1)), step)
        writer.add_scalar("epoch", 0, step)
    writer.close()
    assert Path(writer.path).name.endswith(".v2") and Path(writer.path).name.startswith(
        "events.out.tfevents."
    )
    assert _scalars(tmp_path) == {
        "loss": [(s, pytest.approx(1.0 / (s + 1))) for s in range(5)],
        "epoch": [(s, 0.0) for s in range(5)],
    }
    with pytest.raises(ValueError, match="closed"):
        writer.add_scalar("loss", 1.0, 6)
    with pytest.raises(TypeError, match="log a number"):
        ScalarEventWriter(str(tmp_path)).add_scalar("loss", "1.0", 0)


def test_the_default_logger_imports_nothing_but_its_own_modules(tmp_path: Path) -> None:
    """The point of the writer: a fit that logs metrics to the default logger imports no module a fit
    without a logger did not (TensorBoard, PyYAML for an empty hparams.yaml, ``packaging`` to find
    TensorBoard), and TensorBoard reads back the scalars it wrote."""
    program = f"""
import json, sys, torch
from trainer_core import LightningModule, Trainer

class M(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
    def training_step(self, batch, batch_idx):
        loss = self.layer(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(**logger):
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 2)), batch_size=4)
    trainer = Trainer(default_root_dir={str(tmp_path)!r}, max_epochs=2, log_every_n_steps=3, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, **logger)
    trainer.fit(M(), data)
    return trainer

fit(logger=False)
before = set(sys.modules)
trainer = fit()
# The loggers' own modules, and fsspec, which resolves the folder (a fit without a logger or checkpoints
# never loads it), with the one standard-library module fsspec brings.
added = sorted(
    m for m in set(sys.modules) - before
    if not m.startswith(("trainer_core.loggers", "fsspec")) and m != "configparser"
)
print(json.dumps({{"added": added, "logged": trainer.logged_metrics["loss"]}}))
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["added"] == []
    folder = tmp_path / "lightning_logs" / "version_0"
    assert len(list(folder.glob("events.out.tfevents.*"))) == 1
    assert (folder / "hparams.yaml").read_text() == hparams_to_yaml({})
    scalars = _scalars(folder)
    assert [s for s, _ in scalars["loss"]] == [2, 5, 8, 11, 14]
    assert scalars["loss"][-1][1] == pytest.approx(out["logged"], rel=1e-6)
    assert [v for _, v in scalars["epoch"]] == [0, 0, 1, 1, 1]


def test_experiment_after_scalars_hands_over_in_order(tmp_path: Path) -> None:
    """A program's first ``experiment`` call after scalars: a second file that sorts after the first, nothing lost."""
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    first = logger._scalars
    logger.experiment.add_text("note", "after the scalars", 3)
    logger.log_metrics({"loss": 3.0}, step=3)
    logger.finalize("success")
    files = sorted(Path(logger.log_dir).glob("events.out.tfevents.*"))
    assert len(files) == 2 and files[0] == Path(first.path)
    assert _scalars(Path(logger.log_dir))["loss"] == [(s, float(s)) for s in range(4)]
    # The SummaryWriter stays for the rest of the logger's life: a later stage writes no scalar-only file.
    logger.log_metrics({"loss": 4.0}, step=4)
    assert logger._scalars is None and logger._writer is not None
    logger.finalize("success")


def test_summary_writer_arguments_the_scalar_writer_lacks_keep_the_summary_writer(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="run", version=0, purge_step=0)
    logger.log_metrics({"loss": 1.0}, step=1)
    assert logger._scalars is None and logger._writer is not None
    logger.finalize("success")
    suffixed = TensorBoardLogger(tmp_path, name="run", version=1, filename_suffix=".x", flush_secs=5)
    suffixed.log_metrics({"loss": 1.0}, step=1)
    assert suffixed._writer is None and suffixed._scalars._flush_secs == 5
    suffixed.finalize("success")
    assert [p.suffix for p in Path(suffixed.log_dir).glob("events.out.tfevents.*")] == [".x"]
