"""CUDA paths of checkpointing and resuming: pinned staging, the CUDA generator, the sharded loss scaler.

* ``AsyncCheckpointIO`` on a CUDA model stages into pinned host memory and writes what the weights
  were at the save, while training goes on (CPU dry run: plain, unpinned host memory).
* A run with dropout on the GPU, saved mid-epoch and resumed, ends bit for bit where the run without
  the interruption ends; with the checkpoint's CUDA generator state removed it does not, so the
  state is what makes the resume exact (CPU dry run: the CPU generator's state).
* ``precision="16-mixed"`` under ``ddp_sharded`` and ``fsdp``: an inf in one rank's gradient skips
  that step on every rank and halves the loss scale on every rank, as one device does with the same
  inf; the replicated weights stay identical across ranks; the scaler's state resumes exactly.
* Two GPUs (skipped with fewer): DDP with dropout, each rank on its own device with its own CUDA
  generator, resumed exactly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from gpu_support import (
    DEVICE,
    RANKS,
    SUITE_MARKS,
    LazyRuns,
    assert_close,
    assert_equal,
    device_of_rank,
    expected_backend,
    needs_two_devices,
    record,
    run_job,
    tensors,
)

pytestmark = [*SUITE_MARKS, pytest.mark.timeout(400)]

BATCH = 8
INJECT_AT = 2  # the batch whose gradient gets an inf
SAVE_AT = 3  # the batch after which the run is checkpointed (mid-epoch at one and at two ranks)
INIT_SCALE = 2.0**16  # GradScaler's default initial scale


def _load(path: Path) -> dict[str, Any]:
    from trainer_core.plugins.io import TorchCheckpointIO

    return TorchCheckpointIO().load_checkpoint(str(path))


# ---------------------------------------------------------------------- async checkpointing
def test_async_checkpoint_stages_in_pinned_memory_and_writes_the_weights_of_the_save(tmp_path: Path) -> None:
    """Three background saves of a model on the GPU: each file holds the weights at its save, bit for bit.

    The wrapped IO waits before writing, so training has moved the weights on by then: a staged copy
    that shared memory with the model would write later weights. The staged tensors are host tensors,
    pinned for a CUDA model (so the device-to-host copies run asynchronously).
    """
    import torch

    run_job(tmp_path, "--async-every", "2", "--max-steps", "6")
    files = sorted((tmp_path / "ckpts").glob("*.ckpt"))
    assert [f.name for f in files] == [f"epoch=0-step={s}.ckpt" for s in (2, 4, 6)]
    assert record(tmp_path, "run", 0)["param_devices"] == [device_of_rank(0)]
    for path in files:
        staged = json.loads(Path(f"{path}.staged.json").read_text())
        assert staged["devices"] == ["cpu"], f"{path.name}: staged on {staged['devices']}"
        want_pinned = DEVICE == "cuda"
        assert set(staged["pinned"].values()) == {want_pinned}, f"{path.name}: pinned {staged['pinned']}"
        checkpoint = _load(path)
        step = checkpoint["global_step"]
        expected = torch.load(tmp_path / f"run.expected.step{step}.pt", weights_only=True)
        assert_equal(checkpoint["state_dict"], expected, f"{path.name} vs the weights at step {step}")
    first = _load(files[0])["state_dict"]
    final = tensors(tmp_path, "run", 0)["final"]
    assert_equal(_load(files[-1])["state_dict"], final, "the last checkpoint vs the final weights")
    assert any(not first[k].equal(final[k]) for k in final), "training did not change the weights"


# ---------------------------------------------------------------------- exact resume with the CUDA generator
def _device_generator_removed(src: Path, dst: Path) -> None:
    """``src`` with the generator dropout draws from replaced: CUDA's removed, or the CPU's reseeded."""
    import torch

    from trainer_core.checkpoint import KEY_RNG
    from trainer_core.plugins.io import TorchCheckpointIO

    checkpoint = _load(src)
    states = checkpoint[KEY_RNG]
    if DEVICE == "cuda":
        del states["cuda"]
    else:
        states["torch"] = torch.Generator().manual_seed(99).get_state()
    TorchCheckpointIO().save_checkpoint(checkpoint, dst)


def test_dropout_on_the_gpu_resumes_exactly(tmp_path: Path) -> None:
    """Saved after batch 3 of 6 and resumed: the losses of batches 4 to 6 and the final weights are identical.

    Dropout draws its masks from the CUDA generator; the checkpoint holds that generator's state for
    every device. Resumed without it, the run draws other masks and ends elsewhere.
    """
    import torch

    from trainer_core.checkpoint import KEY_RNG

    whole, resumed, control = tmp_path / "whole", tmp_path / "resumed", tmp_path / "control"
    run_job(whole, "--dropout", "0.3", "--save-at", str(SAVE_AT))
    ckpt = whole / f"run.batch{SAVE_AT}.ckpt"
    states = _load(ckpt)[KEY_RNG]
    if DEVICE == "cuda":
        assert "cuda" in states, f"no CUDA generator state in the checkpoint: {sorted(states)}"
        assert len(states["cuda"]) == torch.cuda.device_count()
    run_job(resumed, "--dropout", "0.3", "--resume", str(ckpt))
    want, got = record(whole, "run", 0), record(resumed, "run", 0)
    assert got["start"]["global_step"] == SAVE_AT
    assert got["losses"] == want["losses"][SAVE_AT:], "the resumed losses differ"
    assert_equal(tensors(resumed, "run", 0)["final"], tensors(whole, "run", 0)["final"], "resumed vs whole")

    _device_generator_removed(ckpt, control / "no-device-rng.ckpt")
    run_job(control, "--dropout", "0.3", "--resume", str(control / "no-device-rng.ckpt"))
    assert record(control, "run", 0)["losses"] != want["losses"][SAVE_AT:], (
        "resumed without the device generator's state, the run still drew the same dropout masks: "
        "the test does not show that the state is what makes the resume exact"
    )


# ---------------------------------------------------------------------- 16-mixed with the sharded scaler
@pytest.fixture(scope="module")
def fp16_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Per plugin, run when first asked: 6 batches at ``16-mixed``, an inf in the last rank's gradient of
    batch ``INJECT_AT``, a checkpoint after batch ``SAVE_AT``, and the run resumed from it.
    ``"reference"``: one device on the combined batch, the same inf."""

    def make(plugin: str) -> Path:
        out = tmp_path_factory.mktemp(f"fp16-{plugin}")
        common = ("--precision", "16-mixed", "--inject-inf-step", str(INJECT_AT))
        if plugin == "reference":
            run_job(out, *common, "--batch-size", str(RANKS * BATCH))
            return out
        layout = ("--plugin", plugin, "--devices", str(RANKS), "--inject-inf-rank", str(RANKS - 1))
        run_job(out, *common, *layout, "--save-at", str(SAVE_AT))
        run_job(out, *common, *layout, "--run", "resumed", "--resume", str(out / f"run.batch{SAVE_AT}.ckpt"))
        return out

    return LazyRuns(make)


