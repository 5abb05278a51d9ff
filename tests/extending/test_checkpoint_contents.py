"""What a user's extensions put in a checkpoint comes back: stateful callbacks and optimizer-state fields.

Written as a user writes the extensions, from the public API only: a stateful callback run as two
instances (refused with the default ``state_key``, each instance's own state back once the key is built
with ``generate_state_key``), and plugin subclasses whose ``optimizer_state`` adds a field that
``load_optimizer_state_dict`` reads back on resume: on one device, and under the two sharded-optimizer
plugins (fairscale OSS, torch ZeRO) on a real 2-rank gloo group.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import JOBS, job_env
from optimizer_field_job import FIELD
from resume_job import ResumeModule, dataloader, trainer_kwargs

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import Callback, EarlyStopping, ModelCheckpoint
from trainer_core.checkpoint import (
    KEY_CALLBACKS,
    KEY_OPTIMIZER_STATES,
    merge_named_states,
    optimizer_state_from_names,
    optimizer_state_to_names,
    parameter_names,
    select_named_state,
)
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.plugins import FSDPPlugin, PipelinePlugin, SingleDevicePlugin
from trainer_core.plugins.environments import find_free_port


# ---------------------------------------------------------------------- two instances of one callback
class BatchCounter(Callback):
    """Counts training batches in steps of ``step``; the count is what a resumed run continues from."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.count = 0
        self.loaded: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.count += self.step

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded.append(dict(state_dict))
        self.count = state_dict["count"]


class KeyedBatchCounter(BatchCounter):
    @property
    def state_key(self) -> str:
        return self.generate_state_key(step=self.step)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_two_stateful_callbacks_with_one_key_are_refused_before_anything_runs(tmp_path: Path) -> None:
    seed_everything(0, verbose=False)
    model = ResumeModule()
    before = _weights(model)
    first, second = BatchCounter(1), BatchCounter(10)
    trainer = Trainer(
        **trainer_kwargs(max_steps=3, enable_checkpointing=True, default_root_dir=str(tmp_path)),
        callbacks=[first, second],
    )
    with pytest.raises(MisconfigurationException) as raised:
        trainer.fit(model, dataloader())
    message = str(raised.value)
    assert "two BatchCounter callbacks" in message and "'BatchCounter'" in message
    assert "state_key" in message and "self.generate_state_key(" in message
    assert trainer.global_step == 0 and first.count == second.count == 0
    assert list(tmp_path.rglob("*")) == []  # no checkpoint, no log folder
    after = _weights(model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_duplicate_from_configure_callbacks_is_refused_too(tmp_path: Path) -> None:
    class Module(ResumeModule):
        def configure_callbacks(self) -> list[Callback]:
            return [BatchCounter(1), BatchCounter(2)]

    trainer = Trainer(**trainer_kwargs(max_steps=3, default_root_dir=str(tmp_path)))
    with pytest.raises(MisconfigurationException, match=r"two BatchCounter callbacks .*generate_state_key"):
        trainer.fit(Module(), dataloader())
    assert trainer.global_step == 0


def test_each_keyed_instance_gets_its_own_state_back(tmp_path: Path) -> None:
    seed_everything(0, verbose=False)
    counters = [KeyedBatchCounter(1), KeyedBatchCounter(10)]
    trainer = Trainer(**trainer_kwargs(max_steps=3), callbacks=counters)
    trainer.fit(ResumeModule(), dataloader())
    path = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)[KEY_CALLBACKS]
    assert saved == {
        "KeyedBatchCounter{'step': 1}": {"count": 3},
        "KeyedBatchCounter{'step': 10}": {"count": 30},
    }

    resumed = [KeyedBatchCounter(1), KeyedBatchCounter(10)]
    Trainer(**trainer_kwargs(max_steps=5), callbacks=resumed).fit(
        ResumeModule(), dataloader(), ckpt_path=path
    )
    assert [cb.loaded for cb in resumed] == [[{"count": 3}], [{"count": 30}]]
    assert [cb.count for cb in resumed] == [5, 50]


