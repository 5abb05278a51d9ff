"""``load_from_checkpoint`` into a class other than the one that saved, side by side with Lightning's.

Class ``A`` trains and saves; class ``B`` shares its encoder, has another head and other arguments.
Both frameworks load the same Lightning-written file into their ``B``, seeded alike, and the tests
compare every weight (``torch.equal``), the hyper-parameters and the messages.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import random_loader
from torch import nn

import trainer_core as tc

pl = pytest.importorskip("pytorch_lightning")


def _classes(framework: Any) -> tuple[type, type]:
    class A(framework.LightningModule):
        def __init__(self, hidden: int = 4, lr: float = 0.1) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Linear(3, hidden)
            self.head = nn.Linear(hidden, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.mse_loss(self.head(torch.tanh(self.encoder(x))), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    class B(framework.LightningModule):
        # No ``lr``: the checkpoint's value is left out; ``classes`` keeps its default.
        def __init__(self, hidden: int = 4, classes: int = 3) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.encoder = nn.Linear(3, hidden)
            self.classifier = nn.Linear(hidden, classes)

    return A, B


@pytest.fixture(scope="module")
def saved_by_a(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The checkpoint of one epoch of ``A(hidden=5)``, written by each framework."""
    root = tmp_path_factory.mktemp("saved")
    files = {}
    for framework in (pl, tc):
        A, _ = _classes(framework)
        torch.manual_seed(0)
        module = A(hidden=5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = framework.Trainer(
                accelerator="cpu",
                devices=1,
                max_epochs=1,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                default_root_dir=root / framework.__name__,
            )
            trainer.fit(module, random_loader(8, 3, batch_size=4))
        files[framework.__name__] = root / f"{framework.__name__}.ckpt"
        trainer.save_checkpoint(files[framework.__name__])
    return files


def _load_b(framework: Any, path: Path, **kwargs: Any) -> tuple[Any, list[str]]:
    _, B = _classes(framework)
    torch.manual_seed(1)  # the layers the checkpoint lacks start the same under both
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = B.load_from_checkpoint(path, **kwargs)
    return module, [str(w.message) for w in caught]


def _assert_same_weights(ours: nn.Module, theirs: nn.Module) -> None:
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for name, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[name], value), name


MAP_LOCATIONS = {
    "none": None,
    "str": "cpu",
    "device": torch.device("cpu"),
    "dict": {"cuda:0": "cpu"},
    "callable": lambda storage, location: storage,
}


@pytest.mark.parametrize("map_location", MAP_LOCATIONS.values(), ids=MAP_LOCATIONS.keys())
def test_strict_false_loads_the_shared_layers_as_lightning_does(
    map_location: Any, saved_by_a: dict[str, Path]
) -> None:
    path = saved_by_a["pytorch_lightning"]
    theirs, their_warnings = _load_b(pl, path, map_location=map_location, strict=False)
    ours, our_warnings = _load_b(tc, path, map_location=map_location, strict=False)

    _assert_same_weights(ours, theirs)
    saved = torch.load(path, weights_only=True)["state_dict"]
    assert torch.equal(ours.encoder.weight, saved["encoder.weight"])
    assert not torch.equal(ours.classifier.weight[:1], saved["head.weight"])
    assert dict(ours.hparams) == dict(theirs.hparams) == {"hidden": 5, "classes": 3}
    assert ours.device == theirs.device == torch.device("cpu")
    # Each names the keys on either side that did not load.
    for messages in (their_warnings, our_warnings):
        assert any("classifier.weight" in m for m in messages), messages
        assert any("head.weight" in m for m in messages), messages


def test_a_checkpoint_of_ours_loads_into_another_class_as_lightnings_does(
    saved_by_a: dict[str, Path],
) -> None:
    theirs, _ = _load_b(pl, saved_by_a["pytorch_lightning"], strict=False)
    ours, _ = _load_b(tc, saved_by_a["trainer_core"], strict=False)
    _assert_same_weights(ours, theirs)
    assert dict(ours.hparams) == dict(theirs.hparams)


def test_keyword_arguments_override_the_checkpoint_as_in_lightning(saved_by_a: dict[str, Path]) -> None:
    path = saved_by_a["pytorch_lightning"]
    theirs, _ = _load_b(pl, path, strict=False, classes=2, lr=9.0)
    ours, _ = _load_b(tc, path, strict=False, classes=2, lr=9.0)
    _assert_same_weights(ours, theirs)
    assert dict(ours.hparams) == dict(theirs.hparams) == {"hidden": 5, "classes": 2}


def test_strict_loading_into_another_class_names_every_key_that_differs(saved_by_a: dict[str, Path]) -> None:
    path = saved_by_a["pytorch_lightning"]
    with pytest.raises(RuntimeError) as theirs:
        _load_b(pl, path, strict=True)
    with pytest.raises(tc.errors.CheckpointError) as ours:
        _load_b(tc, path, strict=True)
    for error in (theirs.value, ours.value):
        message = str(error)
        assert all(
            key in message for key in ("classifier.weight", "classifier.bias", "head.weight", "head.bias")
        )
    assert "strict=False" in str(ours.value)


def test_a_shape_that_differs_is_an_error_even_with_strict_false(saved_by_a: dict[str, Path]) -> None:
    path = saved_by_a["pytorch_lightning"]
    with pytest.raises(RuntimeError) as theirs:
        _load_b(pl, path, strict=False, hidden=6)
    with pytest.raises(tc.errors.CheckpointError) as ours:
        _load_b(tc, path, strict=False, hidden=6)
    for error in (theirs.value, ours.value):
        assert "encoder.weight" in str(error) and "shape" in str(error).lower()


@pytest.mark.parametrize("map_location", MAP_LOCATIONS.values(), ids=MAP_LOCATIONS.keys())
def test_a_sharded_folder_loads_with_every_map_location(
    map_location: Any, saved_by_a: dict[str, Path], tmp_path: Path
) -> None:
    """The same checkpoint as a DCP folder (which a sharded plugin writes) loads into ``B`` as the file does, for
    each form of ``map_location``: the folder's tensors are read to the CPU and then mapped."""
    from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO

    folder = tmp_path / "sharded.ckpt"
    DistributedCheckpointIO().save_checkpoint(
        TorchCheckpointIO().load_checkpoint(saved_by_a["trainer_core"]), str(folder)
    )
    from_file, _ = _load_b(tc, saved_by_a["trainer_core"], strict=False)
    from_folder, _ = _load_b(tc, folder, map_location=map_location, strict=False)
    _assert_same_weights(from_folder, from_file)
    assert dict(from_folder.hparams) == dict(from_file.hparams) == {"hidden": 5, "classes": 3}
