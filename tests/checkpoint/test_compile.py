"""``torch.compile``: a compiled module checkpoints under the plain names and resumes compiled or not, exactly.

PyTorch Lightning writes a compiled submodule's weights as ``net._orig_mod.0.weight``, so its
checkpoint does not load once compilation is switched off (Lightning #17415, #20233). Here every
checkpoint holds ``net.0.weight``, whether the whole LightningModule was compiled
(``trainer.fit(torch.compile(model))``) or a submodule (``self.net = torch.compile(net)``).

The compiler runs (CPU). Its ``"eager"`` backend runs the captured graph with torch's own kernels, so
a compiled run computes the same numbers as an uncompiled one and the weights compare with
``torch.equal``. Multi-process plugins run through tests/jobs/compile_job.py: DDP on 2 gloo ranks here,
FSDP (full file and sharded folder) and the inductor backend with ``FULL_MATRIX=1`` (``make stress``).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from boring import quiet_trainer
from compile_job import FEATURES, SAVE_AT, STEPS, CompileModel, loader
from launch import JOBS, job_env
from torch import nn

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks.weight_averaging import EMAWeightAveraging
from trainer_core.checkpoint.format import KEY_CALLBACKS, KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities.compile import (
    from_compiled,
    module_state_dict,
    plain_name,
    plain_state_dict,
    to_uncompiled,
)

#: FULL_MATRIX=1 (make stress) adds the inductor backend and FSDP on 2 ranks (a minute each on 2 busy cores).
FULL = os.environ.get("FULL_MATRIX") == "1"


class CountingBackend:
    """A compiler backend that runs the captured graph as it is and counts the graphs it was given."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs += 1
        return graph.forward


def _loader() -> Any:
    return loader(24)  # 6 batches: the save at step 3 falls in the middle of the epoch


def _model(how: str, backend: Any = "eager") -> tuple[CompileModel, Any]:
    """The model, and what ``fit`` is given: ``how`` is ``"none"``, ``"submodule"`` or ``"whole"``."""
    seed_everything(7, verbose=False)
    model = CompileModel(compile=backend if how == "submodule" else None)
    return model, torch.compile(model, backend=backend) if how == "whole" else model


def _fit(how: str, max_steps: int, ckpt_path: Optional[Path] = None, **kwargs: Any) -> tuple[Trainer, Any]:
    model, given = _model(how)
    trainer = quiet_trainer(max_steps=max_steps, **kwargs)
    trainer.fit(given, _loader(), ckpt_path=ckpt_path)
    return trainer, model


