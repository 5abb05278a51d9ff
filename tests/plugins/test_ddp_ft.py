"""``FaultTolerantDDPPlugin`` refuses what it cannot run, before anything trains, in one clear error.

The behaviour of replica groups that die, hang and rejoin is tested on real processes in
``tests/reliability/test_fault_tolerance.py``.
"""

from __future__ import annotations

import copy
import socket
from datetime import timedelta
from typing import Any

import pytest
import torch

pytest.importorskip("torchft")

from boring import BoringModel, random_loader

from trainer_core import Trainer
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import FaultTolerantDDPPlugin, plugin_from_name
from trainer_core.plugins.ddp_ft import skipped_batches

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer(plugin: FaultTolerantDDPPlugin) -> Trainer:
    return Trainer(
        plugins=plugin,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def test_the_name_builds_the_plugin() -> None:
    assert isinstance(plugin_from_name("ddp_ft"), FaultTolerantDDPPlugin)


def test_a_lighthouse_that_cannot_be_reached_fails_before_training_and_changes_nothing() -> None:
    address = f"http://127.0.0.1:{_closed_port()}"
    plugin = FaultTolerantDDPPlugin(
        replica_groups=2, replica_group=0, lighthouse=address, quorum_timeout=timedelta(seconds=1)
    )
    model = BoringModel()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(MisconfigurationException, match=f"lighthouse at {address} cannot be reached"):
        _trainer(plugin).fit(model, random_loader(8, 4))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_an_address_without_a_port_is_named() -> None:
    plugin = FaultTolerantDDPPlugin(replica_groups=2, replica_group=0, lighthouse="lighthouse-host")
    with pytest.raises(MisconfigurationException, match=r"'lighthouse-host'.*give it as http://host:port"):
        _trainer(plugin).fit(BoringModel(), random_loader(8, 4))


def test_a_group_outside_the_job_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"replica group 2 .* groups are numbered 0\.\.1"):
        _trainer(FaultTolerantDDPPlugin(replica_groups=2, replica_group=2, lighthouse="http://127.0.0.1:1"))


def test_a_communication_hook_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"ddp_comm_hook=.*quorum of replica groups"):
        FaultTolerantDDPPlugin(ddp_comm_hook=lambda state, bucket: None)


def test_manual_optimization_is_refused_before_training() -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
    try:

        class Manual(BoringModel):
            def __init__(self) -> None:
                super().__init__()
                self.automatic_optimization = False

        plugin = FaultTolerantDDPPlugin(replica_groups=1, replica_group=0, lighthouse=lighthouse.address())
        with pytest.raises(MisconfigurationException, match="manual optimization is not supported"):
            _trainer(plugin).fit(Manual(), random_loader(8, 4))
    finally:
        lighthouse.shutdown()


def test_one_group_trains_as_one_process() -> None:
    """A job of one group: the quorum is that group, every step commits, the result is a plain run's."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        torch.manual_seed(0)
        ft_model = BoringModel()
        plugin = FaultTolerantDDPPlugin(replica_groups=1, replica_group=0, lighthouse=lighthouse.address())
        _trainer(plugin).fit(ft_model, random_loader(8, 4))
    finally:
        lighthouse.shutdown()
    torch.manual_seed(0)
    plain = BoringModel()
    Trainer(
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(plain, random_loader(8, 4))
    for (name, a), b in zip(ft_model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert plugin.steps_record == [{"epoch": 0, "batch": 0, "batches": 2, "groups": [0], "committed": True}]


def test_skipped_batches_are_the_groups_out_of_a_step_and_every_group_of_a_step_that_did_not_commit() -> None:
    record = [
        {"epoch": 0, "batch": 0, "batches": 2, "groups": [0, 1], "committed": True},
        {"epoch": 0, "batch": 2, "batches": 1, "groups": [0, 1], "committed": False},
        {"epoch": 0, "batch": 3, "batches": 2, "groups": [0], "committed": True},
    ]
    assert skipped_batches(record, 2) == [(0, 2, 0), (0, 2, 1), (0, 3, 1), (0, 4, 1)]


def test_a_group_started_again_between_two_quorums_is_named_as_leaving_and_joining(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A restart that beats the lighthouse's heartbeat timeout keeps the group's number with another process."""
    plugin = FaultTolerantDDPPlugin(replica_groups=2, replica_group=0, lighthouse="http://127.0.0.1:1")
    plugin._note_members(("vm_pid10_group0:a", "vm_pid11_group1:b"))
    with caplog.at_level("WARNING", logger="trainer_core"):
        plugin._note_members(("vm_pid10_group0:a", "vm_pid11_group1:b"))
        assert not caplog.records
        plugin._note_members(("vm_pid10_group0:a", "vm_pid12_group1:c"))
    [message] = [r.getMessage() for r in caplog.records]
    assert "replica group 1 (host vm, pid 11) left the quorum" in message
    assert "(host vm, pid 12) joined the quorum" in message and "2 group(s) train" in message


