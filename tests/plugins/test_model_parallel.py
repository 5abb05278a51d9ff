"""ModelParallelPlugin (tensor parallel x FSDP2, no pipeline) on real gloo process groups.

The runs are ``tests/jobs/model_parallel_job.py`` started the way a user starts a script; one launch
trains several ``fit``s in one process group, so ``make test`` starts four jobs: the one-process
reference, ``[tp=2]`` (plain tensor parallelism, sequence + loss parallel, optimizer in backward,
bf16 mixed precision), ``[dp=2, tp=2]`` (with a sharded and a full checkpoint resumed at the same
layout) and two ranks whose ``configure_model`` is wrong. Every multi-process run is compared with
one process on the same data: the per-batch losses logged with ``sync_dist=True``, the gradient
norms before and after clipping, and the final full weights (``full_tensor()``) to 1e-5; a resume at
the same layout bit for bit. ``FULL_MATRIX=1`` (``make stress``) adds the ``[dp=2, tp=2]`` runs of
sequence parallel, optimizer in backward and mixed precision, and the wrong ``configure_model`` under
the plugin's own launcher. A CUDA test runs ``[tp=2]`` on nccl where there are two GPUs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env
from model_parallel_job import (
    CLIP,
    GLOBAL_BATCH,
    MAX_STEPS,
    N_SAMPLES,
    SAVE_FULL_AT,
    SAVE_SHARDED_AT,
)

from trainer_core import Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import ModelParallelPlugin, ParallelDims
from trainer_core.plugins.model_parallel import resolve_sizes
from trainer_core.plugins.parallel_dims import DATA, PIPELINE, TENSOR
from trainer_core.plugins.registry import available_plugins, plugin_from_name

JOB = str(JOBS / "model_parallel_job.py")
FULL = os.environ.get("FULL_MATRIX") == "1"
TOL = 1e-5  # fp32: the layouts sum in other orders (measured: losses 7e-7, weights 4e-7)
# bf16 keeps 8 bits of mantissa (4e-3 relative): losses of about 3 to 1e-2 (measured 3e-3), gradient
# norms to 1e-2 relative; the weights are not compared.
BF16_TOL = 1e-2
# The parameters the plain plan places on the tensor-parallel mesh (row-wise biases replicated on it).
PLAIN_PLAN = sorted(
    f"layers.{i}.{name}"
    for i in range(2)
    for name in (
        "attn.q.weight",
        "attn.q.bias",
        "attn.k.weight",
        "attn.v.weight",
        "attn.v.bias",
        "attn.o.weight",
        "attn.o.bias",
        "mlp.w1.weight",
        "mlp.w1.bias",
        "mlp.w2.weight",
        "mlp.w2.bias",
    )
)

pytestmark = pytest.mark.timeout(600)


# ---------------------------------------------------------------------- running the job
def _launch(out: Path, suite: str, timeout: float = 400) -> None:
    """Start the job as a user does (the plugin starts the other ranks); it must succeed."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [sys.executable, JOB, "--out", str(out), "--suite", suite],
        cwd=out,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"suite {suite} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )


def _records(out: Path, run: str, world_size: int) -> list[dict[str, Any]]:
    """Every rank's record of ``run``, in rank order."""
    records = [json.loads((out / f"{run}.rank{rank}.json").read_text()) for rank in range(world_size)]
    assert all(r["world_size"] == world_size for r in records)
    assert not list(out.glob(f"{run}.rank{world_size}.json"))
    return records


