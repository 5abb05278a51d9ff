"""StochasticWeightAveraging and WeightAveraging / EMAWeightAveraging: the numbers, the checkpoint, the resume.

What a user relies on: the averaged weights are the ones a hand-written ``torch.optim.swa_utils`` loop
(or Lightning's own callback, run on the same module and data) gives; validation sees the averaged
weights and training continues with its own; the checkpoint holds what Lightning's holds; and a run
stopped by a checkpoint and resumed ends with bit-identical weights, on one device here and under
DDP and FSDP (2 gloo ranks, tests/jobs/weight_averaging_job.py) at the end of this file.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from launch import JOBS, job_env
from torch import nn
from torch.optim.swa_utils import SWALR
from torch.utils.data import DataLoader
from weight_averaging_job import SaveAt, SwaModel, loader, trainer_for

from trainer_core import seed_everything
from trainer_core.callbacks.base import Callback
from trainer_core.callbacks.stochastic_weight_avg import StochasticWeightAveraging
from trainer_core.callbacks.weight_averaging import EMAWeightAveraging, WeightAveraging
from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.io import TorchCheckpointIO

FEATURES = 4


def _lightning_twin(module: nn.Module, lr: float, *, sgd_scheduler: bool = False) -> Any:
    """The same network and optimizer as a ``pytorch_lightning.LightningModule``, with the same weights."""
    import pytorch_lightning as pl

    class Twin(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = copy.deepcopy(module.net)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            pass

        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=lr)
            if not sgd_scheduler:
                return opt
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)]

    return Twin()


def _lightning_fit(model: Any, callback: Any, max_epochs: int, loader: DataLoader) -> None:
    import pytorch_lightning as pl

    pl.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
        accelerator="cpu",
    ).fit(model, loader)


def _states_close(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], atol: float = 1e-6) -> None:
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.allclose(ours[name].float(), theirs[name].float(), atol=atol, rtol=0), name


def _loader(n: int = 24, batch_size: int = 4, shuffle: bool = False) -> DataLoader:
    return loader(n, batch_size, shuffle)


class Recorder(Callback):
    """Every parameter after every optimizer step (runs before the averaging callback in the list)."""

    def __init__(self) -> None:
        self.after_step: list[list[torch.Tensor]] = []
        self.at_epoch_start: list[list[torch.Tensor]] = []

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.after_step.append([p.detach().clone() for p in pl_module.parameters()])

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.at_epoch_start.append([p.detach().clone() for p in pl_module.parameters()])


# ---------------------------------------------------------------------------------------------- EMA
def test_ema_weights_equal_a_hand_computed_ema_and_lightnings() -> None:
    seed_everything(1)
    model = SwaModel(batch_norm=False)
    twin = _lightning_twin(model, model.lr)
    recorder = Recorder()
    ema = EMAWeightAveraging(decay=0.8)
    trainer_for(max_epochs=2, callbacks=[recorder, ema]).fit(model, _loader())

    # By hand: the first update copies the weights after step 0, later ones blend in each step's weights.
    expected = [t.clone() for t in recorder.after_step[0]]
    for weights in recorder.after_step[1:]:
        expected = [0.8 * e + (1 - 0.8) * w for e, w in zip(expected, weights)]
    assert len(recorder.after_step) == 12
    for got, want in zip(model.parameters(), expected):
        assert torch.equal(got.detach(), want)

    # Lightning's EMAWeightAveraging on the same module, weights and data.
    from pytorch_lightning.callbacks import EMAWeightAveraging as LightningEMA

    _lightning_fit(twin, LightningEMA(decay=0.8), 2, _loader())
    _states_close(model.state_dict(), twin.state_dict())


def test_ema_every_n_steps_from_a_step_on() -> None:
    seed_everything(2)
    model = SwaModel(batch_norm=False)
    recorder = Recorder()
    ema = EMAWeightAveraging(decay=0.5, update_every_n_steps=2, update_starting_at_step=3)
    trainer_for(max_epochs=1, callbacks=[recorder, ema]).fit(model, _loader())
    # 6 steps, indices 0..5: only index 4 is even and >= 3, so the one update (a copy) follows step 4.
    assert ema._latest_update_step == 5
    for got, want in zip(model.parameters(), recorder.after_step[4]):
        assert torch.equal(got.detach(), want)


def test_weight_averaging_default_is_averaged_models_equal_average_buffers_included() -> None:
    """``WeightAveraging()`` averages parameters and buffers (BatchNorm statistics) as ``AveragedModel(use_buffers=True)``."""
    from torch.optim.swa_utils import AveragedModel

    seed_everything(8)
    model = SwaModel(batch_norm=True)
    states: list[dict[str, torch.Tensor]] = []

    class States(Callback):
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            states.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    reference = copy.deepcopy(model)
    trainer_for(max_epochs=1, callbacks=[States(), WeightAveraging()]).fit(model, _loader())
    averaged = AveragedModel(reference, use_buffers=True)
    for state in states:
        reference.load_state_dict(state)
        averaged.update_parameters(reference)
    for (name, ours), theirs in zip(model.state_dict().items(), averaged.module.state_dict().values()):
        assert torch.equal(ours, theirs), name


def test_sharded_folder_checkpoints_are_refused(no_process_group_left_behind: None) -> None:
    """Under FSDPPlugin(state_dict_type="sharded") the averaged weights would have no place: a clear error."""
    from trainer_core.plugins import FSDPPlugin

    for callback in (EMAWeightAveraging(), StochasticWeightAveraging(swa_lrs=0.1)):
        trainer = trainer_for(
            max_epochs=1, plugins=FSDPPlugin(state_dict_type="sharded"), devices=1, callbacks=[callback]
        )
        with pytest.raises(MisconfigurationException, match="state_dict_type='full'"):
            trainer.fit(SwaModel(), _loader())


class SeesWeights(SwaModel):
    """Records the first weight during validation and at each training step start."""

    def __init__(self) -> None:
        super().__init__(batch_norm=False)
        self.in_validation: list[torch.Tensor] = []
        self.in_training: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.in_training.append(self.net[0].weight.detach().clone())
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.in_validation.append(self.net[0].weight.detach().clone())


def test_validation_sees_the_averaged_weights_and_training_its_own() -> None:
    seed_everything(3)
    model = SeesWeights()
    recorder = Recorder()
    ema = EMAWeightAveraging(decay=0.5)
    trainer_for(max_epochs=2, callbacks=[recorder, ema], limit_val_batches=1).fit(
        model, _loader(), _loader(8)
    )
    steps = [w[0] for w in recorder.after_step]  # net.0.weight after each step
    expected = steps[0].clone()
    averages = [expected]
    for w in steps[1:]:
        expected = 0.5 * expected + 0.5 * w
        averages.append(expected)
    # Validation after epoch 0 (6 steps) saw the average of those steps, not the trained weights.
    assert torch.equal(model.in_validation[0], averages[5])
    assert not torch.equal(model.in_validation[0], steps[5])
    # The next training step started from the trained weights again.
    assert torch.equal(model.in_training[6], steps[5])


def test_ema_checkpoint_holds_lightnings_layout(tmp_path: Path) -> None:
    seed_everything(4)
    model = SwaModel(batch_norm=True)
    ema = EMAWeightAveraging(decay=0.7)
    path = str(tmp_path / "mid.ckpt")
    trainer_for(max_epochs=2, callbacks=[ema, SaveAt(path, step=8)]).fit(model, _loader())
    ckpt = TorchCheckpointIO().load_checkpoint(path)
    assert set(ckpt["current_model_state"]) == set(ckpt["state_dict"]) == set(model.state_dict())
    assert int(ckpt["averaging_state"]["n_averaged"]) == 8
    assert ckpt["callbacks"]["EMAWeightAveraging"] == {"latest_update_step": 8, "latest_update_epoch": -1}
    # The trained weights and the averaged ones differ; load_from_checkpoint gives the averaged ones.
    assert not torch.equal(ckpt["state_dict"]["net.0.weight"], ckpt["current_model_state"]["net.0.weight"])
    loaded = SwaModel.load_from_checkpoint(path, batch_norm=True)
    assert torch.equal(loaded.net[0].weight, ckpt["state_dict"]["net.0.weight"])


@pytest.mark.parametrize("callback", ["ema", "ema_buffers_copied", "swa"])
def test_resume_from_a_mid_run_checkpoint_is_exact(tmp_path: Path, callback: str) -> None:
    """Stopped at step 9 (mid-epoch 1) and resumed in a fresh module and callback: the same final weights."""

    def make() -> Callback:
        if callback == "ema":
            return EMAWeightAveraging(decay=0.7)
        if callback == "ema_buffers_copied":
            return WeightAveraging(use_buffers=False)
        return StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=2, annealing_epochs=2)

    path = str(tmp_path / "mid.ckpt")
    seed_everything(5)
    straight = SwaModel(batch_norm=True, scheduler=True)
    trainer_for(max_epochs=4, callbacks=[make(), SaveAt(path, step=9)]).fit(straight, _loader(shuffle=True))

    seed_everything(99)  # everything must come from the checkpoint
    resumed = SwaModel(batch_norm=True, scheduler=True)
    trainer = trainer_for(max_epochs=4, callbacks=[make()])
    trainer.fit(resumed, _loader(shuffle=True), ckpt_path=path)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert trainer.current_epoch == (5 if callback == "swa" else 4)


# ---------------------------------------------------------------------------------------------- SWA
def test_swa_equals_a_hand_written_swa_utils_loop() -> None:
    """No BatchNorm: the average of the weights at the start of epochs 2..4, and SWALR's rates."""
    seed_everything(6)
    model = SwaModel(batch_norm=False, scheduler=True)
    reference = copy.deepcopy(model)
    swa = StochasticWeightAveraging(
        swa_lrs=0.02, swa_epoch_start=3, annealing_epochs=2, annealing_strategy="linear"
    )
    trainer_for(max_epochs=5, callbacks=[swa]).fit(model, _loader())

    # The loop a user writes with torch.optim.swa_utils, following the same schedule.
    from torch.optim.swa_utils import AveragedModel

    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    averaged = AveragedModel(reference.net)
    swa_lr: Optional[SWALR] = None
    for epoch in range(5):
        if epoch >= 2:
            if swa_lr is None:
                for group in opt.param_groups:
                    group["initial_lr"] = 0.02
                swa_lr = SWALR(opt, swa_lr=0.02, anneal_epochs=2, anneal_strategy="linear")
            averaged.update_parameters(reference.net)
        for x, y in _loader():
            opt.zero_grad()
            nn.functional.mse_loss(reference.net(x), y).backward()
            opt.step()
        (swa_lr or step_lr).step()
    for got, want in zip(model.net.parameters(), averaged.module.parameters()):
        assert torch.allclose(got.detach(), want.detach(), atol=1e-6, rtol=0)
    assert int(swa.n_averaged) == 3
    assert model.trainer_lrs[-1] == pytest.approx(0.02)


