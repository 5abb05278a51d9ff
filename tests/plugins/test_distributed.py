"""Distributed plugins on real gloo process groups (2 to 4 ranks on 127.0.0.1).

Each test runs ``tests/jobs/dist_job.py`` the way a user runs a script, and checks what the user relies
on: the trained numbers against a single process on the combined batch, the checkpoint files and
who wrote them, the state a resumed run starts from, and how a failing rank ends the run.
"""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from dist_job import Net, data
from dist_run import JOB
from dist_run import load_ckpt as _load_ckpt
from dist_run import rank_result as _rank_result
from dist_run import run as _run
from dist_run import weights as _weights
from launch import LAUNCH_VARS
from torch import nn

from trainer_core.checkpoint import KEY_GLOBAL_STEP, KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.plugins.environments import find_free_port
from trainer_core.plugins.io import TorchCheckpointIO

FULL = os.environ.get("FULL_MATRIX") == "1"
PLUGINS = ["ddp", "ddp_spawn", "ddp_sharded", "zero", "fsdp"]
N_SAMPLES = 64
LR = 0.01


# ---------------------------------------------------------------------- helpers
def _reference_model() -> Net:
    from trainer_core import seed_everything

    seed_everything(0, verbose=False)
    return Net()


def reference_weights(
    batch_size: int, accumulate: int = 1, epochs: int = 2, clip: Optional[float] = None
) -> dict[str, torch.Tensor]:
    """A plain single-process loop over the combined batch (what every rank together sees)."""
    model = _reference_model()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data().tensors
    for _ in range(epochs):
        batches = [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, N_SAMPLES, batch_size)]
        for i, (bx, by) in enumerate(batches):
            loss = nn.functional.mse_loss(model.net(bx), by) / accumulate
            loss.backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                opt.step()
                opt.zero_grad()
    return model.state_dict()


def _assert_weights_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float
) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        diff = (actual[name] - expected[name]).abs().max().item()
        assert diff <= atol, f"{name}: max difference {diff:.3g} from the single-process run (allowed {atol})"


