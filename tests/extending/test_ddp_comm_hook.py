"""DDP communication hooks as a user writes them: ``DDPPlugin(ddp_comm_hook=..., ddp_comm_state=...)``.

Two launches of ``tests/jobs/comm_hook_job.py`` (2 ranks, gloo on CPU, 24 steps each run): a hook that
counts its calls (torch's ``allreduce_hook`` underneath), and PowerSGD stopped at step 12 and resumed.
The rest runs here, in one process: world size 1, and the mistakes refused where the plugin is built.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from comm_hook_job import SAVE_AT, STEPS, Regression, counting_hook, data
from launch import JOBS, job_env
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, fp16_compress_wrapper
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

from trainer_core import Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import DDPPlugin

pytestmark = pytest.mark.timeout(240)

JOB = str(JOBS / "comm_hook_job.py")


def run_job(folder: Path, case: str) -> list[dict[str, Any]]:
    """Run ``case`` as a user runs the script; what each of its two ranks recorded."""
    proc = subprocess.run(
        [sys.executable, JOB, case, "--out", str(folder)],
        cwd=folder,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, (
        f"{case} exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return [torch.load(folder / f"rank{rank}.pt", weights_only=True) for rank in range(2)]


@pytest.fixture(scope="module")
def counted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_job(tmp_path_factory.mktemp("count"), "count")


@pytest.fixture(scope="module")
def powersgd(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    folder = tmp_path_factory.mktemp("powersgd")
    return folder, run_job(folder, "powersgd")


@pytest.fixture
def trainer_core_log() -> Iterator[list[str]]:
    """What the ``trainer_core`` logger says during the test."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("trainer_core")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def _bucket_count(sizes: str) -> int:
    return len(sizes.split(","))


# ---------------------------------------------------------------------- a hook that counts
def test_the_hook_runs_once_per_gradient_bucket_at_every_step(counted: list[dict[str, Any]]) -> None:
    """DDP reduces its first iteration in one bucket, then rebuilds two: 1 + 23 x 2 calls on each rank."""
    for facts in counted:
        layout = facts["layout"]
        initial, rebuilt = (
            _bucket_count(layout["bucket_sizes"]),
            _bucket_count(layout["rebuilt_bucket_sizes"]),
        )
        assert (initial, rebuilt) == (1, 2), layout
        calls = facts["calls"]
        assert len(calls) == initial + (STEPS - 1) * rebuilt == 47
        assert sum(last for _, last in calls) == STEPS  # the step's last bucket, once a step
        assert [index for index, _ in calls] == [0] + [0, 1] * (STEPS - 1)


def test_a_hook_that_all_reduces_trains_exactly_as_plain_ddp(counted: list[dict[str, Any]]) -> None:
    for facts in counted:
        for name, plain in facts["plain"].items():
            assert torch.equal(facts["hooked"][name], plain), name
    for name, weight in counted[0]["hooked"].items():
        assert torch.equal(counted[1]["hooked"][name], weight), f"the ranks' {name} differ"


# ---------------------------------------------------------------------- PowerSGD
def _data_loss(weights: dict[str, torch.Tensor], hidden: int, outputs: int) -> float:
    torch.manual_seed(0)  # the initial weights of the job's runs (seed_everything(0))
    module = Regression(hidden, outputs)
    if weights:
        module.load_state_dict(weights)
    x, y = data(outputs).dataset.tensors
    return (module.net(x) - y).square().sum(dim=1).mean().item()


def test_powersgd_trains_the_regression(powersgd: tuple[Path, list[dict[str, Any]]]) -> None:
    """Over the 64 samples: at least 10 times lower after 24 steps for the map, 4 times for the MLP."""
    facts = powersgd[1][0]
    for layout, shape, factor in (("kept", (0, 16), 10), ("rebuilt", (32, 1), 4)):
        before, after = _data_loss({}, *shape), _data_loss(facts[layout]["full"], *shape)
        assert after * factor < before, f"{layout}: {before:.3f} -> {after:.3f}"


def test_powersgd_resumes_exactly_at_the_same_world_size(powersgd: tuple[Path, list[dict[str, Any]]]) -> None:
    """Stopped at step 12 and resumed: the weights of the run that went on, bit for bit, on both ranks."""
    for facts in powersgd[1]:
        kept = facts["kept"]
        assert kept["iters"] == [STEPS, STEPS]
        assert kept["messages"] == []
        for name, weight in kept["full"].items():
            assert torch.equal(kept["resumed"][name], weight), name
        # The same resume with a plugin that drops the checkpoint's plugin state: the error feedback is lost.
        drift = max((kept["without_plugin_state"][n] - w).abs().max().item() for n, w in kept["full"].items())
        assert drift > 1e-3


