"""``ModelPruning`` side by side with Lightning's: the same module, seed and data under both frameworks.

Each test fits one module class built on each framework's base, with the same pruning arguments,
and compares bit for bit what a user reads: the weights (and the masks while pruning is not
permanent), the checkpoint's state dict, and the sparsity numbers the ``verbose`` logs report.
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import random_loader
from torch import nn

import trainer_core as tc
from trainer_core.callbacks import ModelCheckpoint, ModelPruning
from trainer_core.errors import MisconfigurationException

pl = pytest.importorskip("pytorch_lightning")
from pytorch_lightning.callbacks import ModelCheckpoint as PLModelCheckpoint  # noqa: E402
from pytorch_lightning.callbacks import ModelPruning as PLModelPruning  # noqa: E402
from pytorch_lightning.utilities.exceptions import MisconfigurationException as PLMisconfiguration  # noqa: E402

PRUNING = {pl: PLModelPruning, tc: ModelPruning}
CHECKPOINT = {pl: PLModelCheckpoint, tc: ModelCheckpoint}
LOGGERS = {pl: "pytorch_lightning.callbacks.pruning", tc: "trainer_core.callbacks.pruning"}


def _module(framework: Any) -> Any:
    class Net(framework.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(1, 2, kernel_size=2)
            self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(self.conv(x.unsqueeze(1)).flatten(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.mse_loss(self(x), y))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    torch.manual_seed(0)
    return Net()


def _fit(framework: Any, root: Path, caplog: pytest.LogCaptureFixture, **pruning: Any) -> dict[str, Any]:
    """Fit three epochs with ``ModelPruning(**pruning)`` and a checkpoint per epoch; what a user reads after."""
    module = _module(framework)
    callback = PRUNING[framework](**pruning)
    checkpoint = CHECKPOINT[framework](dirpath=root / "ckpt", filename="{epoch}", save_top_k=-1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = framework.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=3,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=[callback, checkpoint],
            default_root_dir=root,
        )
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=LOGGERS[framework]):
            trainer.fit(module, random_loader(16, 3, batch_size=4), random_loader(8, 3, batch_size=4))
    files = sorted((root / "ckpt").iterdir())
    return {
        "state_dict": module.state_dict(),
        "checkpoints": {f.name: torch.load(f, weights_only=True)["state_dict"] for f in files},
        "sparsity": [_numbers(r.getMessage()) for r in caplog.records if r.name == LOGGERS[framework]],
    }


def _numbers(message: str) -> list[str]:
    """The counts and percentages of a sparsity message (each framework words it its own way)."""
    return re.findall(r"\d+(?:\.\d+)?%?", message.split("`)")[-1] if "`)" in message else message)


def _assert_same_tensors(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def _compare(tmp_path: Path, caplog: pytest.LogCaptureFixture, **pruning: Any) -> dict[str, Any]:
    theirs = _fit(pl, tmp_path / "pl", caplog, **pruning)
    ours = _fit(tc, tmp_path / "tc", caplog, **pruning)
    _assert_same_tensors(ours["state_dict"], theirs["state_dict"])
    assert (
        list(ours["checkpoints"])
        == list(theirs["checkpoints"])
        == ["epoch=0.ckpt", "epoch=1.ckpt", "epoch=2.ckpt"]
    )
    for name in theirs["checkpoints"]:
        _assert_same_tensors(ours["checkpoints"][name], theirs["checkpoints"][name])
    assert ours["sparsity"] == theirs["sparsity"]
    return ours


def test_l1_unstructured_each_layer_each_epoch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ours = _compare(
        tmp_path,
        caplog,
        pruning_fn="l1_unstructured",
        parameters_to_prune=None,
        use_global_unstructured=False,
        amount=0.5,
        use_lottery_ticket_hypothesis=False,
        verbose=2,
    )
    # Permanent at the end and in every checkpoint: plain names, half of what was left pruned each epoch.
    assert not any(name.endswith(("_orig", "_mask")) for name in ours["state_dict"])
    assert all(not any(n.endswith("_mask") for n in sd) for sd in ours["checkpoints"].values())
    weight = ours["state_dict"]["net.0.weight"]
    assert int((weight == 0).sum()) == 28  # 32 -> 16 -> 8 -> 4 left
    # One line for the model, then one per tensor (6: three weights, three biases), for each of 3 epochs.
    assert len(ours["sparsity"]) == 3 * 7


def test_global_unstructured_with_an_amount_per_epoch_keeps_masks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = _module(tc)
    ours = _compare(
        tmp_path,
        caplog,
        pruning_fn="l1_unstructured",
        parameter_names=["weight"],
        use_global_unstructured=True,
        amount=lambda epoch: [0.25, 0, 0.5][epoch],
        make_pruning_permanent=False,
        use_lottery_ticket_hypothesis=False,
        verbose=1,
    )
    # Not permanent: the masks are state, in the module and in the checkpoint, equal to Lightning's.
    state = ours["state_dict"]
    assert {"net.0.weight_orig", "net.0.weight_mask", "conv.weight_mask"} <= set(state)
    total = sum(p.numel() for n, p in module.named_parameters() if n.endswith("weight"))
    pruned = sum(int((state[n] == 0).sum()) for n in state if n.endswith("weight_mask"))
    assert pruned == round(0.25 * total) + round(0.5 * (total - round(0.25 * total)))
    assert "net.0.weight_mask" in ours["checkpoints"]["epoch=2.ckpt"]
    assert len(ours["sparsity"]) == 2  # epoch 1 has amount 0: nothing pruned, nothing logged


def test_lottery_ticket_resets_the_kept_weights_to_their_initial_values(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    initial = _module(tc).state_dict()
    ours = _compare(
        tmp_path,
        caplog,
        pruning_fn="random_unstructured",
        amount=0.3,
        use_lottery_ticket_hypothesis=lambda epoch: epoch == 2,
        resample_parameters=False,
        verbose=1,
    )
    # After the last epoch's reset, every kept value is back to its initial value.
    for name, value in ours["state_dict"].items():
        kept = value != 0
        assert torch.equal(value[kept], initial[name][kept]), name


def test_structured_pruning_at_validation_end_on_chosen_epochs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _compare(
        tmp_path,
        caplog,
        pruning_fn="ln_structured",
        pruning_dim=0,
        pruning_norm=2,
        use_global_unstructured=False,
        parameters_to_prune=None,
        parameter_names=["weight"],
        amount=0.25,
        apply_pruning=lambda epoch: epoch != 1,
        prune_on_train_epoch_end=False,
        verbose=2,
    )


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"pruning_fn": "l3_magic"}, "pruning_fn"),
        ({"pruning_fn": torch.nn.utils.prune.L1Unstructured(amount=0.1)}, "pruning_fn"),
        ({"pruning_fn": "ln_structured", "use_global_unstructured": False, "pruning_dim": 0}, "pruning_norm"),
        ({"pruning_fn": "random_structured", "use_global_unstructured": False}, "pruning_dim"),
        ({"pruning_fn": "l1_unstructured", "parameter_names": ["scale"]}, "parameter_names"),
        ({"pruning_fn": "l1_unstructured", "amount": "half"}, "amount"),
        ({"pruning_fn": "l1_unstructured", "verbose": 3}, "verbose"),
    ],
)
def test_bad_arguments_are_refused_as_lightning_does(arguments: dict[str, Any], named: str) -> None:
    with pytest.raises(PLMisconfiguration):
        PLModelPruning(**arguments)
    with pytest.raises(MisconfigurationException, match=named):
        ModelPruning(**arguments)


def test_parameters_not_in_the_model_are_refused_at_setup(tmp_path: Path) -> None:
    stranger = nn.Linear(2, 2)
    for framework, error in ((pl, PLMisconfiguration), (tc, MisconfigurationException)):
        callback = PRUNING[framework]("l1_unstructured", parameters_to_prune=[(stranger, "weight")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = framework.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[callback],
                default_root_dir=tmp_path,
            )
            with pytest.raises(error, match="parameters_to_prune"):
                trainer.fit(_module(framework), random_loader(4, 3, batch_size=4))


def _l1_half(framework: Any) -> Any:
    return PRUNING[framework]("l1_unstructured", amount=0.5, use_lottery_ticket_hypothesis=False)


def test_a_run_resumed_from_a_pruned_checkpoint_continues_as_lightnings(tmp_path: Path) -> None:
    """The checkpoint holds ``weight`` (made permanent) where ``weight_orig`` trained: the optimizer's momentum
    (keyed by parameter name in trainer-core) must come back to the same parameter."""
    final = {}
    for framework in (pl, tc):
        root = tmp_path / framework.__name__
        common = {
            "accelerator": "cpu",
            "devices": 1,
            "logger": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "num_sanity_val_steps": 0,
            "default_root_dir": root,
        }

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checkpoint = CHECKPOINT[framework](dirpath=root, filename="{epoch}", save_top_k=-1)
            first = framework.Trainer(max_epochs=2, callbacks=[_l1_half(framework), checkpoint], **common)
            first.fit(_module(framework), random_loader(8, 3, batch_size=4))
            resumed = framework.Trainer(
                max_epochs=3, callbacks=[_l1_half(framework)], enable_checkpointing=False, **common
            )
            module = _module(framework)
            resumed.fit(module, random_loader(8, 3, batch_size=4), ckpt_path=root / "epoch=0.ckpt")
        final[framework] = module.state_dict()
    _assert_same_tensors(final[tc], final[pl])
