"""Resuming under distributed plugins on real gloo process groups: exactly at the same world size, and
module extra state through full and sharded checkpoints at another.

Split from test_distributed.py so that two test workers share the distributed tests evenly
(``--dist loadfile`` sends each file to one worker).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from dist_run import load_ckpt as _load_ckpt
from dist_run import rank_result as _rank_result
from dist_run import run as _run
from dist_run import weights as _weights

from trainer_core.checkpoint import KEY_STATE_DICT

#: Cases whose code another case already runs in make test: ``make stress`` (FULL_MATRIX=1) runs them too.
full_only = pytest.mark.skipif(os.environ.get("FULL_MATRIX") != "1", reason="FULL_MATRIX=1 (make stress)")


@pytest.mark.timeout(150)
# ddp_spawn trains with DDP's code; it starts its processes differently, which test_distributed.py covers.
@pytest.mark.parametrize(
    "plugin", ["ddp", pytest.param("ddp_spawn", marks=full_only), "ddp_sharded", "fsdp_sharded"]
)
def test_resume_at_the_same_world_size_is_exact(tmp_path: Path, plugin: str) -> None:
    common = ("--plugin", plugin, "--devices", "2", "--dropout", "0.3", "--shuffle")
    _run(tmp_path, "--out", "full", *common, "--ckpt-every-steps", "3")
    mid_epoch = tmp_path / "full" / "ckpts" / "epoch=0-step=3.ckpt"
    assert mid_epoch.exists()
    _run(tmp_path, "--out", "resumed", *common, "--resume", str(mid_epoch))
    for rank in (0, 1):
        full = _rank_result(tmp_path / "full", rank)["losses"]
        resumed = _rank_result(tmp_path / "resumed", rank)["losses"]
        assert len(full) == 8
        assert resumed == full[3:], f"rank {rank}: resumed losses differ from the uninterrupted run"
        final_full = _weights(tmp_path / "full", f"rank{rank}.pt")
        final_resumed = _weights(tmp_path / "resumed", f"rank{rank}.pt")
        assert all(torch.equal(final_full[k], final_resumed[k]) for k in final_full)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("plugin", [pytest.param("fsdp", marks=full_only), "fsdp_sharded"])
def test_fsdp_resumes_an_optimizer_without_tensor_state(tmp_path: Path, plugin: str) -> None:
    """SGD without momentum keeps no tensors: torch's loader cannot infer a device from its state."""
    common = ("--plugin", plugin, "--devices", "2", "--optimizer", "sgd", "--max-epochs", "1")
    _run(tmp_path, "--out", "full", *common, "--ckpt-every-steps", "2")
    _run(
        tmp_path,
        "--out",
        "resumed",
        *common,
        "--resume",
        str(tmp_path / "full" / "ckpts" / "epoch=0-step=2.ckpt"),
    )
    for rank in (0, 1):
        assert (
            _rank_result(tmp_path / "resumed", rank)["losses"]
            == _rank_result(tmp_path / "full", rank)["losses"][2:]
        )


# ---------------------------------------------------------------------- 9. module extra state
def _meter_in(ckpt: dict[str, Any]) -> dict[str, Any]:
    """The Meter's extra state as saved in a checkpoint, in either payload kind."""
    import io

    state = ckpt[KEY_STATE_DICT]["meter._extra_state"]
    if isinstance(state, torch.Tensor):
        return {"amax": state[:4].tolist(), "calls": int(state[4].item())}
    assert isinstance(state, io.BytesIO)
    state.seek(0)
    loaded = torch.load(state, weights_only=True)
    return {"amax": loaded["amax"].tolist(), "calls": loaded["calls"]}


EXTRA_STATE_CASES = [
    # (saved by at 2 ranks, loaded by, ranks, payload)
    # make test: a sharded folder at another world size, and a full file into one process; both payloads.
    pytest.param("fsdp", "fsdp", 3, "bytes", marks=full_only),
    ("fsdp_sharded", "fsdp_sharded", 3, "tensor"),
    pytest.param("fsdp_sharded", "fsdp_sharded", 1, "bytes", marks=full_only),
    ("ddp", "single_device", 1, "bytes"),
]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("saved_by", "loaded_by", "ranks", "payload"), EXTRA_STATE_CASES)
def test_module_extra_state_survives_checkpoints(
    tmp_path: Path, saved_by: str, loaded_by: str, ranks: int, payload: str
) -> None:
    """get_extra_state/set_extra_state (a tensor, or an io.BytesIO as TransformerEngine uses) round-trip
    exactly through full and sharded checkpoints, at the same and at another world size."""
    _run(
        tmp_path,
        "--out",
        "saved",
        "--plugin",
        saved_by,
        "--devices",
        "2",
        "--ckpt-every-epoch",
        "--extra-state",
        payload,
        timeout=150,
    )
    ckpt_path = tmp_path / "saved" / "ckpts" / "epoch=0-step=4.ckpt"
    saved = _meter_in(_load_ckpt(ckpt_path))
    assert saved["calls"] == 4 and any(v > 0 for v in saved["amax"])
    _run(
        tmp_path,
        "--out",
        "loaded",
        "--plugin",
        loaded_by,
        "--devices",
        str(ranks),
        "--resume",
        str(ckpt_path),
        "--extra-state",
        payload,
        timeout=150,
    )
    for rank in range(ranks):
        assert _rank_result(tmp_path / "loaded", rank)["meter_at_start"] == saved, f"rank {rank}"