def test_the_checkpoint_holds_every_ranks_powersgd_state(powersgd: tuple[Path, list[dict[str, Any]]]) -> None:
    folder = powersgd[0]
    checkpoint = torch.load(folder / "kept.ckpt", weights_only=True)
    saved = checkpoint["plugin_state"]["ddp_comm_state"]
    assert saved["kind"] == "PowerSGDState" and saved["buckets"] == [[0]]
    first, second = saved["per_rank"]
    assert first["iter"] == second["iter"] == SAVE_AT
    assert first["matrix_approximation_rank"] == 1 and first["start_powerSGD_iter"] == 2
    # Each rank's own compression error; the projections and the generator every rank shares.
    assert not torch.equal(first["error_dict"][0], second["error_dict"][0])
    assert torch.equal(first["p_memory_dict"][0], second["p_memory_dict"][0])
    assert (
        torch.equal(first["rng"]["keys"], second["rng"]["keys"])
        and first["rng"]["pos"] == second["rng"]["pos"]
    )


def test_a_resume_into_rebuilt_buckets_continues_exactly(
    powersgd: tuple[Path, list[dict[str, Any]]],
) -> None:
    """The MLP's single bucket is rebuilt in reverse order; the resumed wrapper starts in it (the
    checkpoint keeps it), so compression goes on from the first step, bit for bit."""
    for facts in powersgd[1]:
        rebuilt = facts["rebuilt"]
        assert rebuilt["messages"] == []
        assert rebuilt["iters"] == [STEPS, STEPS]
        for name, weight in rebuilt["full"].items():
            assert torch.equal(rebuilt["resumed"][name], weight), name


def test_another_world_size_takes_the_shared_powersgd_state(
    powersgd: tuple[Path, list[dict[str, Any]]],
    trainer_core_log: list[str],
    tmp_path: Path,
    no_process_group_left_behind: None,
) -> None:
    """The 2-rank checkpoint resumed by one process: the iteration and the generator, no error feedback."""
    folder = powersgd[0]
    saved = torch.load(folder / "kept.ckpt", weights_only=True)["plugin_state"]["ddp_comm_state"]["per_rank"][
        0
    ]
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    trainer = Trainer(
        plugins=[DDPPlugin(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook)],
        devices=1,
        max_steps=SAVE_AT + 1,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(0, 16), data(16), ckpt_path=folder / "kept.ckpt")
    assert state.iter == SAVE_AT  # no wrapper at world size 1: the hook did not run the step after
    assert state.error_dict == {} and state.p_memory_dict == {}
    assert torch.equal(torch.from_numpy(state.rng.get_state()[1].astype("int64")), saved["rng"]["keys"])
    notes = [m for m in trainer_core_log if "resuming PowerSGD" in m]
    assert notes == [
        "DDPPlugin: resuming PowerSGD: it was saved by 2 ranks and this run has 1: the iteration and the generator "
        "are restored, the error feedback and the warm-start matrices restart from zero."
    ]