def test_swa_with_batch_norm_equals_lightnings_swa() -> None:
    """With BatchNorm, one extra forward-only epoch recomputes the statistics for the averaged weights.

    Compared with Lightning's StochasticWeightAveraging on the same module, weights and data: the
    running statistics are equal, and the final weights are Lightning's average. (Lightning 2.6's own
    extra epoch then takes one optimizer step with the gradients it accumulated, global_step 25 instead
    of 24, so the weights its module ends with are no longer the average; here that epoch only runs
    ``training_step``.)
    """
    seed_everything(7)
    model = SwaModel(batch_norm=True, scheduler=True)
    twin = _lightning_twin(model, model.lr, sgd_scheduler=True)
    swa = StochasticWeightAveraging(swa_lrs=0.03, swa_epoch_start=2, annealing_epochs=2)
    trainer = trainer_for(max_epochs=4, callbacks=[swa])
    trainer.fit(model, _loader())
    assert trainer.max_epochs == 4 and trainer.current_epoch == 5
    assert trainer.global_step == 4 * 6  # the extra epoch stepped nothing
    assert model.net[1].momentum == 0.1  # the BatchNorm momentum is back

    from pytorch_lightning.callbacks import StochasticWeightAveraging as LightningSWA

    theirs = LightningSWA(swa_lrs=0.03, swa_epoch_start=2, annealing_epochs=2)
    _lightning_fit(twin, theirs, 4, _loader())
    assert int(theirs.n_averaged) == int(swa._average.n_averaged) == 3
    for got, want in zip(model.parameters(), theirs._average_model.parameters()):
        assert torch.allclose(got.detach(), want.detach(), atol=1e-6, rtol=0)
    ours, twins = dict(model.named_buffers()), dict(twin.named_buffers())
    assert ours.keys() == twins.keys()
    for name in ours:
        assert torch.allclose(ours[name].float(), twins[name].float(), atol=1e-6, rtol=0), name