def _assert_named_state_equal(actual: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Name-keyed optimizer states hold the same parameters and the same tensors, bit for bit."""
    assert sorted(actual["state"]) == sorted(expected["state"]), f"{where}: parameter names differ"
    for name, exp_state in expected["state"].items():
        act_state = actual["state"][name]
        assert sorted(act_state) == sorted(exp_state), f"{where}: {name} has {sorted(act_state)}"
        for key, exp in exp_state.items():
            act = act_state[key]
            if isinstance(exp, torch.Tensor):
                assert torch.equal(torch.as_tensor(act), exp), f"{where}: {name}.{key} differs"
            else:
                assert act == exp, f"{where}: {name}.{key} {act} != {exp}"
    act_groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
        for g in actual["param_groups"]
    ]
    exp_groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": sorted(g["params"])}
        for g in expected["param_groups"]
    ]
    assert [g["params"] for g in act_groups] == [g["params"] for g in exp_groups], (
        f"{where}: param groups differ"
    )
    assert [g["lr"] for g in act_groups] == [g["lr"] for g in exp_groups]


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


# ---------------------------------------------------------------------- runs shared by several tests
@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One 2-rank run per plugin: 2 epochs, a checkpoint at each epoch end, checkpoint IO recorded."""

    class Lazy(dict):
        def __missing__(self, plugin: str) -> Path:
            tmp = tmp_path_factory.mktemp(f"saved-{plugin}")
            # Sharded FSDP writes through DistributedCheckpointIO, which the recording IO would replace.
            record = () if plugin == "fsdp_sharded" else ("--record-io",)
            _run(tmp, "--out", "out", "--plugin", plugin, "--devices", "2", "--ckpt-every-epoch", *record)
            self[plugin] = tmp / "out"
            return self[plugin]

    return Lazy()


# ---------------------------------------------------------------------- 1. parity
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_two_ranks_train_like_one_process_on_the_combined_batch(
    saved_runs: dict[str, Path], plugin: str
) -> None:
    out = saved_runs[plugin]
    expected = reference_weights(batch_size=16)
    for rank in (0, 1):
        seen = _rank_result(out, rank)
        assert seen["world_size"] == 2 and seen["global_rank"] == rank
        assert seen["sampler"] == "DistributedSampler"
        assert seen["train_batches"] == 4  # 64 samples / 2 ranks / batch 8
        _assert_weights_close(_weights(out, f"rank{rank}.pt"), expected, atol=1e-6)
    if plugin == "ddp_spawn":
        # The process that called fit gets rank 0's trained weights back.
        _assert_weights_close(_weights(out, "caller.pt"), expected, atol=1e-6)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_gradient_accumulation_matches_one_process(tmp_path: Path, plugin: str) -> None:
    _run(tmp_path, "--out", "out", "--plugin", plugin, "--devices", "2", "--accumulate", "2")
    out = tmp_path / "out"
    expected = reference_weights(batch_size=16, accumulate=2)
    for rank in (0, 1):
        seen = _rank_result(out, rank)
        assert seen["sampler"] == "DistributedSampler"
        assert seen["final_global_step"] == 4  # 2 epochs x 4 batches / 2
        _assert_weights_close(_weights(out, f"rank{rank}.pt"), expected, atol=1e-6)
    # DDP's no_sync: after the first batch of each accumulation the ranks hold their own, different
    # gradients (nothing was communicated); after the second, the averaged, equal one.
    if plugin == "fsdp":
        return  # FSDP2 keeps gradients unsharded and off `.grad` while it skips the reduce-scatter
    grads = [_rank_result(out, rank)["grad_sums"] for rank in (0, 1)]
    assert len(grads[0]) == len(grads[1]) == 8
    for i in range(0, 8, 2):
        assert grads[0][i] != grads[1][i], f"batch {i}: gradients were synchronised while accumulating"
        if plugin != "ddp_sharded":  # ShardedDataParallel leaves each gradient on the rank that owns it
            assert grads[0][i + 1] == grads[1][i + 1], f"batch {i + 1}: gradients were not synchronised"


# ---------------------------------------------------------------------- 2. torchrun
def _torchrun(nproc: int, port: int, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(port),
        *extra,
    ]


@pytest.mark.timeout(120)
def test_torchrun_processes_are_used_as_they_are(tmp_path: Path) -> None:
    cmd = [*_torchrun(2, find_free_port()), JOB, "--out", "out", "--plugin", "ddp", "--devices", "2"]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = tmp_path / "out"
    ranks = [_rank_result(out, r) for r in (0, 1)]
    for rank, seen in enumerate(ranks):
        assert seen["environment"] == "TorchElasticEnvironment"
        assert seen["global_rank"] == rank and seen["world_size"] == 2
        assert seen["children"] == [], f"rank {rank} started processes of its own: {seen['children']}"
    # Both ranks are children of the one torchrun agent, not of each other.
    assert ranks[0]["ppid"] == ranks[1]["ppid"]
    _assert_weights_close(_weights(out), reference_weights(batch_size=16), atol=1e-6)


@pytest.mark.timeout(180)
def test_two_torchrun_nodes_train_together(tmp_path: Path) -> None:
    port = find_free_port()
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    procs = []
    for node in (0, 1):
        cmd = [
            *_torchrun(2, port, "--nnodes", "2", "--node_rank", str(node)),
            JOB,
            *("--out", "out", "--plugin", "ddp", "--devices", "2", "--num-nodes", "2"),
        ]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append(
            # Its own session: on a hang the agent and its workers are killed together.
            (
                subprocess.Popen(
                    cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                ),
                log,
            )
        )
    deadline = time.monotonic() + 60  # a clean run takes about 10 s
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in (0, 1))
    assert [p.returncode for p, _ in procs] == [0, 0], logs
    out = tmp_path / "out"
    for rank in range(4):
        seen = _rank_result(out, rank)
        assert seen["world_size"] == 4
        assert seen["node_rank"] == rank // 2 and seen["local_rank"] == rank % 2
        assert seen["environment"] == "TorchElasticEnvironment"
        assert seen["train_batches"] == 2  # 64 samples / 4 ranks / batch 8
    _assert_weights_close(_weights(out), reference_weights(batch_size=32), atol=1e-6)