# ---------------------------------------------------------------------- one process
def test_at_world_size_one_the_log_says_the_hook_does_not_run(
    trainer_core_log: list[str], tmp_path: Path, no_process_group_left_behind: None
) -> None:
    from comm_hook_job import calls

    calls.clear()
    plugin = DDPPlugin(ddp_comm_hook=counting_hook)
    trainer = Trainer(
        plugins=[plugin],
        devices=1,
        max_steps=3,
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regression()
    trainer.fit(module, data())
    assert plugin.model is module  # no DistributedDataParallel to register anything on
    plugin.wrap_model(module)  # a second setup says nothing new
    assert calls == []
    assert [m for m in trainer_core_log if "communication hook" in m] == [
        "DDPPlugin(ddp_comm_hook=counting_hook): one process, so there is no DistributedDataParallel wrapper and "
        "no gradient communication: the communication hook does not run (plugin.model is the module itself)."
    ]


# ---------------------------------------------------------------------- mistakes, refused where the plugin is built
def _children() -> set[int]:
    return {child.pid for child in psutil.Process().children(recursive=True)}


def refused(build: Any) -> str:
    before, files = _children(), sorted(os.listdir("."))
    with pytest.raises(MisconfigurationException) as raised:
        build()
    assert _children() <= before, "a process was started"
    assert sorted(os.listdir(".")) == files, "something was written"
    return str(raised.value)


def annotated_hook(state: Any, bucket: torch.distributed.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Annotated in a module with postponed annotations: torch sees the strings."""
    return allreduce_hook(state, bucket)


def test_a_hook_that_is_not_a_function_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert refused(lambda: DDPPlugin(ddp_comm_hook="powerSGD")) == (
        "DDPPlugin(ddp_comm_hook='powerSGD'): a communication hook is a function hook(state, bucket) returning a "
        "torch.futures.Future of the reduced bucket; pass one, such as "
        "torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook."
    )


def test_a_hook_torch_would_refuse_at_setup_is_refused_when_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    message = refused(lambda: DDPPlugin(ddp_comm_hook=annotated_hook))
    assert message.startswith("DDPPlugin(ddp_comm_hook=annotated_hook): torch refuses `bucket: ")
    assert (
        "annotate it torch.distributed.GradBucket" in message
        and "from __future__ import annotations" in message
    )

    def renamed(state: Any, grads: Any) -> Any:
        return allreduce_hook(state, grads)

    assert refused(lambda: DDPPlugin(ddp_comm_hook=renamed)).endswith(
        "torch registers a hook whose second parameter is named `bucket` only; rename it."
    )


def test_a_wrapper_without_a_hook_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    assert refused(lambda: DDPPlugin(ddp_comm_wrapper=fp16_compress_wrapper)) == (
        "DDPPlugin(ddp_comm_wrapper=fp16_compress_wrapper): a wrapper wraps a hook, and ddp_comm_hook is None; pass "
        "the hook to wrap as well (ddp_comm_hook=powerSGD_hook, ddp_comm_wrapper=fp16_compress_wrapper)."
    )


def test_a_state_without_a_hook_or_given_as_a_class_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    state = PowerSGDState(process_group=None, start_powerSGD_iter=2)
    assert refused(lambda: DDPPlugin(ddp_comm_state=state)) == (
        "DDPPlugin(ddp_comm_state=PowerSGDState(...)): the state is what ddp_comm_hook is called with, and "
        "ddp_comm_hook is None; pass the hook as well (powerSGD_hook for a PowerSGDState)."
    )
    assert refused(lambda: DDPPlugin(ddp_comm_state=PowerSGDState, ddp_comm_hook=powerSGD_hook)) == (
        "DDPPlugin(ddp_comm_state=PowerSGDState): pass PowerSGDState() (an instance, not the class)."
    )


def test_a_hook_for_a_plugin_whose_wrapper_takes_none_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from trainer_core.plugins import DDPShardedPlugin

    monkeypatch.chdir(tmp_path)
    assert refused(lambda: DDPShardedPlugin(ddp_comm_hook=allreduce_hook)) == (
        "DDPShardedPlugin(ddp_comm_hook=allreduce_hook): ShardedDataParallel reduces each gradient to the rank that "
        "owns it and takes no communication hook; use DDPPlugin or ZeroPlugin for a hook."
    )


def test_a_hook_with_a_wrapper_is_accepted_and_torch_hooks_pass_the_checks() -> None:
    plugin = DDPPlugin(ddp_comm_hook=powerSGD_hook, ddp_comm_wrapper=fp16_compress_wrapper)
    assert plugin.plugin_state_dict() == {}  # no state: nothing to save
    DDPPlugin(ddp_comm_hook=allreduce_hook)
    DDPPlugin(ddp_comm_hook=counting_hook)


class CallCount:
    """A hook state of the user's: saved through its own ``state_dict``."""

    def __init__(self) -> None:
        self.calls = 0

    def state_dict(self) -> dict[str, int]:
        return {"calls": self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def counting_state_hook(state, bucket):  # type: ignore[no-untyped-def]
    """Unannotated: torch compares a hook's annotations with its own classes, and this module's are strings."""
    state.calls += 1
    return allreduce_hook(None, bucket)


def test_a_state_of_the_users_is_saved_through_its_state_dict_and_another_not_at_all() -> None:
    state = CallCount()
    state.calls = 7
    plugin = DDPPlugin(ddp_comm_state=state, ddp_comm_hook=counting_state_hook)
    plugin.configure_devices("cpu", 1, 1)
    saved = plugin.plugin_state_dict()
    assert saved == {"ddp_comm_state": {"kind": "state_dict", "per_rank": [{"calls": 7}]}}
    restored = CallCount()
    resumed = DDPPlugin(ddp_comm_state=restored, ddp_comm_hook=counting_state_hook)
    resumed.configure_devices("cpu", 1, 1)
    resumed.load_plugin_state_dict(saved)
    assert restored.calls == 7
    plain = DDPPlugin(ddp_comm_state=object(), ddp_comm_hook=counting_state_hook)
    plain.configure_devices("cpu", 1, 1)
    assert plain.plugin_state_dict() == {}
