"""PipelinePlugin splits the computation of forwards that are not a chain of submodules (issue 13).

The pipelined runs (``tests/jobs/pipeline_split_job.py``, 2 gloo ranks, started the way a user starts a
script) must train the function one process trains: the same loss at every step (to 1e-5: the
micro-batches sum in another order) and the same final weights, under the module's own names. A
forward the tracer cannot split is refused before anything trains.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env
from pipeline_split_job import BATCH_SIZE, MODELS, data, run
from torch.utils.data import DataLoader

from trainer_core import Trainer
from trainer_core.callbacks import Callback
from trainer_core.checkpoint import KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import PipelinePlugin
from trainer_core.plugins.io import TorchCheckpointIO

JOB = str(JOBS / "pipeline_split_job.py")
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-5  # 4 SGD steps from the same weights; measured differences are below 1e-6
FOUR_STAGES = "layers.1,layers.2,layers.3"

pytestmark = pytest.mark.timeout(240)


def _launch(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = job_env()
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, JOB, "--out", str(out), *args],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )


def _pipelined(out: Path, *args: str) -> list[dict[str, Any]]:
    """Run the job on 2 ranks; every rank's record, in rank order."""
    proc = _launch(out, *args)
    if proc.returncode != 0:
        pytest.fail(
            f"job {args} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def _single(out: Path, model: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The same module trained by the single-device plugin, in this process: its record and final weights."""
    module = run(out, model, plugin="single_device")
    return json.loads((out / "rank0.json").read_text()), {
        k: v.detach().clone() for k, v in module.state_dict().items()
    }


def _assert_same_training(
    records: list[dict[str, Any]], reference: dict[str, Any], weights: dict[str, torch.Tensor], ckpt: Path
) -> None:
    """Every rank reports the single device's loss at every step; the checkpoint holds its final weights."""
    for rank, record in enumerate(records):
        assert len(record["losses"]) == len(reference["losses"]) == 4, f"rank {rank}"
        for step, (loss, expected) in enumerate(zip(record["losses"], reference["losses"]), start=1):
            assert abs(loss - expected) <= LOSS_TOL, (
                f"rank {rank} step {step}: {loss} vs one process {expected}"
            )
        assert abs(record["val_loss"] - reference["val_loss"]) <= LOSS_TOL, f"rank {rank} val_loss"
    state = TorchCheckpointIO().load_checkpoint(str(ckpt))[KEY_STATE_DICT]
    # The original fully-qualified names, in the module's order, whatever rank held them.
    assert list(state) == list(weights)
    for name, expected in weights.items():
        torch.testing.assert_close(state[name], expected, atol=WEIGHT_TOL, rtol=0, msg=name)


def test_tanh_between_layers_interleaved(tmp_path: Path) -> None:
    """The forward of issue 13 (``tanh`` between the split layers), 4 stages on 2 ranks, 4 micro-batches."""
    reference, weights = _single(tmp_path / "single", "TanhNet")
    records = _pipelined(
        tmp_path / "pp", "--model", "TanhNet", "--schedule", "Interleaved1F1B", "--split", FOUR_STAGES
    )
    # The loss of the first step already differed when every stage ran the whole forward.
    assert abs(records[0]["losses"][0] - reference["losses"][0]) <= LOSS_TOL
    _assert_same_training(records, reference, weights, tmp_path / "pp" / "final.ckpt")
    assert [r["stage_ids"] for r in records] == [[0, 2], [1, 3]]
    assert records[0]["part_parameters"] == [
        ["layers.0.weight", "layers.0.bias"],
        ["layers.2.weight", "layers.2.bias"],
    ]
    assert records[1]["part_parameters"][1] == [
        "layers.3.weight",
        "layers.3.bias",
        "head.weight",
        "head.bias",
    ]
    assert records[0]["identity_layers"] == [[], []]

    # The pipeline's checkpoint loads under the single-device plugin, by name, with its values.
    module = MODELS["TanhNet"]()
    trainer = Trainer(
        plugins="single_device", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (metrics,) = trainer.validate(
        module,
        DataLoader(data(BATCH_SIZE, seed=1), batch_size=BATCH_SIZE),
        ckpt_path=str(tmp_path / "pp" / "final.ckpt"),
        verbose=False,
    )
    for name, value in module.state_dict().items():
        torch.testing.assert_close(value, weights[name], atol=WEIGHT_TOL, rtol=0, msg=name)
    assert abs(metrics["val_loss"] - records[0]["val_loss"]) <= LOSS_TOL


def test_residual_and_skip_connections(tmp_path: Path) -> None:
    """``x = x + tanh(layer(x))`` in every stage, and the first stage's output used by the last one:
    the stages in between pass it on."""
    reference, weights = _single(tmp_path / "single", "ResidualNet")
    records = _pipelined(
        tmp_path / "pp", "--model", "ResidualNet", "--schedule", "Interleaved1F1B", "--split", FOUR_STAGES
    )
    _assert_same_training(records, reference, weights, tmp_path / "pp" / "final.ckpt")


def test_layer_called_twice_within_a_stage(tmp_path: Path) -> None:
    reference, weights = _single(tmp_path / "single", "SharedNet")
    records = _pipelined(
        tmp_path / "pp", "--model", "SharedNet", "--schedule", "GPipe", "--split", "layers.2"
    )
    _assert_same_training(records, reference, weights, tmp_path / "pp" / "final.ckpt")
    assert records[0]["part_parameters"] == [
        ["layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"]
    ]


def test_batch_norm_traced_for_training_and_evaluation(tmp_path: Path) -> None:
    """Training uses batch statistics and updates the running ones; validation uses the running ones.

    One micro-batch per batch: batch norm over a micro-batch is, by its nature, not the one over the batch.
    """
    reference, weights = _single(tmp_path / "single", "BatchNormNet")
    records = _pipelined(
        tmp_path / "pp",
        "--model",
        "BatchNormNet",
        "--schedule",
        "GPipe",
        "--split",
        "layers.2",
        "--n-microbatches",
        "1",
    )
    _assert_same_training(records, reference, weights, tmp_path / "pp" / "final.ckpt")
    assert "norm.running_mean" in records[0]["part_buffers"][0]


def test_manual_split_opt_in_keeps_the_identity_stages(tmp_path: Path) -> None:
    """``pipeline_manual_split = True``: nothing is traced; a stage is the module with the other
    stages' layers ``nn.Identity``, and a chain trains as on one device."""
    reference, weights = _single(tmp_path / "single", "ManualChainNet")
    records = _pipelined(
        tmp_path / "pp", "--model", "ManualChainNet", "--schedule", "GPipe", "--split", "layers.2"
    )
    _assert_same_training(records, reference, weights, tmp_path / "pp" / "final.ckpt")
    assert records[0]["identity_layers"] == [["layers.2", "layers.3", "head"]]
    assert records[1]["identity_layers"] == [["layers.0", "layers.1"]]


def test_untraceable_forward_is_refused_on_every_rank(tmp_path: Path) -> None:
    """The ranks stop in setup with the explanation, before any step (no rank writes its record)."""
    proc = _launch(tmp_path / "pp", "--model", "BranchNet", "--split", "layers.2")
    assert proc.returncode != 0
    assert "trainer_core.errors.MisconfigurationException: PipelinePlugin" in proc.stderr
    assert "could not trace BranchNet.forward" in (tmp_path / "pp" / "refused.rank0.txt").read_text()
    # Rank 1 refuses as well unless the launcher, seeing rank 0 fail, ended it first.
    refused_1 = tmp_path / "pp" / "refused.rank1.txt"
    assert not refused_1.exists() or "could not trace BranchNet.forward" in refused_1.read_text()
    assert not list((tmp_path / "pp").glob("rank*.json"))


# ---------------------------------------------------------------------- refusals (in this process, 1 rank)
class _CountSteps(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1


@pytest.fixture(autouse=True)
def _in_process_runs(no_process_group_left_behind: None) -> None:
    """The refusals below run the pipeline in this process."""


def _refusal(model: str) -> str:
    """Fit ``model`` with two stages on one rank; the refusal's message (and that no batch started)."""
    counter = _CountSteps()
    trainer = Trainer(
        plugins=[PipelinePlugin(split_points=["layers.2"], schedule="Interleaved1F1B")],
        devices=1,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[counter],
    )
    with pytest.raises(MisconfigurationException) as err:
        trainer.fit(MODELS[model](), DataLoader(data(), batch_size=BATCH_SIZE))
    assert counter.batches == 0
    return str(err.value)


def test_untraceable_forward_is_refused_with_the_way_out() -> None:
    message = _refusal("BranchNet")
    assert "could not trace BranchNet.forward" in message
    # The tracer's own first line, and the user's line it failed on.
    assert "GuardOnDataDependentSymNode: Could not guard on data-dependent expression" in message
    assert "pipeline_split_job.py" in message and "`if x.sum() > 0:`" in message
    assert "Make forward traceable" in message
    assert "set `pipeline_manual_split = True` on BranchNet" in message


def test_layer_used_by_two_stages_is_refused() -> None:
    """Each stage would train its own copy of ``layers.0`` (the tracer's replication), unlike one process."""
    message = _refusal("SharedAcrossStagesNet")
    assert (
        "SharedAcrossStagesNet.forward uses layers.0.bias, layers.0.weight in more than one stage" in message
    )
    assert "Move the split points so that every use of them falls in one stage" in message