def _weights(out: Path, run: str) -> dict[str, torch.Tensor]:
    return torch.load(out / f"{run}.weights.pt", weights_only=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process, no plugin: ``main`` and ``in_backward``."""
    out = tmp_path_factory.mktemp("mp") / "reference"
    _launch(out, "reference")
    return out


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``[tp=2]``: ``tp``, ``sp``, ``in_backward``, ``bf16``."""
    out = tmp_path_factory.mktemp("mp") / "tp2"
    _launch(out, "tp2")
    return out


@pytest.fixture(scope="module")
def dp2tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``[dp=2, tp=2]``: ``dp2tp2`` and the two resumed runs."""
    out = tmp_path_factory.mktemp("mp") / "dp2tp2"
    _launch(out, "dp2tp2")
    return out


# ---------------------------------------------------------------------- comparisons
def _assert_matches_one_process(
    out: Path, run: str, world_size: int, reference: Path, ref_run: str = "main", tol: float = TOL
) -> list[dict[str, Any]]:
    """Every rank's logged losses and sample sums, learning rates and gradient norms equal the one-process
    run's (losses to ``tol``, norms to ``tol`` relative), and so do the full weights (to ``TOL``, fp32 only)."""
    (ref,) = _records(reference, ref_run, 1)
    records = _records(out, run, world_size)
    for rank, record in enumerate(records):
        where = f"{run} rank {rank}"
        assert list(record["batches"]) == list(ref["batches"]), where
        for key, batch in record["batches"].items():
            want = ref["batches"][key]
            assert abs(batch["loss"] - want["loss"]) <= tol, (
                f"{where} batch {key}: {batch['loss']} vs {want['loss']}"
            )
            assert batch["global_step"] == want["global_step"], f"{where} batch {key}"
            assert batch["lr"] == pytest.approx(want["lr"], rel=1e-12, abs=0), f"{where} batch {key}: lr"
        # sync_dist=True reduces over the data-parallel ranks only: a sum counts each sample once.
        assert {b["samples"] for b in record["batches"].values()} == {float(GLOBAL_BATCH)}, where
        assert record["epoch_samples"] == ref["epoch_samples"], where
        for kind in ("grad_norms", "clipped_norms"):
            assert list(record[kind]) == list(ref[kind]), f"{where}: {kind}"
            for step, norm in record[kind].items():
                assert norm == pytest.approx(ref[kind][step], rel=tol), f"{where} step {step}: {kind}"
        # The mean is synced: every rank reports the same number.
        assert _same_losses(record, records[0]), where
    if ref["grad_norms"]:
        # The clipping acted on every step: the gradients came out with the norm it allows.
        assert min(ref["grad_norms"].values()) > 2 * CLIP
        assert all(norm == pytest.approx(CLIP, rel=1e-4) for norm in ref["clipped_norms"].values())
    if tol == TOL:
        want_weights, got_weights = _weights(reference, ref_run), _weights(out, run)
        assert list(got_weights) == list(want_weights)
        for name, tensor in want_weights.items():
            assert got_weights[name].shape == tensor.shape, name
            diff = (got_weights[name] - tensor).abs().max().item()
            assert diff <= TOL, f"{run}: {name} differs from one process by {diff}"
    return records


def _same_losses(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a["batches"][k]["loss"] == b["batches"][k]["loss"] for k in a["batches"])


def test_tp2_matches_one_process(reference: Path, tp2: Path) -> None:
    """[tp=2], AdamW, per-step scheduler, clipping by norm, accumulation of 2: as one process."""
    for record in _assert_matches_one_process(tp2, "tp", 2, reference):
        assert sorted(record["tensor_parallel_params"]) == PLAIN_PLAN


def test_dp2_tp2_matches_one_process(reference: Path, dp2tp2: Path) -> None:
    """[dp=2, tp=2], the blocks sharded by configure_model itself, the root by the plugin."""
    for record in _assert_matches_one_process(dp2tp2, "dp2tp2", 4, reference):
        assert sorted(record["tensor_parallel_params"]) == PLAIN_PLAN


def test_data_split_by_data_parallel_rank(reference: Path, tp2: Path, dp2tp2: Path) -> None:
    """A shuffled loader: the ranks of a tensor-parallel group read the same samples in the same order;
    the data-parallel ranks read disjoint halves of what one process reads, covering each epoch."""
    (ref,) = _records(reference, "main", 1)
    for record in _records(tp2, "tp", 2):
        assert [b["indices"] for b in record["batches"].values()] == [
            b["indices"] for b in ref["batches"].values()
        ]
    records = _records(dp2tp2, "dp2tp2", 4)
    seen: dict[str, list[int]] = {"0": [], "1": []}
    for key, want in ref["batches"].items():
        by_rank = [r["batches"][key]["indices"] for r in records]
        # Ranks r = dp_rank * 2 + tp_rank: 0 and 1 are one tensor-parallel group, 2 and 3 the other.
        assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3], f"batch {key}: {by_rank}"
        assert len(by_rank[0]) == len(by_rank[2]) == GLOBAL_BATCH // 2
        assert not set(by_rank[0]) & set(by_rank[2]), f"batch {key}: {by_rank}"
        assert sorted(by_rank[0] + by_rank[2]) == sorted(want["indices"]), f"batch {key}"
        seen[key.split(":")[0]] += by_rank[0] + by_rank[2]
    assert sorted(seen["0"]) == list(range(N_SAMPLES))
    # The second epoch is shuffled again (set_epoch): its first samples are not the first epoch's.
    assert seen["1"] != seen["0"][: len(seen["1"])]