def test_builtin_keys_tell_instances_apart_by_their_settings_as_lightnings_do(tmp_path: Path) -> None:
    from pytorch_lightning.callbacks import EarlyStopping as LitEarlyStopping
    from pytorch_lightning.callbacks import ModelCheckpoint as LitModelCheckpoint

    # The same keys as Lightning's (and as before): checkpoints written by either still resume.
    for ours, theirs in [
        (ModelCheckpoint(monitor="val_loss"), LitModelCheckpoint(monitor="val_loss")),
        (ModelCheckpoint(every_n_train_steps=2), LitModelCheckpoint(every_n_train_steps=2)),
        (EarlyStopping(monitor="val_loss", mode="max"), LitEarlyStopping(monitor="val_loss", mode="max")),
    ]:
        assert ours.state_key == theirs.state_key
        assert (
            ours._generate_state_key(a=1) == ours.generate_state_key(a=1) == theirs._generate_state_key(a=1)
        )

    # Two checkpoint callbacks with different settings run side by side, each with its own state.
    by_loss = ModelCheckpoint(dirpath=tmp_path / "loss", monitor="val_loss")
    by_step = ModelCheckpoint(dirpath=tmp_path / "step", every_n_train_steps=2)
    trainer = Trainer(**trainer_kwargs(max_epochs=1, enable_checkpointing=True), callbacks=[by_loss, by_step])
    trainer.fit(ResumeModule(), dataloader(), dataloader(shuffle=False))
    assert Path(by_loss.best_model_path).parent == tmp_path / "loss"
    assert Path(by_step.best_model_path).parent == tmp_path / "step"
    states = torch.load(by_step.best_model_path, weights_only=False)[KEY_CALLBACKS]
    assert states[by_loss.state_key]["monitor"] == "val_loss"
    assert states[by_step.state_key]["dirpath"] == str(tmp_path / "step")

    # Two with the same settings are refused, as Lightning refuses them.
    twins = [ModelCheckpoint(dirpath=tmp_path / "a"), ModelCheckpoint(dirpath=tmp_path / "b")]
    with pytest.raises(MisconfigurationException, match="two ModelCheckpoint callbacks"):
        Trainer(**trainer_kwargs(max_steps=1, enable_checkpointing=True), callbacks=twins).fit(
            ResumeModule(), dataloader()
        )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------------- a field of the optimizer state
def test_name_keying_keeps_every_other_top_level_field() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    names = parameter_names(model)
    field = {"seen": torch.arange(3), "note": "kept"}
    named = optimizer_state_to_names({**optimizer.state_dict(), FIELD: field}, optimizer, names)
    assert named[FIELD] is field
    # A rank of a sharded optimizer holds none of the state; a field added there is kept as it is.
    assert optimizer_state_to_names({FIELD: field}, optimizer, names) == {FIELD: field}
    assert optimizer_state_from_names(named, optimizer, names)[FIELD] is field
    assert select_named_state(named, ["0.weight"])[FIELD] is field
    assert (
        merge_named_states([select_named_state(named, ["0.weight"]), select_named_state(named, ["1.bias"])])[
            FIELD
        ]
        == field
    )
    other = {**select_named_state(named, ["1.bias"]), FIELD: {"seen": torch.zeros(3), "note": "kept"}}
    with pytest.raises(CheckpointError, match=f"different values under '{FIELD}'"):
        merge_named_states([select_named_state(named, ["0.weight"]), other])


class CountingSingleDevicePlugin(SingleDevicePlugin):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.loaded: list[Any] = []

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {**super().optimizer_state(optimizer), FIELD: self.lightning_module.global_step}

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        self.loaded.append(state_dict[FIELD])
        super().load_optimizer_state_dict(optimizer, state_dict)