SHARDED = pytest.mark.parametrize("plugin", ["ddp_sharded", "fsdp"])


@SHARDED
def test_inf_on_one_rank_skips_the_step_on_every_rank(plugin: str, fp16_runs: Any) -> None:
    """The inf is on the last rank only; every rank skips that step and halves its scale, like one device."""
    out, ref_out = fp16_runs[plugin], fp16_runs["reference"]
    expected_scales = [INIT_SCALE] * (INJECT_AT - 1) + [INIT_SCALE / 2] * (6 - INJECT_AT + 1)
    reference = record(ref_out, "run", 0)
    assert reference["scales"] == expected_scales, "one device did not skip the step of the inf"
    finals = []
    for rank in range(RANKS):
        seen, trace = record(out, "run", rank), tensors(out, "run", rank)
        assert seen["backend"] == expected_backend()
        assert seen["output_dtypes"] == ["float16"], f"rank {rank}: autocast did not run in fp16"
        assert seen["param_dtypes"] == ["float32"]
        assert seen["scales"] == expected_scales, f"rank {rank}: scales {seen['scales']}"
        weights = trace["trace"]
        assert len(weights) == 6
        for batch in range(1, 6):
            stepped = not weights[batch].equal(weights[batch - 1])
            assert stepped == (batch + 1 != INJECT_AT), f"rank {rank} batch {batch + 1}: stepped={stepped}"
        finals.append(trace["final"])
    for rank, final in enumerate(finals):
        assert_equal(final, finals[0], f"{plugin} rank {rank} vs rank 0")
        # fp16 autocast over half the batch sums in another order than over the whole one.
        assert_close(final, tensors(ref_out, "run", 0)["final"], 5e-3, f"{plugin} rank {rank} vs one device")
    from trainer_core.checkpoint import KEY_PRECISION

    saved = _load(out / f"run.batch{SAVE_AT}.ckpt")[KEY_PRECISION]
    assert float(saved["scale"]) == INIT_SCALE / 2, f"checkpointed scaler state: {saved}"