# ---------------------------------------------------------------------- 3. user-wrapped sharded optimizers under plain DDP
def _reference_adam_states(steps: list[int], world: int = 2, batch: int = 8) -> dict[int, dict[str, Any]]:
    """Plain Adam in one process, with the gradient DDP computes: the mean of each rank's gradient."""
    model = _reference_model()
    names = {p: n for n, p in model.named_parameters()}
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    x, y = data().tensors
    combined = world * batch
    states = {}
    for step in range(1, max(steps) + 1):
        lo = (step - 1) * combined
        grads: list[list[torch.Tensor]] = []
        for rank in range(world):
            # DistributedSampler (no shuffle) gives rank r the samples r, r + world, ...
            idx = torch.arange(lo + rank, lo + combined, world)
            model.zero_grad()
            nn.functional.mse_loss(model.net(x[idx]), y[idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            # DDP divides each rank's gradient by the world size, then sums across ranks.
            p.grad = sum(g[i] / world for g in grads)
        opt.step()
        if step in steps:
            states[step] = {names[p]: copy.deepcopy(s) for p, s in opt.state.items()}
    return states


@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["oss", "zero"])
def test_user_sharded_optimizer_under_plain_ddp_checkpoints_full_state(
    tmp_path: Path, optimizer: str
) -> None:
    if optimizer == "oss":
        pytest.importorskip("fairscale")
    _run(
        tmp_path,
        *("--out", "out", "--plugin", "ddp", "--devices", "2", "--optimizer", optimizer),
        *("--max-epochs", "1", "--ckpt-every-steps", "2"),
    )
    out = tmp_path / "out"
    for rank in (0, 1):  # both ranks finished: no error on rank 1 in the collective save
        assert _rank_result(out, rank)["final_global_step"] == 4
    files = sorted((out / "ckpts").glob("*.ckpt"))
    assert [f.name for f in files] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    expected = _reference_adam_states([2, 4])
    param_names = [n for n, _ in _reference_model().named_parameters()]
    for f in files:
        ckpt = _load_ckpt(f)
        step = ckpt[KEY_GLOBAL_STEP]
        (state,) = ckpt[KEY_OPTIMIZER_STATES]
        assert sorted(state["state"]) == sorted(param_names), f"{f.name} lacks the state of some parameters"
        assert sorted(n for g in state["param_groups"] for n in g["params"]) == sorted(param_names)
        for name in param_names:
            saved = state["state"][name]
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(saved[key], expected[step][name][key]), f"{f.name}: {name}.{key} differs"
            assert float(saved["step"]) == step


# ---------------------------------------------------------------------- 4. files written on rank 0 only
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_checkpoint_files_are_written_by_rank_zero_only(saved_runs: dict[str, Path], plugin: str) -> None:
    out = saved_runs[plugin]
    calls = sorted(p.name for p in out.glob("io_calls.rank*.txt"))
    assert calls == ["io_calls.rank0.txt"], f"ranks that called CheckpointIO.save_checkpoint: {calls}"
    written = [line.split(" ", 1)[1] for line in (out / "io_calls.rank0.txt").read_text().splitlines()]
    files = sorted(str(p) for p in (out / "ckpts").glob("*.ckpt"))
    assert sorted(written) == files
    assert [Path(f).name for f in files] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]
    for f in files:
        (state,) = _load_ckpt(Path(f))[KEY_OPTIMIZER_STATES]
        assert len(state["state"]) == 4, f"{f}: optimizer state of {len(state['state'])} of 4 parameters"