def test_accumulated_steps_commit_once_per_cycle_as_a_plain_run() -> None:
    """accumulate_grad_batches=2: one quorum and one vote per cycle; the weights are a plain run's bit for bit."""
    from torchft._torchft import LighthouseServer

    def fit(plugin: Any) -> BoringModel:
        torch.manual_seed(0)
        model = BoringModel()
        Trainer(
            plugins=plugin,
            max_steps=3,
            accumulate_grad_batches=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).fit(model, random_loader(12, 4, batch_size=2))
        return model

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100)
    try:
        plugin = FaultTolerantDDPPlugin(replica_groups=1, replica_group=0, lighthouse=lighthouse.address())
        ft_model = fit(plugin)
    finally:
        lighthouse.shutdown()
    plain = fit("single_device")
    for (name, a), b in zip(ft_model.state_dict().items(), plain.state_dict().values()):
        assert torch.equal(a, b), name
    assert plugin.steps_record == [{"epoch": 0, "batch": 0, "batches": 6, "groups": [0], "committed": True}]


def test_a_peer_state_taken_between_steps_replaces_what_moves_with_steps_and_a_misfit_changes_nothing() -> (
    None
):
    """``restore_between_steps`` (a live group falling behind heals inside its loop), under a plain run."""
    from trainer_core.callbacks import Callback
    from trainer_core.checkpoint.restore import restore_between_steps
    from trainer_core.checkpoint.save import dump_checkpoint
    from trainer_core.errors import CheckpointError

    seen: dict[str, Any] = {}

    class Heal(Callback):
        def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == 2 and "peer" not in seen:
                # A copy, as the transport's bytes are: the dump refers to the live tensors.
                seen["peer"] = copy.deepcopy(dump_checkpoint(trainer.checkpoint_parts()))
            if trainer.global_step == 5 and "healed" not in seen:
                misfit = {**seen["peer"], "state_dict": {"net.0.weight": torch.zeros(1)}}
                before = {k: v.clone() for k, v in module.state_dict().items()}
                with pytest.raises(CheckpointError, match="peer"):
                    restore_between_steps(trainer.checkpoint_parts(), misfit, "replica group 1 (a peer)")
                assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())
                assert trainer.global_step == 5
                restore_between_steps(trainer.checkpoint_parts(), seen["peer"], "replica group 1 (a peer)")
                seen["healed"] = {k: v.clone() for k, v in module.state_dict().items()}
                seen["step"] = trainer.global_step
                seen["lr"] = trainer.optimizers[0].param_groups[0]["lr"]
                seen["adam_step"] = next(iter(trainer.optimizers[0].state.values()))["step"].item()

    class Decaying(BoringModel):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.Adam(self.parameters(), lr=0.1)
            return [opt], [{"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5), "interval": "step"}]

    model = Decaying()
    Trainer(
        max_steps=7,
        callbacks=[Heal()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(model, random_loader(16, 4))
    peer = seen["peer"]
    assert seen["step"] == 2 and seen["lr"] == pytest.approx(0.1 * 0.5**2) and seen["adam_step"] == 2
    for name, value in peer["state_dict"].items():
        assert torch.equal(seen["healed"][name], value), name
    # Two steps on from the heal, the weights are no longer the peer's: the run went on from them.
    assert not torch.equal(model.state_dict()["net.0.weight"], peer["state_dict"]["net.0.weight"])