@SHARDED
def test_sharded_scaler_state_resumes_exactly(plugin: str, fp16_runs: Any) -> None:
    """Resumed after the halving: every rank starts at the saved scale and growth count, and ends bit for bit
    where the uninterrupted run ends."""
    from trainer_core.checkpoint import KEY_PRECISION

    out = fp16_runs[plugin]
    saved = {k: float(v) for k, v in _load(out / f"run.batch{SAVE_AT}.ckpt")[KEY_PRECISION].items()}
    for rank in range(RANKS):
        whole, resumed = record(out, "run", rank), record(out, "resumed", rank)
        start = {k: float(v) for k, v in resumed["start"]["scaler"].items()}
        assert start == saved, f"rank {rank}: the scaler started at {start}, saved {saved}"
        assert resumed["scales"] == whole["scales"][SAVE_AT:], f"rank {rank}"
        assert resumed["losses"] == whole["losses"][SAVE_AT:], f"rank {rank}: the resumed losses differ"
        assert_equal(
            tensors(out, "resumed", rank)["final"],
            tensors(out, "run", rank)["final"],
            f"{plugin} rank {rank}",
        )


# ---------------------------------------------------------------------- two GPUs
@needs_two_devices
def test_two_gpus_ddp_with_dropout_resumes_each_ranks_generator(tmp_path: Path) -> None:
    """DDP on two GPUs: a rank per device, each drawing its own dropout masks; resumed, every rank ends
    bit for bit where the uninterrupted run ends (each rank got its own CUDA generator back)."""
    from trainer_core.checkpoint.format import KEY_RNG_PER_RANK

    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    args = ("--plugin", "ddp", "--devices", "2", "--dropout", "0.3")
    run_job(whole, *args, "--save-at", str(SAVE_AT))
    ckpt = whole / f"run.batch{SAVE_AT}.ckpt"
    per_rank = _load(ckpt)[KEY_RNG_PER_RANK]
    assert len(per_rank) == 2
    if DEVICE == "cuda":
        assert all("cuda" in states for states in per_rank)
    run_job(resumed, *args, "--resume", str(ckpt))
    finals = []
    for rank in range(2):
        seen = record(whole, "run", rank)
        assert seen["param_devices"] == [device_of_rank(rank)] and seen["backend"] == expected_backend()
        assert record(resumed, "run", rank)["losses"] == seen["losses"][SAVE_AT:], f"rank {rank}"
        final = tensors(resumed, "run", rank)["final"]
        assert_equal(final, tensors(whole, "run", rank)["final"], f"rank {rank}: resumed vs whole")
        finals.append(final)
    assert_equal(finals[1], finals[0], "rank 1 vs rank 0")