def test_swa_refuses_bad_arguments() -> None:
    with pytest.raises(MisconfigurationException, match="swa_epoch_start=0"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=0)
    with pytest.raises(MisconfigurationException, match=r"swa_epoch_start=1\.5"):
        StochasticWeightAveraging(swa_lrs=0.1, swa_epoch_start=1.5)
    with pytest.raises(MisconfigurationException, match="swa_lrs"):
        StochasticWeightAveraging(swa_lrs=-1.0)
    with pytest.raises(MisconfigurationException, match="swa_lrs"):
        StochasticWeightAveraging(swa_lrs=[0.1, 1])  # type: ignore[list-item]
    with pytest.raises(MisconfigurationException, match="annealing_strategy"):
        StochasticWeightAveraging(swa_lrs=0.1, annealing_strategy="step")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationException, match="unknown argument"):
        WeightAveraging(avg=lambda a, b, n: a)
    with pytest.raises(MisconfigurationException, match=r"decay=1\.5"):
        EMAWeightAveraging(decay=1.5)


def test_swa_refuses_two_optimizers() -> None:
    class Two(SwaModel):
        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]

        @property
        def automatic_optimization(self) -> bool:
            return False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            return None

    with pytest.raises(MisconfigurationException, match="one optimizer"):
        trainer_for(max_epochs=1, callbacks=[StochasticWeightAveraging(swa_lrs=0.1)]).fit(Two(), _loader())