# ---------------------------------------------------------------------- 5. resume across plugins and world sizes
RESUME_MATRIX = [
    # (saved by at 2 ranks, loaded by, ranks): what the whole matrix below does not cover, a spawned
    # loader and a sharded folder loaded by one process.
    ("ddp_sharded", "ddp_spawn", 3),
    ("fsdp_sharded", "fsdp_sharded", 1),
]


@pytest.mark.timeout(150)
@pytest.mark.parametrize(("saved_by", "loaded_by", "ranks"), RESUME_MATRIX)
def test_resume_under_another_plugin_and_world_size(
    saved_runs: dict[str, Path], tmp_path: Path, saved_by: str, loaded_by: str, ranks: int
) -> None:
    ckpt_path = saved_runs[saved_by] / "ckpts" / "epoch=0-step=4.ckpt"
    ckpt = _load_ckpt(ckpt_path)
    _run(
        tmp_path,
        *("--out", "out", "--plugin", loaded_by, "--devices", str(ranks)),
        *("--resume", str(ckpt_path), "--dump-restored"),
        timeout=140,
    )
    out = tmp_path / "out"
    restored = torch.load(out / "restored.pt", weights_only=True)
    assert restored["global_step"] == 4
    assert restored["weights"].keys() == ckpt[KEY_STATE_DICT].keys()
    for name, saved in ckpt[KEY_STATE_DICT].items():
        assert torch.equal(restored["weights"][name], saved), f"weight {name} differs right after restore"
    (saved_state,) = ckpt[KEY_OPTIMIZER_STATES]
    (restored_state,) = restored["optimizer_states"]
    _assert_named_state_equal(restored_state, saved_state, f"{saved_by} -> {loaded_by} at {ranks} ranks")
    for rank in range(ranks):
        seen = _rank_result(out, rank)
        assert seen["world_size"] == ranks
        assert seen["final_global_step"] > 4  # it kept training after the restore