def _names_with_orig_mod(obj: Any, where: str = "") -> list[str]:
    """Every dict key or string anywhere in ``obj`` that holds ``_orig_mod``."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(key, str) and "_orig_mod" in key:
                found.append(f"{where}/{key}")
            found += _names_with_orig_mod(value, f"{where}/{key}")
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            found += _names_with_orig_mod(value, f"{where}[{index}]")
    elif isinstance(obj, str) and "_orig_mod" in obj:
        found.append(f"{where}={obj}")
    return found


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=False, map_location="cpu")


def _assert_same_tensors(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in plain_state_dict(model.state_dict()).items()}


# ---------------------------------------------------------------------- the names, without the compiler
def test_names_are_mapped_both_ways_around_nested_compiled_modules() -> None:
    """``_orig_mod`` is left out on save and put back on load, after every compiled module on the way."""
    inner = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    outer = nn.Module()
    outer.block = torch.compile(nn.ModuleDict({"inner": torch.compile(inner), "head": nn.Linear(2, 1)}))
    outer.plain = nn.Linear(1, 1)
    state = outer.state_dict()
    assert "block._orig_mod.inner._orig_mod.1.running_mean" in state

    plain = plain_state_dict(state)
    assert list(plain) == [plain_name(k) for k in state]
    assert "block.inner.1.running_mean" in plain and "plain.weight" in plain
    # torch's module versions travel with the names (BatchNorm's decides how old files load).
    assert plain._metadata["block.inner.1"] == state._metadata["block._orig_mod.inner._orig_mod.1"]

    back = module_state_dict(outer, plain)
    assert list(back) == list(state)
    assert back._metadata["block._orig_mod.inner._orig_mod.1"]["version"] == 2
    # A file with `_orig_mod` names (Lightning's) maps the same way; an uncompiled module takes plain names.
    assert list(module_state_dict(outer, state)) == list(state)
    twin = nn.Module()
    twin.block = nn.ModuleDict(
        {"inner": nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), "head": nn.Linear(2, 1)}
    )
    twin.plain = nn.Linear(1, 1)
    twin.load_state_dict(module_state_dict(twin, state))
    assert torch.equal(twin.block["inner"][0].weight, inner[0].weight)


# ---------------------------------------------------------------------- what a compiled run writes
@pytest.mark.parametrize("how", ["submodule", "whole"])
def test_compiled_run_writes_the_keys_of_an_uncompiled_one(tmp_path: Path, how: str) -> None:
    """Weights, name-keyed optimizer state and the EMA callback's weights: the same names and values."""
    written = {}
    for kind in ("none", how):
        ema = EMAWeightAveraging(decay=0.5)
        trainer, _ = _fit(kind, SAVE_AT, callbacks=[ema])
        trainer.save_checkpoint(tmp_path / f"{kind}.ckpt")
        written[kind] = _load(tmp_path / f"{kind}.ckpt")
    plain, compiled = written["none"], written[how]
    assert _names_with_orig_mod(compiled) == []
    assert list(plain[KEY_STATE_DICT]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    # EMAWeightAveraging writes the averaged weights as `state_dict` and the trained ones beside them.
    _assert_same_tensors(compiled[KEY_STATE_DICT], plain[KEY_STATE_DICT])
    _assert_same_tensors(compiled["current_model_state"], plain["current_model_state"])
    [opt_plain], [opt_compiled] = plain[KEY_OPTIMIZER_STATES], compiled[KEY_OPTIMIZER_STATES]
    assert opt_compiled["param_groups"][0]["params"] == list(plain[KEY_STATE_DICT])
    assert list(opt_compiled["state"]) == list(opt_plain["state"]) == list(plain[KEY_STATE_DICT])
    for name, values in opt_plain["state"].items():
        for key, value in values.items():
            assert torch.equal(opt_compiled["state"][name][key], value), (name, key)
    assert compiled[KEY_CALLBACKS].keys() == plain[KEY_CALLBACKS].keys()


def test_whole_compiled_module_trains_compiled() -> None:
    """``fit(torch.compile(model))`` runs ``training_step`` through the compiler (Lightning's from_compiled)."""
    backend = CountingBackend()
    model, given = _model("whole", backend)
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(given, _loader())
    assert backend.graphs >= 1
    assert trainer.lightning_module is model and trainer.global_step == 2
    assert from_compiled(given) is model  # a second fit with the same wrapper compiles nothing twice
    assert to_uncompiled(model) is model
    assert "training_step" not in vars(model) and model._compiler_ctx is None


def test_whole_compiled_module_pickles_compiled() -> None:
    """``plugins="ddp_spawn"`` pickles the module into its processes: it arrives compiled (Lightning's cannot be)."""
    backend = CountingBackend()
    model = from_compiled(_model("whole", backend)[1])
    clone = pickle.loads(pickle.dumps(model))
    assert clone._compiler_ctx is not None and callable(vars(clone)["training_step"])
    batch = next(iter(_loader()))
    assert torch.equal(clone.training_step(batch, 0), model.training_step(batch, 0))
    assert backend.graphs >= 1


def test_compiled_module_under_a_plugin_that_cannot_run_it_is_refused() -> None:
    """A plugin whose stages never call ``training_step`` says so instead of training uncompiled."""
    from trainer_core.plugins.single_device import SingleDevicePlugin

    class StagesOnly(SingleDevicePlugin):
        compiled_module_unsupported = "the stages run the split parts"

    _, given = _model("whole")
    trainer = quiet_trainer(max_steps=1, plugins=StagesOnly(torch.device("cpu")))
    with pytest.raises(MisconfigurationException, match=r"fit\(torch.compile\(model\)\).*stages run"):
        trainer.fit(given, _loader())
    with pytest.raises(
        MisconfigurationException, match=r"LightningModule, got Linear compiled by torch\.compile"
    ):
        trainer.fit(torch.compile(nn.Linear(1, 1), backend="eager"), _loader())


# ---------------------------------------------------------------------- resuming across compilation
@pytest.mark.parametrize(
    ("writer", "reader"),
    [("submodule", "none"), ("none", "submodule"), ("whole", "submodule")],
)
def test_resume_across_compilation_is_exact(tmp_path: Path, writer: str, reader: str) -> None:
    """Stopped at step 3 and resumed (compiled -> not, not -> compiled): bit-equal to a run that went on."""
    straight, straight_model = _fit("none", STEPS)
    first, _ = _fit(writer, SAVE_AT)
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    resumed, resumed_model = _fit(reader, STEPS, ckpt_path=ckpt)
    assert resumed.global_step == STEPS
    _assert_same_tensors(_weights(resumed_model), _weights(straight_model))
    want, got = straight.optimizers[0].state_dict(), resumed.optimizers[0].state_dict()
    for index, values in want["state"].items():
        for key, value in values.items():
            assert torch.equal(got["state"][index][key], value), (index, key)


def test_load_from_checkpoint_of_a_compiled_run(tmp_path: Path) -> None:
    """Lightning #20233: ``load_from_checkpoint(path, compile=...)`` either way round."""
    trainer, model = _fit("submodule", SAVE_AT)
    trainer.save_checkpoint(tmp_path / "compiled.ckpt")
    plain = CompileModel.load_from_checkpoint(tmp_path / "compiled.ckpt", compile=None)
    assert isinstance(plain.net, nn.Sequential)
    _assert_same_tensors(_weights(plain), _weights(model))
    again = CompileModel.load_from_checkpoint(
        tmp_path / "compiled.ckpt"
    )  # compiled, from its hyper-parameters
    assert hasattr(again.net, "_orig_mod")
    _assert_same_tensors(_weights(again), _weights(model))


@pytest.mark.skipif(
    not FULL, reason="FULL_MATRIX=1 (make stress): inductor compiles C++ kernels, about a minute"
)
def test_inductor_compiled_submodule_resumes_uncompiled(tmp_path: Path) -> None:
    """The real compiler (inductor, C++ on the CPU): plain keys, and a plain module takes its weights."""
    pytest.importorskip("torch._inductor")
    seed_everything(7, verbose=False)
    model = CompileModel(compile="inductor")
    trainer = quiet_trainer(max_steps=2)
    try:
        trainer.fit(model, loader(8))
    except Exception as err:  # no C++ compiler on this machine: the other tests cover the names
        pytest.skip(f"inductor cannot compile here: {err!r}"[:300])
    trainer.save_checkpoint(tmp_path / "inductor.ckpt")
    ckpt = _load(tmp_path / "inductor.ckpt")
    assert _names_with_orig_mod(ckpt) == []
    plain = CompileModel.load_from_checkpoint(tmp_path / "inductor.ckpt", compile=None)
    _assert_same_tensors(_weights(plain), _weights(model))


# ---------------------------------------------------------------------- coming from Lightning
pl = pytest.importorskip("pytorch_lightning")


class LitCompileModel(pl.LightningModule):
    """The same module under PyTorch Lightning; Lightning writes its compiled ``net`` as ``net._orig_mod.*``."""

    def __init__(self) -> None:
        super().__init__()
        net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.net = torch.compile(net, backend="eager")

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _LitSaveAt(pl.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == SAVE_AT and not self.path.exists():
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("reader", ["none", "submodule"])
def test_lightning_checkpoint_of_a_compiled_submodule_resumes(tmp_path: Path, reader: str) -> None:
    """Lightning's ``_orig_mod`` file resumes compiled or not and ends on Lightning's own weights, bit for bit."""
    ckpt = tmp_path / "lightning.ckpt"
    seed_everything(7, verbose=False)
    lit = LitCompileModel()
    pl.Trainer(
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_LitSaveAt(ckpt)],
    ).fit(lit, _loader())
    assert "net._orig_mod.0.weight" in _load(ckpt)[KEY_STATE_DICT]  # what Lightning writes

    resumed, model = _fit(reader, STEPS, ckpt_path=ckpt)
    assert resumed.global_step == STEPS
    _assert_same_tensors(_weights(model), _weights(lit))
    plain = CompileModel.load_from_checkpoint(ckpt, compile=None)
    assert _weights(plain).keys() == _weights(lit).keys()


# ---------------------------------------------------------------------- under DDP and FSDP


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "plugin",
    ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(not FULL, reason="FULL_MATRIX=1 (make stress)"))],
)
def test_two_ranks_with_a_compiled_submodule(tmp_path: Path, plugin: str) -> None:
    """2 gloo ranks: an uncompiled run's checkpoint resumes compiled, exactly; the compiled run writes plain keys.

    Under FSDP both the full file and the sharded folder are written and compared.
    """
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "compile_job.py"), "--plugin", plugin, "--out", str(out)],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=200,
    )
    if proc.returncode != 0:
        pytest.fail(f"job exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["max_abs_diff"] == 0.0, (rank, seen)
        assert seen["global_step"] == STEPS
    straight = _load(out / "plain_final.ckpt")
    compiled = _load(out / "compiled_final.ckpt")
    assert _names_with_orig_mod(compiled) == []
    _assert_same_tensors(compiled[KEY_STATE_DICT], straight[KEY_STATE_DICT])
    assert [g["params"] for g in compiled[KEY_OPTIMIZER_STATES][0]["param_groups"]] == [
        list(straight[KEY_STATE_DICT])
    ]
    # The file a compiled 2-rank run wrote loads into one plain process.
    plain = CompileModel.load_from_checkpoint(out / "compiled_final.ckpt", compile=None)
    _assert_same_tensors(_weights(plain), straight[KEY_STATE_DICT])
    if plugin == "fsdp":
        assert json.loads((out / "sharded_keys.json").read_text()) == sorted(straight[KEY_STATE_DICT])