def test_sync_dist_sums_count_each_sample_once(tp2: Path, dp2tp2: Path) -> None:
    """``self.log(n, reduce_fx="sum", sync_dist=True)`` is the global batch (not tp times it), per step
    and over the epoch, under every layout and plugin option."""
    runs = [(tp2, run, 2) for run in ("tp", "sp", "in_backward", "bf16")] + [
        (dp2tp2, run, 4) for run in ("dp2tp2", "resume_sharded", "resume_full")
    ]
    for out, run, world_size in runs:
        for record in _records(out, run, world_size):
            assert {b["samples"] for b in record["batches"].values()} == {float(GLOBAL_BATCH)}, run
            for epoch, total in record["epoch_samples"].items():
                batches = sum(1 for key in record["batches"] if key.startswith(f"{epoch}:"))
                assert total == batches * GLOBAL_BATCH, f"{run} epoch {epoch}"


def test_sequence_parallel_and_loss_parallel(reference: Path, tp2: Path) -> None:
    """SequenceParallel LayerNorms, vocabulary-sharded logits, the loss and backward inside loss_parallel()."""
    records = _assert_matches_one_process(tp2, "sp", 2, reference)
    for record in records:
        placed = set(record["tensor_parallel_params"])
        # The LayerNorms (replicated over the sequence shards) and the vocabulary head live on the mesh too.
        assert {"out.weight", "norm.weight", "layers.0.ln1.weight", "layers.1.ln2.bias"} <= placed
        assert set(PLAIN_PLAN) <= placed


def test_optimizer_in_backward(reference: Path, tp2: Path) -> None:
    """Trainer(optimizer_in_backward=True) at [tp=2] steps each parameter shard as one process steps it."""
    records = _assert_matches_one_process(tp2, "in_backward", 2, reference, ref_run="in_backward")
    assert [b["global_step"] for b in records[0]["batches"].values()] == list(range(1, MAX_STEPS + 1))


def test_mixed_precision_policy(reference: Path, tp2: Path) -> None:
    """FSDP's MixedPrecisionPolicy(bf16 parameters, fp32 reduction): trains in bf16, stores fp32."""
    records = _assert_matches_one_process(tp2, "bf16", 2, reference, tol=BF16_TOL)
    (ref,) = _records(reference, "main", 1)
    for record in records:
        assert set(record["dtypes"].values()) == {"float32"}, record["dtypes"]
        # The forward did run in bf16: the losses are not the fp32 ones.
        assert max(abs(b["loss"] - ref["batches"][k]["loss"]) for k, b in record["batches"].items()) > 1e-4
    weights = _weights(tp2, "bf16")
    assert {t.dtype for t in weights.values()} == {torch.float32}


def test_resume_at_the_same_layout_is_exact(dp2tp2: Path) -> None:
    """[dp=2, tp=2]: a sharded checkpoint at step 2 resumed to the end (writing a full one at step 5),
    and that full file resumed to the end: every batch and the final weights equal the uninterrupted
    run's bit for bit."""
    assert (dp2tp2 / f"dp2tp2.step{SAVE_SHARDED_AT}.ckpt").is_dir()  # a folder of shards
    assert (dp2tp2 / f"resume_sharded.step{SAVE_FULL_AT}.ckpt").is_file()  # one file
    whole = _records(dp2tp2, "dp2tp2", 4)
    want_weights = _weights(dp2tp2, "dp2tp2")
    for run, start in (("resume_sharded", SAVE_SHARDED_AT), ("resume_full", SAVE_FULL_AT)):
        for rank, record in enumerate(_records(dp2tp2, run, 4)):
            where = f"{run} rank {rank}"
            assert record["start_step"] == start, where
            # The checkpoint was written at the batch that made step ``start``: the resumed run starts after it.
            saved = next(
                i for i, b in enumerate(whole[rank]["batches"].values()) if b["global_step"] == start
            )
            first = saved + 1
            assert list(record["batches"]) == list(whole[rank]["batches"])[first:], where
            for key, batch in record["batches"].items():
                assert batch == whole[rank]["batches"][key], f"{where} batch {key}"
            for kind in ("grad_norms", "clipped_norms"):
                expected = {s: v for s, v in whole[rank][kind].items() if int(s) > start}
                assert record[kind] == expected, f"{where}: {kind}"
        got = _weights(dp2tp2, run)
        for name, tensor in want_weights.items():
            assert torch.equal(got[name], tensor), f"{run}: {name}"


