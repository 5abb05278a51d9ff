"""BasePredictionWriter: each prediction reaches the writer with the data-set indices of its samples, per
batch and per epoch, with a shuffled loader, several loaders, workers that fetch ahead, and 2 DDP ranks
(tests/jobs/prediction_writer_job.py) whose files cover the data set exactly once.

The inputs hold their own index and the module predicts ``10 * index``, so a test can tell from a
prediction which sample it belongs to and compare that with the indices the writer got.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from boring import quiet_trainer
from launch import JOBS, job_env
from prediction_writer_job import SAMPLES, TimesTen, dataset
from torch.utils.data import DataLoader

from trainer_core.callbacks.prediction_writer import BasePredictionWriter
from trainer_core.errors import MisconfigurationException


class Recording(BasePredictionWriter):
    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)  # type: ignore[arg-type]
        self.batches: list[tuple[torch.Tensor, Optional[list[int]], torch.Tensor, int, int]] = []
        self.epochs: list[tuple[Any, Any]] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.batches.append((prediction, batch_indices, batch[0].squeeze(1), batch_idx, dataloader_idx))

    def write_on_epoch_end(self, trainer: Any, pl_module: Any, predictions: Any, batch_indices: Any) -> None:
        self.epochs.append((predictions, batch_indices))


def _shuffled(seed: int = 0, **kwargs: Any) -> DataLoader:
    return DataLoader(
        dataset(), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed), **kwargs
    )


def test_batch_indices_name_the_samples_of_a_shuffled_loader() -> None:
    writer = Recording("batch_and_epoch")
    loader = _shuffled()
    returned = quiet_trainer(callbacks=[writer]).predict(TimesTen(), loader)
    assert len(writer.batches) == 4  # 11 samples, 3 a batch
    for prediction, indices, inputs, _, dataloader_idx in writer.batches:
        assert indices == inputs.long().tolist()  # the indices are those of the samples in the batch
        assert torch.equal(prediction, 10 * inputs)
        assert dataloader_idx == 0
    order = [i for _, indices, *_ in writer.batches for i in indices]
    assert sorted(order) == list(range(SAMPLES)) and order != list(range(SAMPLES))  # shuffled, each once
    # Epoch: Lightning's shapes (one dataloader: a list of batch predictions; indices nested per loader).
    ((predictions, epoch_indices),) = writer.epochs
    assert epoch_indices == [[indices for _, indices, *_ in writer.batches]]
    assert all(torch.equal(a, b[0]) for a, b in zip(predictions, writer.batches))
    assert all(torch.equal(a, b) for a, b in zip(returned, predictions))
    # The loader is given back as it was.
    assert type(loader.batch_sampler).__name__ == "BatchSampler"


def test_epoch_writer_keeps_predictions_even_when_none_are_returned() -> None:
    writer = Recording("epoch")
    trainer = quiet_trainer(callbacks=[writer])
    assert trainer.predict(TimesTen(), _shuffled(1), return_predictions=False) is None
    assert writer.batches == []
    ((predictions, (indices,)),) = writer.epochs
    for prediction, batch in zip(predictions, indices):
        assert prediction.tolist() == [10.0 * i for i in batch]
    assert sorted(i for batch in indices for i in batch) == list(range(SAMPLES))
    assert trainer.predict_loop.outputs == []  # dropped once written


def test_several_loaders_and_a_limit() -> None:
    writer = Recording("batch_and_epoch")
    first = _shuffled(2)
    second = DataLoader(dataset(), batch_size=4)
    quiet_trainer(callbacks=[writer], limit_predict_batches=2).predict(TimesTen(), [first, second])
    assert [(b[3], b[4]) for b in writer.batches] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    for prediction, indices, inputs, _, _ in writer.batches:
        assert indices == inputs.long().tolist() and torch.equal(prediction, 10 * inputs)
    ((predictions, indices),) = writer.epochs
    assert len(predictions) == 2 and [len(p) for p in predictions] == [2, 2]
    assert indices[1] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert indices[0] == [writer.batches[0][1], writer.batches[1][1]]


@pytest.mark.timeout(60)
def test_workers_fetching_ahead_do_not_shift_the_indices() -> None:
    writer = Recording("batch_and_epoch")
    loader = _shuffled(3, num_workers=1, prefetch_factor=4)
    quiet_trainer(callbacks=[writer], limit_predict_batches=2).predict(TimesTen(), loader)
    for prediction, indices, inputs, _, _ in writer.batches:
        assert indices == inputs.long().tolist() and torch.equal(prediction, 10 * inputs)
    ((_, (indices,)),) = writer.epochs
    # The worker fetched more batches than were predicted; only the two predicted ones are reported.
    assert indices == [writer.batches[0][1], writer.batches[1][1]]


def test_without_a_writer_nothing_is_recorded() -> None:
    loader = _shuffled()
    sampler = loader.batch_sampler
    trainer = quiet_trainer()
    trainer.predict(TimesTen(), loader)
    assert loader.batch_sampler is sampler and trainer.predict_loop.recorders == []


class _Batches:
    """An iterable of batches that is not a DataLoader: nothing says which samples it holds."""

    def __iter__(self) -> Any:
        yield (torch.tensor([[2.0]]),)
        yield (torch.tensor([[5.0]]),)


def test_a_loader_without_batch_sampler_gives_none() -> None:
    writer = Recording("batch")
    with pytest.warns(UserWarning, match="cannot know the sample indices of a _Batches"):
        quiet_trainer(callbacks=[writer]).predict(TimesTen(), _Batches())
    assert [b[1] for b in writer.batches] == [None, None]
    assert [b[0].tolist() for b in writer.batches] == [[20.0], [50.0]]


def test_bad_interval_and_missing_override() -> None:
    with pytest.raises(MisconfigurationException, match=r"write_interval='step'"):
        Recording("step")
    with pytest.raises(NotImplementedError, match="override write_on_batch_end"):
        quiet_trainer(callbacks=[BasePredictionWriter("batch")]).predict(TimesTen(), _shuffled())


@pytest.mark.timeout(180)
def test_two_ddp_ranks_write_every_sample_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "prediction_writer_job.py"), "--out", str(out)],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    seen: list[int] = []
    for rank in (0, 1):
        epoch = torch.load(out / f"epoch_{rank}.pt")
        (batches,) = epoch["indices"]
        batch_files = sorted(out.glob(f"batch_{rank}_*.pt"))
        assert len(batch_files) == len(batches) == len(epoch["predictions"])
        for i, (indices, prediction) in enumerate(zip(batches, epoch["predictions"])):
            written = torch.load(out / f"batch_{rank}_{i}.pt")
            assert written["indices"] == indices == written["inputs"].long().tolist()
            assert prediction.tolist() == written["prediction"].tolist() == [10.0 * j for j in indices]
            seen.extend(indices)
    # No padding in prediction (Lightning's unrepeated sampler): 6 + 5 samples, each on one rank.
    assert sorted(seen) == list(range(SAMPLES))
