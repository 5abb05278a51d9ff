"""PipelinePlugin on real gloo process groups: schedules, resuming across pipeline shapes, pp x dp.

Each run is ``tests/jobs/pipeline_job.py`` started the way a user starts a script. The reference is the
same module trained by the single-device plugin ("pp 1"); the pipelined runs must report the same
losses (to 1e-5: micro-batching changes the order of summation), the same learning rates, and
checkpoints that load at any other pipeline degree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch import JOBS, job_env
from pipeline_job import PipeNet, data
from torch.utils.data import DataLoader

from trainer_core import Trainer
from trainer_core.checkpoint import KEY_LR_SCHEDULERS, KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import PipelinePlugin
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO

JOB = str(JOBS / "pipeline_job.py")
STEPS = 16  # two epochs of 8 batches, validation after each
LOSS_TOL = 1e-5
FULL = os.environ.get("FULL_MATRIX") == "1"

pytestmark = pytest.mark.timeout(400)


def _run(out: Path, *args: str) -> list[dict[str, Any]]:
    """Run the job; every rank's record, in rank order."""
    env = job_env()
    proc = subprocess.run(
        [sys.executable, JOB, "--out", str(out), *args],
        cwd=out.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"job {args} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    records = sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in records]


def _assert_matches(record: dict[str, Any], reference: dict[str, Any], where: str) -> None:
    """Losses (to 1e-5) and learning rates (exactly) of ``record``'s steps equal the reference's same steps."""
    assert record["steps"], f"{where}: no step ran"
    for step, loss, lr in zip(record["steps"], record["losses"], record["lrs"]):
        expected = reference["losses"][step - 1]
        assert abs(loss - expected) <= LOSS_TOL, f"{where}: step {step} loss {loss} vs {expected}"
        assert lr == pytest.approx(reference["lrs"][step - 1], rel=1e-12, abs=0), f"{where}: step {step} lr"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The single-device ("pp 1") run: its record, and its checkpoint after 4 steps."""
    out = tmp_path_factory.mktemp("pp") / "single"
    (record,) = _run(
        out, "--plugin", "single_device", "--max-steps", str(STEPS), "--save-at", "4", "--then-evaluate"
    )
    assert record["steps"] == list(range(1, STEPS + 1))
    evaluated = json.loads((out / "evaluate0.json").read_text())
    return {**record, "ckpt": out / "step4.ckpt", "evaluated": evaluated}


@pytest.mark.parametrize(
    ("schedule", "split"),
    [
        ("GPipe", "layers.3"),
        ("1F1B", "layers.3"),
        # Two stages per rank: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
        ("Interleaved1F1B", "layers.2,layers.3,layers.5"),
    ],
)
def test_schedule_matches_single_process(
    tmp_path: Path, reference: dict[str, Any], schedule: str, split: str
) -> None:
    out = tmp_path / "run"
    records = _run(
        out, "--schedule", schedule, "--split", split, "--max-steps", str(STEPS), "--then-evaluate"
    )
    assert len(records) == 2
    expected = reference["evaluated"]
    for rank, record in enumerate(records):
        # Every rank reports the loss, not only the last stage.
        _assert_matches(record, reference, f"{schedule} rank {rank}")
        assert abs(record["val_loss"] - reference["val_loss"]) <= LOSS_TOL, f"{schedule} rank {rank} val_loss"
        # trainer.validate and trainer.test after fit run the pipeline forward and report the same loss.
        evaluated = json.loads((out / f"evaluate{rank}.json").read_text())
        for stage, key in (("validate", "val_loss"), ("test", "test_loss")):
            assert abs(evaluated[stage][0][key] - expected[stage][0][key]) <= LOSS_TOL, f"{stage} rank {rank}"
        # One optimizer per model part, behind one container.
        assert record["optimizers_per_part"] == record["parts"] == len(record["stage_ids"])

    if schedule == "Interleaved1F1B":
        assert [r["stage_ids"] for r in records] == [[0, 2], [1, 3]]
        # Stages [layers 0-1], [2], [3-4], [5, head]: rank 0 materialises only layers 0, 1, 3 and 4.
        expected = [f"layers.{i}.0.{k}" for i in (0, 1, 3, 4) for k in ("bias", "weight")]
        assert records[0]["materialised"] == expected
    else:
        assert [r["stage_ids"] for r in records] == [[0], [1]]
        first, last = records[0]["materialised"], records[1]["materialised"]
        assert first == [f"layers.{i}.0.{k}" for i in range(3) for k in ("bias", "weight")]
        assert "head.weight" in last and not set(first) & set(last)


def test_pp_x_dp_with_clipping_and_accumulation(tmp_path: Path) -> None:
    """pp 2 x dp 2: each replica reads half of the single process's batch; gradients are averaged
    between the replicas of a stage, clipped by the norm over every stage, accumulated over 2 batches."""
    common = ["--max-steps", "6", "--clip", "0.05", "--accumulate", "2"]
    (single,) = _run(tmp_path / "single", "--plugin", "single_device", *common)
    records = _run(
        tmp_path / "ppxdp",
        *("--schedule", "GPipe", "--split", "layers.3", "--devices", "4", "--dp", "2", "--batch-size", "4"),
        *common,
    )
    assert [r["stage_ids"] for r in records] == [[0], [0], [1], [1]]
    for rank, record in enumerate(records):
        assert record["steps"] == single["steps"] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
        for loss, expected in zip(record["losses"], single["losses"]):
            assert abs(loss - expected) <= LOSS_TOL, f"rank {rank}: {record['losses']} vs {single['losses']}"
        assert record["lrs"] == pytest.approx(single["lrs"], rel=1e-12)
        assert abs(record["val_loss"] - single["val_loss"]) <= LOSS_TOL


def test_resume_across_pipeline_degrees(tmp_path: Path, reference: dict[str, Any]) -> None:
    """pp 1 -> pp 2 -> pp 4 -> pp 2 with two parts per rank -> pp 1, each leg continuing the same run.

    The first two checkpoints are single files (gathered to rank 0), the last two sharded folders
    (DistributedCheckpointIO: every rank writes, and reads, only the layers it holds). ``make test``
    leaves out the 4-rank leg (25 s; FULL_MATRIX=1 runs it): pp 2 then hands its file to two parts per rank.
    """
    legs = [
        ("pp2", ["--schedule", "1F1B", "--split", "layers.3", "--devices", "2"], 8),
        # Built on the meta device: each rank allocates only its own layers, then loads them.
        (
            "pp4",
            ["--split", "layers.2,layers.4,layers.5", "--devices", "4", "--sharded", "--meta-init"],
            11,
        ),
        (
            "pp2x2parts",
            ["--schedule", "Interleaved1F1B", "--split", "layers.2,layers.3,layers.5", "--sharded"],
            13,
        ),
        ("pp1", ["--plugin", "single_device", "--sharded"], STEPS),
    ]
    if not FULL:
        legs = [leg for leg in legs if leg[0] != "pp4"]
    ckpt = reference["ckpt"]
    start = 4
    for name, args, stop in legs:
        out = tmp_path / name
        records = _run(out, *args, "--max-steps", str(stop), "--save-at", str(stop), "--resume", str(ckpt))
        for rank, record in enumerate(records):
            assert record["steps"] == list(range(start + 1, stop + 1)), f"{name} rank {rank}"
            _assert_matches(record, reference, f"{name} rank {rank}")
        ckpt, start = out / f"step{stop}.ckpt", stop
        if name in ("pp2", "pp4"):
            _assert_same_layout(ckpt, reference["ckpt"], stop)
    final = records[0]
    assert abs(final["val_loss"] - reference["val_loss"]) <= LOSS_TOL


def _assert_same_layout(pipelined: Path, single: Path, step: int) -> None:
    """A checkpoint written by pipeline ranks reads like the single device's: names, groups, one scheduler."""
    got = DistributedCheckpointIO().load_checkpoint(str(pipelined))  # a file, or a folder read whole
    want = TorchCheckpointIO().load_checkpoint(str(single))
    assert list(got[KEY_STATE_DICT]) == list(want[KEY_STATE_DICT])
    for name, tensor in want[KEY_STATE_DICT].items():
        assert got[KEY_STATE_DICT][name].shape == tensor.shape
    (got_opt,), (want_opt,) = got[KEY_OPTIMIZER_STATES], want[KEY_OPTIMIZER_STATES]
    assert sorted(got_opt["state"]) == sorted(want_opt["state"])
    assert [g["params"] for g in got_opt["param_groups"]] == [g["params"] for g in want_opt["param_groups"]]
    assert len(got[KEY_LR_SCHEDULERS]) == len(want[KEY_LR_SCHEDULERS]) == 1
    assert got[KEY_LR_SCHEDULERS][0]["last_epoch"] == step


# ---------------------------------------------------------------------- errors (in this process)
def _fit(plugin: PipelinePlugin, model: Any) -> None:
    trainer = Trainer(plugins=[plugin], devices=2, logger=False, enable_progress_bar=False, max_steps=1)
    trainer.fit(model, DataLoader(data(), batch_size=8))


def test_split_point_that_names_no_submodule() -> None:
    with pytest.raises(MisconfigurationException) as err:
        _fit(PipelinePlugin(split_points=["layers.9"]), PipeNet())
    message = str(err.value)
    assert "'layers.9' names no submodule of PipeNet" in message
    # The module's children are listed, so the user can pick a real one.
    assert "layers.0" in message and "layers.5" in message and "head" in message


def test_module_without_loss_fn() -> None:
    class NoLoss(PipeNet):
        loss_fn = None  # type: ignore[assignment]

    with pytest.raises(MisconfigurationException, match=r"NoLoss must define `loss_fn\(output, target\)`"):
        _fit(PipelinePlugin(split_points=["layers.3"]), NoLoss())


def test_split_points_out_of_order() -> None:
    with pytest.raises(MisconfigurationException, match="in the order the module's forward runs them"):
        _fit(PipelinePlugin(split_points=["layers.4", "layers.2"]), PipeNet())


def test_bad_schedule_name() -> None:
    with pytest.raises(MisconfigurationException, match="schedule='ZeroBubble'"):
        PipelinePlugin(split_points=["layers.3"], schedule="ZeroBubble")


def test_registry_and_public_import() -> None:
    from trainer_core.plugins import plugin_from_name

    plugin = plugin_from_name("pipeline", split_points=["layers.3"], schedule="GPipe")
    assert isinstance(plugin, PipelinePlugin) and plugin.schedule_name == "GPipe"


def test_stages_that_do_not_fit_the_ranks() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"make 3 stages for 2 pipeline ranks .* use 1 split points"
    ):
        _fit(PipelinePlugin(split_points=["layers.2", "layers.4"], schedule="1F1B"), PipeNet())
    with pytest.raises(
        MisconfigurationException, match="number of stages to be a multiple of the pipeline degree"
    ):
        _fit(PipelinePlugin(split_points=["layers.2", "layers.4"], schedule="Interleaved1F1B"), PipeNet())
    with pytest.raises(
        MisconfigurationException, match=r"data_parallel_size=3\) does not divide the 2 processes"
    ):
        _fit(PipelinePlugin(split_points=["layers.3"], data_parallel_size=3), PipeNet())