# ---------------------------------------------------------------------- wrong configurations
@pytest.mark.parametrize(
    ("sizes", "devices", "expected"),
    [
        (
            {"tensor_parallel_size": 3},
            2,
            "(data_parallel_size=?, tensor_parallel_size=3, pipeline_parallel_size=1): the sizes must multiply "
            "to the 2 processes",
        ),
        (
            {"data_parallel_size": 2, "tensor_parallel_size": 2},
            2,
            "(data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=1): the sizes must multiply "
            "to the 2 processes",
        ),
        ({"data_parallel_size": 3}, 4, "(data_parallel_size=3, tensor_parallel_size=?"),
    ],
)
def test_sizes_that_do_not_fit_the_world(sizes: dict[str, int], devices: int, expected: str) -> None:
    """Refused in the user's process, by the Trainer's constructor: before any process starts."""
    with pytest.raises(MisconfigurationException) as err:
        Trainer(
            plugins=ModelParallelPlugin(**sizes), devices=devices, logger=False, enable_progress_bar=False
        )
    assert f"ModelParallelPlugin{expected}" in str(err.value)
    assert "devices" in str(err.value)


@pytest.mark.parametrize(
    ("argument", "value"),
    [
        ("tensor_parallel_size", 1.5),
        ("tensor_parallel_size", "2"),
        ("tensor_parallel_size", True),
        ("data_parallel_size", 0),
        ("data_parallel_size", -2),
        ("data_parallel_size", 2.0),
    ],
)
def test_sizes_that_are_not_positive_integers(argument: str, value: Any) -> None:
    with pytest.raises(MisconfigurationException) as err:
        ModelParallelPlugin(**{argument: value})
    assert str(err.value) == f"ModelParallelPlugin({argument}={value!r}): use a positive integer or 'auto'."


def test_pipeline_size_that_is_not_a_positive_integer() -> None:
    for value in (0, 1.0, "1"):
        with pytest.raises(
            MisconfigurationException, match=r"pipeline_parallel_size=.*use a positive integer\."
        ):
            ModelParallelPlugin(pipeline_parallel_size=value)


def test_unknown_arguments_are_refused() -> None:
    # FSDPPlugin's own options are not ModelParallelPlugin's: the mesh decides the sharding.
    for name in ("tensor_parallel", "auto_wrap_policy", "state_dict_type", "hybrid_shard"):
        with pytest.raises(MisconfigurationException, match=f"unknown argument '{name}'") as err:
            ModelParallelPlugin(**{name: 2})
        assert "tensor_parallel_size" in str(err.value)  # the valid ones are listed
    with pytest.raises(MisconfigurationException, match="did you mean 'tensor_parallel_size'"):
        plugin_from_name("model_parallel", tensor_parallel=2)
    with pytest.raises(MisconfigurationException, match="needs pipeline_parallel_size > 1"):
        ModelParallelPlugin(split_points=["layers.1"])