# ---------------------------------------------------------------------------------------------- 2 ranks
def _run_job(tmp_path: Path, plugin: str) -> dict[str, Any]:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(JOBS / "weight_averaging_job.py"), "--plugin", plugin, "--out", str(out)],
        cwd=tmp_path,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    if proc.returncode != 0:
        pytest.fail(f"job exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("plugin", ["ddp", "fsdp"])
def test_two_ranks_resume_exactly(tmp_path: Path, plugin: str) -> None:
    """SWA and EMA under DDP and FSDP2 (2 gloo ranks): a run resumed from a mid-epoch checkpoint ends bit-equal.

    The checkpoint holds whole tensors by parameter name (the averaged copy gathered like the model's
    state), so it also loads in one process here: its averaged state equals the run's averaged weights.
    """
    results = _run_job(tmp_path, plugin)
    for rank, seen in results.items():
        for name in ("swa", "ema"):
            assert seen[name]["max_abs_diff"] == 0.0, (rank, name, seen[name])
            assert seen[name]["averaged_moved"] > 0.0, (rank, name)
    # One process, no process group: the file written under 2 ranks holds whole averaged tensors.
    ckpt = TorchCheckpointIO().load_checkpoint(str(tmp_path / "out" / "ema_mid.ckpt"))
    final_ema = torch.load(tmp_path / "out" / "ema_final.pt")
    assert set(ckpt["state_dict"]) == set(final_ema)
    assert ckpt["state_dict"]["net.0.weight"].shape == final_ema["net.0.weight"].shape
    swa_ckpt = TorchCheckpointIO().load_checkpoint(str(tmp_path / "out" / "swa_mid.ckpt"))
    average = swa_ckpt["callbacks"]["StochasticWeightAveraging"]["average_model_state"]
    assert average["net.0.weight"].shape == final_ema["net.0.weight"].shape
