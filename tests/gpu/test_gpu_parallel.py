"""CUDA paths of the parallel plugins, each against one process on one device of the same kind.

nccl DDP (also at ``precision="bf16-true"``), FSDP2 under ``precision="bf16-mixed"``, ``ModelParallelPlugin`` and ``PipelinePlugin``, at two
ranks where there are two GPUs, else at one (a one-rank nccl process group). A run on several ranks
sees the combined batch of the one-process run, so the trained numbers must agree: to 1e-5 in fp32
(the sums run in another order), to bf16's precision under bf16 autocast. Each run also reports where
it ran (backend, parameter devices, dtypes), so a run that silently fell back to the CPU or to fp32
fails. In the dry run (``GPU_SUITE_DEVICE=cpu``) the backend is gloo and the devices are the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpu_support import (
    RANKS,
    SUITE_MARKS,
    LazyRuns,
    assert_close,
    assert_equal,
    device_of_rank,
    expected_backend,
    record,
    run_job,
    tensors,
)

pytestmark = [*SUITE_MARKS, pytest.mark.timeout(400)]

BATCH = 8  # per rank; the one-process reference reads RANKS * BATCH per batch
FP32_TOL = 1e-5
# bf16 keeps 8 bits of mantissa: autocast outputs differ from the reference's by ~4e-3 relative, and
# six Adam steps of size 1e-2 move the weights by at most that much more where gradients disagree.
BF16_WEIGHT_TOL = 2e-2
BF16_LOSS_REL = 5e-2


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One process on one device, on the combined batch: ``32-true`` and ``bf16-mixed``, run when first asked."""

    def make(precision: str) -> Path:
        out = tmp_path_factory.mktemp(f"reference-{precision}")
        run_job(out, "--precision", precision, "--batch-size", str(RANKS * BATCH))
        return out

    return LazyRuns(make)


def _assert_ran_on_the_devices(out: Path, world_size: int) -> list[dict[str, Any]]:
    records = [record(out, "run", rank) for rank in range(world_size)]
    for rank, seen in enumerate(records):
        assert seen["world_size"] == world_size
        assert seen["backend"] == expected_backend(), f"rank {rank}: backend {seen['backend']}"
        assert seen["root_device"] == device_of_rank(rank), f"rank {rank}: {seen['root_device']}"
        assert seen["param_devices"] == [device_of_rank(rank)], f"rank {rank}: {seen['param_devices']}"
    return records


def test_nccl_ddp_trains_like_one_device(tmp_path: Path, references: Any) -> None:
    """DDP over nccl: every rank ends with the one-device run's weights (to 1e-5), identical across ranks."""
    run_job(tmp_path, "--plugin", "ddp", "--devices", str(RANKS))
    _assert_ran_on_the_devices(tmp_path, RANKS)
    reference = tensors(references["32-true"], "run", 0)["final"]
    finals = [tensors(tmp_path, "run", rank)["final"] for rank in range(RANKS)]
    for rank, final in enumerate(finals):
        assert_close(final, reference, FP32_TOL, f"DDP rank {rank} vs one device")
        assert_equal(final, finals[0], f"DDP rank {rank} vs rank 0")


def test_fsdp2_bf16_mixed_trains_like_one_device(tmp_path: Path, references: Any) -> None:
    """FSDP2 with ``precision="bf16-mixed"``: forward in bf16, fp32 parameters, numbers of one bf16 device."""
    run_job(tmp_path, "--plugin", "fsdp", "--devices", str(RANKS), "--precision", "bf16-mixed")
    records = _assert_ran_on_the_devices(tmp_path, RANKS)
    ref_record = record(references["bf16-mixed"], "run", 0)
    reference = tensors(references["bf16-mixed"], "run", 0)["final"]
    fp32 = tensors(references["32-true"], "run", 0)["final"]
    assert ref_record["output_dtypes"] == ["bfloat16"]
    for rank, seen in enumerate(records):
        assert seen["output_dtypes"] == ["bfloat16"], f"rank {rank}: autocast did not run in bf16"
        assert seen["param_dtypes"] == ["float32"], f"rank {rank}: parameters are not kept in fp32"
        final = tensors(tmp_path, "run", rank)["final"]
        assert_close(final, reference, BF16_WEIGHT_TOL, f"FSDP bf16 rank {rank} vs one bf16 device")
    # The mean of the ranks' losses is the one-device loss on the combined batch.
    mean_losses = [sum(losses) / RANKS for losses in zip(*(r["losses"] for r in records))]
    assert mean_losses == pytest.approx(ref_record["losses"], rel=BF16_LOSS_REL)
    # bf16 really changed the numbers: the run is not the fp32 run under another name.
    assert any(not tensors(tmp_path, "run", 0)["final"][k].equal(fp32[k]) for k in fp32)