def test_registry_name_builds_the_plugin() -> None:
    assert "model_parallel" in available_plugins()
    plugin = plugin_from_name("model_parallel", tensor_parallel_size=2, save_distributed_checkpoint=False)
    assert type(plugin) is ModelParallelPlugin
    assert plugin.tensor_parallel_size == 2 and not plugin.save_distributed_checkpoint
    trainer = Trainer(
        plugins="model_parallel", devices=2, num_nodes=2, logger=False, enable_progress_bar=False
    )
    assert type(trainer.plugin) is ModelParallelPlugin
    # "auto": tensor parallel inside a node, data parallel across the nodes.
    dims = trainer.plugin.parallel_dims
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 1)
    assert dims.describe() == "[dp=2, tp=2]"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wrong_configure_model_fails_on_every_rank(tmp_path: Path) -> None:
    """A plan naming a missing submodule, then a configure_model that applies no tensor parallelism at
    tensor_parallel_size=2: every rank raises the same error before training, and exits non-zero at once.

    The ranks are started apart (as torchrun does), so that no rank is ended by another: each must
    raise on its own, or it would wait in a collective for the timeout (10 minutes).
    """
    port = _free_port()
    procs, logs = [], []
    started = time.monotonic()
    for rank in range(2):
        env = job_env()
        env.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        logs.append(open(tmp_path / f"rank{rank}.log", "w"))  # closed below
        procs.append(
            subprocess.Popen(
                [sys.executable, JOB, "--out", str(tmp_path), "--suite", "errors"],
                cwd=tmp_path,
                env=env,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
            )
        )
    try:
        for rank, proc in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, 150 - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still runs after 150 s: it waits for a rank that has failed")
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, proc in enumerate(procs):
        output = (tmp_path / f"rank{rank}.log").read_text()
        assert proc.returncode != 0, f"rank {rank} exited with 0:\n{output[-4000:]}"
        assert "MisconfigurationException" in output, f"rank {rank}:\n{output[-4000:]}"
        bad_plan = (tmp_path / f"bad_plan.error{rank}.txt").read_text()
        assert bad_plan.startswith("MisconfigurationException: TinyTransformer.configure_model applied a "), (
            bad_plan
        )
        assert "'qkv'" in bad_plan and "matches no submodule" in bad_plan, bad_plan
        no_tp = (tmp_path / f"no_tp.error{rank}.txt").read_text()
        assert no_tp.startswith(
            "MisconfigurationException: ModelParallelPlugin(tensor_parallel_size=2): "
            "TinyTransformer.configure_model did not parallelize any parameter"
        ), no_tp
    # Nothing trained: no step was recorded.
    assert not list(tmp_path.glob("*.json"))