def test_a_field_added_by_a_plugin_subclass_lands_in_the_file_and_comes_back(tmp_path: Path) -> None:
    seed_everything(0, verbose=False)
    trainer = Trainer(**trainer_kwargs(max_steps=3), plugins=[CountingSingleDevicePlugin()])
    trainer.fit(ResumeModule(), dataloader())
    path = tmp_path / "step3.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)[KEY_OPTIMIZER_STATES][0][FIELD] == 3
    plugin = CountingSingleDevicePlugin()
    Trainer(**trainer_kwargs(max_steps=4), plugins=[plugin]).fit(ResumeModule(), dataloader(), ckpt_path=path)
    assert plugin.loaded == [3]


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tests/jobs/optimizer_field_job.py`` at 2 ranks (both plugins, one launch)."""
    out = tmp_path_factory.mktemp("optimizer_field")
    port, timeout, started = find_free_port(), 240.0, time.monotonic()
    procs = []
    for rank in range(2):
        env = job_env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        log = open(out / f"rank{rank}.log", "w")  # closed below
        job = [sys.executable, str(JOBS / "optimizer_field_job.py"), "--out", str(out)]
        proc = subprocess.Popen(job, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT)
        procs.append((proc, log))
    try:
        for rank, (proc, _) in enumerate(procs):
            try:
                proc.wait(timeout=max(1.0, timeout - (time.monotonic() - started)))
            except subprocess.TimeoutExpired:
                pytest.fail(f"rank {rank} still runs after {timeout:.0f} s")
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (out / f"rank{rank}.log").read_text()[-4000:]
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plugin", ["ddp_sharded", "zero"])
def test_a_sharded_plugin_field_is_written_resumed_on_every_rank_and_training_continues_exactly(
    sharded_runs: Path, plugin: str
) -> None:
    saved = torch.load(sharded_runs / f"{plugin}.ckpt", weights_only=False)[KEY_OPTIMIZER_STATES][0]
    assert torch.equal(saved[FIELD], torch.tensor([2]))  # written after step 2
    assert sorted(saved) == sorted([FIELD, "state", "param_groups"])
    for rank in range(2):
        facts = torch.load(sharded_runs / f"rank{rank}_{plugin}.pt", weights_only=False)
        assert facts["straight_loaded"] == []
        assert len(facts["loaded"]) == 1 and torch.equal(facts["loaded"][0], torch.tensor([2])), rank
        # Bit for bit the run that never stopped (same world size, same layout).
        straight, resumed = facts["straight"], facts["resumed"]
        assert sorted(straight) == sorted(resumed)
        assert all(torch.equal(straight[k], resumed[k]) for k in straight), rank


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plugin", ["ddp_sharded", "zero"])
def test_consolidation_gives_what_the_sharded_optimizers_own_state_dict_gives(
    sharded_runs: Path, plugin: str
) -> None:
    rank0 = torch.load(sharded_runs / f"rank0_{plugin}.pt", weights_only=False)
    gathered, own = rank0["gathered"], rank0["own"]
    assert sorted(gathered) == sorted(own) == ["param_groups", "state"]
    assert gathered["param_groups"] == own["param_groups"]
    assert sorted(gathered["state"]) == sorted(own["state"]) == [0, 1, 2, 3]
    for index, values in own["state"].items():
        assert sorted(gathered["state"][index]) == sorted(values)
        assert all(
            torch.equal(torch.as_tensor(gathered["state"][index][k]), torch.as_tensor(v))
            for k, v in values.items()
        )
    rank1 = torch.load(sharded_runs / f"rank1_{plugin}.pt", weights_only=False)
    assert rank1["gathered"] == {} and rank1["own"] == {}


class FieldFSDPPlugin(FSDPPlugin):
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {**super().optimizer_state(optimizer), FIELD: 1}


class FieldPipelinePlugin(PipelinePlugin):
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {**super().optimizer_state(optimizer), FIELD: 1}


@pytest.mark.parametrize(
    ("plugin", "parent"), [(FieldFSDPPlugin, "FSDPPlugin"), (FieldPipelinePlugin, "PipelinePlugin")]
)
def test_an_optimizer_state_override_that_would_never_run_is_refused_where_the_plugin_is_built(
    plugin: type, parent: str
) -> None:
    with pytest.raises(MisconfigurationException) as raised:
        plugin()
    message = str(raised.value)
    assert f"{plugin.__name__} overrides `optimizer_state`, which {parent} never calls" in message
    assert "Override `named_optimizer_state` instead" in message and "plugin_state_dict()" in message


def test_a_field_a_sharded_folder_would_lose_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    class NamedFieldFSDPPlugin(FSDPPlugin):
        def named_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
            return {**super().named_optimizer_state(optimizer), FIELD: 1}

    plugin = NamedFieldFSDPPlugin(state_dict_type="sharded")
    checkpoint = {KEY_OPTIMIZER_STATES: [{"state": {}, "param_groups": [], FIELD: 1}]}
    with pytest.raises(MisconfigurationException) as raised:
        plugin.save_checkpoint(checkpoint, str(tmp_path / "sharded.ckpt"))
    message = str(raised.value)
    assert "NamedFieldFSDPPlugin writes sharded checkpoints" in message and f"'{FIELD}'" in message
    assert "plugin_state_dict()" in message and "state_dict_type='full'" in message
    assert list(tmp_path.iterdir()) == []