def test_bf16_true_ddp_keeps_bf16_weights_and_trains_like_fp32(tmp_path: Path, references: Any) -> None:
    """``precision="bf16-true"`` under DDP: bf16 parameters on every rank, identical across ranks, within
    bf16's precision of the fp32 one-device run."""
    run_job(tmp_path, "--plugin", "ddp", "--devices", str(RANKS), "--precision", "bf16-true")
    records = _assert_ran_on_the_devices(tmp_path, RANKS)
    fp32 = tensors(references["32-true"], "run", 0)["final"]
    finals = [tensors(tmp_path, "run", rank)["final"] for rank in range(RANKS)]
    for rank, (seen, final) in enumerate(zip(records, finals)):
        assert seen["param_dtypes"] == ["bfloat16"] and seen["output_dtypes"] == ["bfloat16"], f"rank {rank}"
        assert_equal(final, finals[0], f"bf16-true rank {rank} vs rank 0")
        assert_close(final, fp32, 5e-2, f"bf16-true rank {rank} vs one fp32 device")


def test_model_parallel_matches_one_device(tmp_path: Path) -> None:
    """ModelParallelPlugin ``[tp=RANKS]`` (tests/jobs/model_parallel_job.py's main configuration) vs one device.

    Per-batch losses, learning rates and gradient norms before and after clipping to 1e-5, the
    gathered weights to 1e-5.
    """
    one, many = tmp_path / "one", tmp_path / "many"
    run_job(one, "--scenario", "model_parallel", "--plugin", "single_device", "--run", "ref")
    run_job(many, "--scenario", "model_parallel", "--plugin", "model_parallel", "--devices", str(RANKS))
    ref = json.loads((one / "ref.rank0.json").read_text())
    for rank in range(RANKS):
        seen = json.loads((many / f"run.rank{rank}.json").read_text())
        assert seen["world_size"] == RANKS
        assert list(seen["batches"]) == list(ref["batches"]), f"rank {rank}: other batches"
        for key, batch in seen["batches"].items():
            want = ref["batches"][key]
            assert batch["loss"] == pytest.approx(want["loss"], abs=FP32_TOL), f"rank {rank} batch {key}"
            assert batch["lr"] == pytest.approx(want["lr"], rel=1e-12), f"rank {rank} batch {key}: lr"
        for kind in ("grad_norms", "clipped_norms"):
            assert list(seen[kind]) == list(ref[kind]), f"rank {rank}: {kind}"
            for step, norm in seen[kind].items():
                assert norm == pytest.approx(ref[kind][step], rel=FP32_TOL), (
                    f"rank {rank} step {step}: {kind}"
                )
    import torch

    got = torch.load(many / "run.weights.pt", weights_only=True)
    want = torch.load(one / "ref.weights.pt", weights_only=True)
    assert_close(got, want, FP32_TOL, "model parallel vs one device")


def test_pipeline_matches_one_device(tmp_path: Path) -> None:
    """PipelinePlugin (two stages on two GPUs, else one stage): the one-device losses to 1e-5, lrs exactly."""
    one, many = tmp_path / "one", tmp_path / "many"
    run_job(one, "--scenario", "pipeline", "--plugin", "single_device")
    split = "layers.3" if RANKS == 2 else ""
    run_job(many, "--scenario", "pipeline", "--plugin", "pipeline", "--devices", str(RANKS), "--split", split)
    ref = json.loads((one / "rank0.json").read_text())
    assert ref["param_devices"] == [device_of_rank(0)]
    held: list[str] = []
    for rank in range(RANKS):
        seen = json.loads((many / f"rank{rank}.json").read_text())
        assert seen["world_size"] == RANKS
        assert seen["backend"] == expected_backend()
        assert seen["param_devices"] == [device_of_rank(rank)], f"rank {rank}: {seen['param_devices']}"
        assert seen["stage_ids"] == [rank]
        assert seen["steps"] == ref["steps"]
        assert seen["losses"] == pytest.approx(ref["losses"], abs=FP32_TOL), f"rank {rank}"
        assert seen["lrs"] == pytest.approx(ref["lrs"], rel=1e-12), f"rank {rank}"
        held += seen["materialised"]
    # The stages hold the whole module between them, each layer once.
    assert sorted(held) == ref["materialised"]