@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1: the plugin's own launcher ends the other ranks")
@pytest.mark.parametrize("suite", ["bad_plan", "no_tp"])
def test_wrong_configure_model_under_the_plugins_launcher(tmp_path: Path, suite: str) -> None:
    """Started as a user starts it: the run fails with the error, ends its other rank, exits non-zero."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, JOB, "--out", str(tmp_path), "--suite", suite],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert proc.returncode != 0
    expected = "matches no submodule" if suite == "bad_plan" else "did not parallelize any parameter"
    assert expected in proc.stderr
    assert expected in (tmp_path / f"{suite}.error0.txt").read_text()
    assert time.monotonic() - started < 150


@pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1: [dp=2, tp=2] with each option")
def test_dp2_tp2_options(reference: Path, tmp_path: Path) -> None:
    """Sequence + loss parallel, optimizer in backward and bf16 mixed precision at [dp=2, tp=2]."""
    _launch(tmp_path, "dp2tp2_extra")
    _assert_matches_one_process(tmp_path, "sp", 4, reference)
    _assert_matches_one_process(tmp_path, "in_backward", 4, reference, ref_run="in_backward")
    for record in _assert_matches_one_process(tmp_path, "bf16", 4, reference, tol=BF16_TOL):
        assert set(record["dtypes"].values()) == {"float32"}


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
)
def test_tp2_on_cuda_matches_one_gpu(tmp_path: Path) -> None:
    """[tp=2] with nccl on two GPUs against one GPU: the same losses, norms and weights."""
    _launch(tmp_path / "one", "gpu_reference")
    _launch(tmp_path / "two", "gpu")
    records = _assert_matches_one_process(
        tmp_path / "two", "gpu", 2, tmp_path / "one", ref_run="gpu_reference"
    )
    for record in records:
        assert sorted(record["tensor_parallel_params"]) == PLAIN_PLAN


# ---------------------------------------------------------------------- layout arithmetic
def test_parallel_dims_coordinates() -> None:
    """Pipeline-major, tensor-parallel fastest: rank = pp * (dp * tp) + dp * tp_size + tp."""
    dims = ParallelDims(8, tp=2, pp=2)
    assert (dims.dp, dims.dp_shard, dims.shape, dims.dim_names) == (2, 2, (2, 2, 2), (PIPELINE, DATA, TENSOR))
    table = [dims.coordinates(rank) for rank in range(8)]
    assert [(c[PIPELINE], c[DATA], c[TENSOR]) for c in table] == [
        (0, 0, 0),
        (0, 0, 1),
        (0, 1, 0),
        (0, 1, 1),
        (1, 0, 0),
        (1, 0, 1),
        (1, 1, 0),
        (1, 1, 1),
    ]
    assert dims.describe() == "[pp=2, dp=2, tp=2]"
    assert ParallelDims(1).describe() == "[one process]"
    assert ParallelDims(6, tp=3).coordinates(5) == {PIPELINE: 0, DATA: 1, TENSOR: 2}
    hybrid = ParallelDims(8, dp_replicate=2, dp_shard=2, tp=2)
    assert hybrid.dp == 4 and hybrid.shape == (1, 2, 2, 2)
    assert hybrid.dim_names == (PIPELINE, "data_parallel_replicate", "data_parallel_shard", TENSOR)
    assert hybrid.describe() == "[replicate=2, shard=2, tp=2]"
    assert hybrid.coordinates(7) == {PIPELINE: 0, DATA: 3, TENSOR: 1}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 6, "tp": 4, "owner": "ModelParallelPlugin"},
            "ModelParallelPlugin: the parallel sizes (pipeline 1, tensor 4, data-parallel replicas 1) do not divide "
            "the 6 processes of the run; make devices x num_nodes a multiple of 4, or change the sizes.",
        ),
        (
            {"world_size": 8, "tp": 2, "dp_shard": 3},
            "the plugin: the parallel sizes (pipeline 1, tensor 2, data-parallel replicas 1, data-parallel shards 3) "
            "make 6 processes, but the run has 8 (devices x num_nodes); make the product of the sizes equal it.",
        ),
        ({"world_size": 4, "tp": 0}, "the plugin: tp=0 must be a positive integer."),
        ({"world_size": 4, "pp": True}, "the plugin: pp=True must be a positive integer."),
        ({"world_size": 4, "dp_replicate": 1.5}, "the plugin: dp_replicate=1.5 must be a positive integer."),
        ({"world_size": 4, "dp_shard": 0}, "the plugin: dp_shard=0 must be a positive integer or -1."),
    ],
)
def test_parallel_dims_refuses(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationException) as err:
        ParallelDims(**kwargs)
    assert str(err.value) == message


def test_parallel_dims_mesh_needs_the_processes() -> None:
    with pytest.raises(RuntimeError, match="the device mesh is built once the processes have started"):
        ParallelDims(2, tp=2, owner="ModelParallelPlugin").mesh  # noqa: B018


@pytest.mark.parametrize(
    ("world", "per_node", "dp", "tp", "pp", "expected"),
    [
        (4, 4, "auto", "auto", 1, (1, 4, 1)),  # one node: all tensor parallel
        (8, 4, "auto", "auto", 1, (2, 4, 1)),  # two nodes: tensor inside, data across
        (8, 4, "auto", "auto", 2, (2, 2, 2)),  # the pipeline takes its share of a node first
        (6, 3, "auto", "auto", 2, (3, 1, 2)),  # 3 devices do not split into 2 stages: no tensor parallel
        (4, 4, 2, "auto", 1, (2, 2, 1)),  # whatever the other sizes leave
        (8, 8, "auto", 2, 1, (4, 2, 1)),
        (8, 8, "auto", 2, 2, (2, 2, 2)),
        (4, 4, 4, 1, 1, (4, 1, 1)),
    ],
)
def test_resolve_sizes(
    world: int, per_node: int, dp: Any, tp: Any, pp: int, expected: tuple[int, int, int]
) -> None:
    assert resolve_sizes("ModelParallelPlugin", world, per_node, dp, tp, pp) == expected


@pytest.mark.parametrize(
    ("world", "dp", "tp", "pp", "shown"),
    [
        (4, "auto", 3, 1, "data_parallel_size=?, tensor_parallel_size=3, pipeline_parallel_size=1"),
        (4, 3, "auto", 1, "data_parallel_size=3, tensor_parallel_size=?, pipeline_parallel_size=1"),
        (8, 2, 2, 1, "data_parallel_size=2, tensor_parallel_size=2, pipeline_parallel_size=1"),
        (4, "auto", 2, 3, "data_parallel_size=?, tensor_parallel_size=2, pipeline_parallel_size=3"),
    ],
)
def test_resolve_sizes_refuses(world: int, dp: Any, tp: Any, pp: int, shown: str) -> None:
    with pytest.raises(MisconfigurationException) as err:
        resolve_sizes("ModelParallelPlugin", world, world, dp, tp, pp)
    assert str(err.value) == (
        f"ModelParallelPlugin({shown}): the sizes must multiply to the {world} processes of the run "
        "(devices x num_nodes); change the sizes or the number of devices."
    )