# ---------------------------------------------------------------------- 6. a failing rank
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("plugin", "failing"), [("ddp", 1), ("ddp", 0), ("ddp_spawn", 1)])
def test_a_failing_rank_ends_every_rank(tmp_path: Path, plugin: str, failing: int) -> None:
    start = time.monotonic()
    proc = _run(
        tmp_path,
        *("--out", "out", "--plugin", plugin, "--devices", "2", "--fail-on-rank", str(failing)),
        timeout=90,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 60, f"the run took {elapsed:.0f} s to end"
    output = proc.stdout + proc.stderr
    assert f"deliberate failure in training_step on rank {failing}" in output, output[-4000:]
    assert "Traceback" in output
    pids = [int((tmp_path / "out" / f"pid.rank{r}").read_text()) for r in (0, 1)]
    deadline = time.monotonic() + 10
    while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [p for p in pids if not _pid_gone(p)]
    for pid in alive:  # leave nothing behind even when the assertion fails
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"rank processes {alive} are still running after the run ended"
    assert not (tmp_path / "out" / "rank0.json").exists()


# ---------------------------------------------------------------------- 8. sync_dist, progress bar and loggers
@pytest.mark.timeout(120)
def test_sync_dist_and_rank_zero_logging(tmp_path: Path) -> None:
    _run(
        tmp_path,
        *("--out", "out", "--plugin", "ddp", "--devices", "2", "--max-epochs", "1"),
        *("--log-rank-metric", "--logger", "--progress-bar", "--stderr-per-rank"),
    )
    out = tmp_path / "out"
    # Rank 0 logs 10..13 (mean 11.5), rank 1 logs 20..23 (mean 21.5): the synced value is their mean.
    for rank in (0, 1):
        assert _rank_result(out, rank)["callback_metrics"]["rank_metric"] == pytest.approx(16.5)
    logs = out / "root" / "lightning_logs"
    assert sorted(p.name for p in logs.iterdir()) == ["version_0"]
    csv_files = list((out / "root").rglob("metrics.csv"))
    assert csv_files == [logs / "version_0" / "metrics.csv"]
    import csv

    rows = list(csv.DictReader(csv_files[0].open()))
    values = [float(r["rank_metric"]) for r in rows if r.get("rank_metric")]
    assert values == [pytest.approx(16.5)]
    bar_rank0 = (out / "stderr.local0.txt").read_text()
    bar_rank1 = (out / "stderr.local1.txt").read_text()
    assert "stderr of local rank 1" in bar_rank1  # the file does catch what rank 1 prints
    assert "Epoch 0" in bar_rank0
    assert "Epoch" not in bar_rank1 and "it/s" not in bar_rank1, bar_rank1[-2000:]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plugin", ["ddp", "ddp_sharded", "zero", "fsdp"])
def test_gradient_clipping_by_norm_uses_the_global_norm(tmp_path: Path, plugin: str) -> None:
    """Clipping must see the norm of the averaged gradient of the whole model, also when each rank
    holds only its shard of it (OSS computes the norm across ranks)."""
    _run(tmp_path, "--out", "out", "--plugin", plugin, "--devices", "2", "--clip", "0.05")
    expected = reference_weights(batch_size=16, clip=0.05)
    _assert_weights_close(_weights(tmp_path / "out"), expected, atol=1e-6)
    unclipped = reference_weights(batch_size=16)
    assert any((unclipped[k] - expected[k]).abs().max() > 1e-3 for k in expected), (
        "the clip value must matter"
    )


# ---------------------------------------------------------------------- 8. sharded checkpoints (FSDP)
@pytest.mark.timeout(150)
def test_sharded_checkpoint_is_a_folder_every_rank_writes(saved_runs: dict[str, Path]) -> None:
    out = saved_runs["fsdp_sharded"]
    folder = out / "ckpts" / "epoch=1-step=8.ckpt"
    assert folder.is_dir()
    names = sorted(p.name for p in folder.iterdir())
    assert ".metadata" in names and "trainer_state.pt" in names
    assert len([n for n in names if n.endswith(".distcp")]) == 2, names  # one shard file per rank
    # Read whole, without a process group, it is the same checkpoint a full save writes.
    ckpt = _load_ckpt(folder)
    _assert_weights_close(ckpt[KEY_STATE_DICT], reference_weights(batch_size=16), atol=1e-6)
    full = _load_ckpt(saved_runs["fsdp"] / "ckpts" / "epoch=1-step=8.ckpt")
    _assert_named_state_equal(ckpt[KEY_OPTIMIZER_STATES][0], full[KEY_OPTIMIZER_STATES][0], "sharded vs full")
    assert len(ckpt["rng_states_per_rank"]) == 2


@pytest.mark.timeout(200)
def test_hybrid_sharding_writes_one_replica_and_resumes_as_plain_fsdp(
    saved_runs: dict[str, Path], tmp_path: Path
) -> None:
    _run(tmp_path, "--out", "hsdp", "--plugin", "hsdp", "--devices", "4", "--ckpt-every-epoch", timeout=180)
    folder = tmp_path / "hsdp" / "ckpts" / "epoch=0-step=2.ckpt"
    ckpt = _load_ckpt(folder)
    _assert_weights_close(ckpt[KEY_STATE_DICT], reference_weights(batch_size=32, epochs=1), atol=1e-6)
    # The two replicas hold the same shards: 4 ranks (2 x 2) store as much as plain FSDP at 2 ranks,
    # not twice as much.
    hsdp_bytes = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    fsdp_folder = saved_runs["fsdp_sharded"] / "ckpts" / "epoch=0-step=4.ckpt"
    fsdp_bytes = sum(p.stat().st_size for p in fsdp_folder.glob("*.distcp"))
    assert hsdp_bytes <= 1.1 * fsdp_bytes, (hsdp_bytes, fsdp_bytes)
    _run(
        tmp_path,
        "--out",
        "fsdp2",
        "--plugin",
        "fsdp",
        "--devices",
        "2",
        "--resume",
        str(folder),
        "--dump-restored",
    )
    restored = torch.load(tmp_path / "fsdp2" / "restored.pt", weights_only=True)
    for name, saved in ckpt[KEY_STATE_DICT].items():
        assert torch.equal(restored["weights"][name], saved), name
    _assert_named_state_equal(restored["optimizer_states"][0], ckpt[KEY_OPTIMIZER_STATES][0], "hsdp -> fsdp")


@pytest.mark.timeout(150)
def test_incomplete_sharded_folders_are_refused_and_skipped(
    saved_runs: dict[str, Path], tmp_path: Path
) -> None:
    import shutil

    from trainer_core.errors import CheckpointError

    source = saved_runs["fsdp_sharded"] / "ckpts"
    ckpts = tmp_path / "ckpts"
    shutil.copytree(source, ckpts)
    newest = ckpts / "epoch=1-step=8.ckpt"
    (newest / ".metadata").unlink()
    with pytest.raises(CheckpointError, match=r"epoch=1-step=8\.ckpt.*incomplete"):
        _load_ckpt(newest)
    # "last" skips the incomplete folder and resumes the older complete one.
    assert TorchCheckpointIO().latest_complete(str(ckpts)).endswith("epoch=0-step=4.ckpt")
    older = ckpts / "epoch=0-step=4.ckpt"
    shard = sorted(older.glob("*.distcp"))[-1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"epoch=0-step=4\.ckpt"):
        _load_ckpt(older)


@pytest.mark.timeout(150)
def test_a_single_device_checkpoint_resumes_sharded_under_fsdp(tmp_path: Path) -> None:
    _run(
        tmp_path,
        "--out",
        "single",
        "--plugin",
        "single_device",
        "--devices",
        "1",
        "--batch-size",
        "16",
        "--ckpt-every-epoch",
    )
    ckpt_path = tmp_path / "single" / "ckpts" / "epoch=0-step=4.ckpt"
    ckpt = _load_ckpt(ckpt_path)
    _run(
        tmp_path,
        "--out",
        "fsdp",
        "--plugin",
        "fsdp_sharded",
        "--devices",
        "2",
        "--resume",
        str(ckpt_path),
        "--dump-restored",
    )
    restored = torch.load(tmp_path / "fsdp" / "restored.pt", weights_only=True)
    for name, saved in ckpt[KEY_STATE_DICT].items():
        assert torch.equal(restored["weights"][name], saved), name
    _assert_named_state_equal(
        restored["optimizer_states"][0], ckpt[KEY_OPTIMIZER_STATES][0], "single -> fsdp"
    )


# ---------------------------------------------------------------------- 10. FSDP options
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("variant", "units", "atol"),
    [
        ("fsdp_wrap", ["<root>", "net.0", "net.2"], 1e-6),  # auto_wrap_policy={nn.Linear}
        ("fsdp_offload", ["<root>"], 1e-6),  # CPU offload, reshard_after_forward=False
        ("fsdp_bf16", ["<root>"], 3e-2),  # bf16 parameters in forward/backward, fp32 reduction
    ],
)
def test_fsdp_options_train_like_one_process(tmp_path: Path, variant: str, units: list, atol: float) -> None:
    _run(tmp_path, "--out", "out", "--plugin", variant, "--devices", "2")
    out = tmp_path / "out"
    assert _rank_result(out, 0)["fsdp_units"] == units
    expected = reference_weights(batch_size=16)
    _assert_weights_close(_weights(out), expected, atol=atol)
    if variant == "fsdp_bf16":
        # bf16 compute really happened: the result is close to, but not exactly, the fp32 one.
        assert any((_weights(out)[k] - expected[k]).abs().max() > 1e-5 for k in expected)


@pytest.mark.timeout(150)
def test_fsdp_respects_sharding_done_in_configure_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DIST_JOB_SHARD_IN_CONFIGURE_MODEL", "1")
    _run(tmp_path, "--out", "out", "--plugin", "fsdp", "--devices", "2")
    out = tmp_path / "out"
    assert _rank_result(out, 0)["fsdp_units"] == ["<root>", "net.0"]
    _assert_weights_close(_weights(out), reference_weights(batch_size=16), atol=1e-6)


@pytest.mark.timeout(200)
@pytest.mark.skipif(
    not FULL,
    reason="FULL_MATRIX=1 (make stress): test_object_store covers sharded folders on S3 in make test",
)
def test_sharded_checkpoint_on_s3(tmp_path: Path, s3_url: str) -> None:
    """Every rank writes its shards to an object store (a real S3 server on loopback); "last" finds the
    folder and it resumes resharded."""
    _run(
        tmp_path,
        "--out",
        "saved",
        "--plugin",
        "fsdp_sharded",
        "--devices",
        "2",
        "--ckpt-every-epoch",
        "--ckpt-dir",
        s3_url,
        timeout=180,
    )
    from trainer_core.plugins.io import DistributedCheckpointIO

    io = DistributedCheckpointIO()
    latest = io.latest_complete(s3_url)
    assert latest is not None and latest.endswith("epoch=1-step=8.ckpt")
    ckpt = io.load_checkpoint(latest)
    _assert_weights_close(ckpt[KEY_STATE_DICT], reference_weights(batch_size=16), atol=1e-6)
    first = f"{s3_url}/epoch=0-step=4.ckpt"
    _run(
        tmp_path,
        "--out",
        "loaded",
        "--plugin",
        "fsdp_sharded",
        "--devices",
        "1",
        "--resume",
        first,
        "--dump-restored",
        timeout=150,
    )
    restored = torch.load(tmp_path / "loaded" / "restored.pt", weights_only=True)
    saved = io.load_checkpoint(first)
    for name, value in saved[KEY_STATE_DICT].items():
        assert torch.equal(restored["weights"][name], value), name


# ---------------------------------------------------------------------- 11. the whole resume matrix
SAVERS = ["single_device", "ddp", "ddp_sharded", "zero", "fsdp", "fsdp_sharded"]


@pytest.fixture(scope="module")
def one_checkpoint_per_plugin(saved_runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The epoch-0 checkpoint each plugin wrote (at 2 ranks; the single device at 1, with the same batch)."""
    single = tmp_path_factory.mktemp("saved-single")
    _run(
        single,
        "--out",
        "out",
        "--plugin",
        "single_device",
        "--devices",
        "1",
        "--batch-size",
        "16",
        "--ckpt-every-epoch",
    )
    paths = {"single_device": single / "out" / "ckpts" / "epoch=0-step=4.ckpt"}
    for plugin in SAVERS[1:]:
        paths[plugin] = saved_runs[plugin] / "ckpts" / "epoch=0-step=4.ckpt"
    return paths


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("loaded_by", "ranks"), [(p, 1 if p == "single_device" else 3) for p in SAVERS])
def test_every_checkpoint_resumes_under_every_plugin(
    one_checkpoint_per_plugin: dict, tmp_path: Path, loaded_by: str, ranks: int
) -> None:
    """docs/architecture.md: a checkpoint written by any plugin resumes under any other, at another world
    size, with model and optimizer tensors equal by name right after the restore."""
    savers = list(one_checkpoint_per_plugin)
    paths = ",".join(str(one_checkpoint_per_plugin[s]) for s in savers)
    _run(
        tmp_path,
        "--out",
        "out",
        "--plugin",
        loaded_by,
        "--devices",
        str(ranks),
        "--resume-many",
        paths,
        timeout=280,
    )
    for index, saved_by in enumerate(savers):
        ckpt = _load_ckpt(one_checkpoint_per_plugin[saved_by])
        restored = torch.load(tmp_path / "out" / f"many{index}" / "restored.pt", weights_only=True)
        where = f"{saved_by} -> {loaded_by} at {ranks} rank(s)"
        assert restored["global_step"] == 4, where
        for name, saved in ckpt[KEY_STATE_DICT].items():
            assert torch.equal(restored["weights"][name], saved), f"{where}: weight {name}"
        _assert_named_state_equal(restored["optimizer_states"][0], ckpt[KEY_OPTIMIZER_STATES][0], where)
