"""``LightningModule`` extras: ``example_input_array``, ``strict_loading``, ``toggled_optimizer``, export, hparams.

Exports are checked by running what was exported (TorchScript here, ONNX through onnx's reference
evaluator) and comparing its outputs with the module's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import fast_trainer, random_data, random_loader
from torch import nn
from torch.utils.data import DataLoader

from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException
from trainer_core.module import ONNX_INSTALL_HINT, LightningModule


class Net(LightningModule):
    """Two inputs, so the tuple form of ``example_input_array`` is exercised."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(2, 3)
        self.example_input_array = (torch.randn(5, 4), torch.randn(5, 2))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.a(x)) + self.b(z)


# ---------------------------------------------------------------------------------------------- example input
def test_example_input_array_is_a_settable_property() -> None:
    class Bare(LightningModule):
        pass

    bare = Bare()
    assert bare.example_input_array is None
    sample = torch.zeros(2, 3)
    bare.example_input_array = sample
    assert bare.example_input_array is sample
    assert "example_input_array" not in dict(bare.named_buffers())  # an attribute, not part of the weights


# ---------------------------------------------------------------------------------------------- strict_loading
class Frozen(LightningModule):
    """Lightning's documented case: a frozen encoder left out of the checkpoint by ``state_dict``."""

    def __init__(self, strict_loading: bool = False) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 4).requires_grad_(False)
        self.head = nn.Linear(4, 1)
        self.strict_loading = strict_loading

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return {k: v for k, v in super().state_dict(*args, **kwargs).items() if not k.startswith("encoder")}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.head(self.encoder(x)), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.head.parameters(), lr=0.01)


def test_strict_loading_false_resumes_and_loads_a_partial_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(0)
    first = Frozen()
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(first, random_loader(8, 4, batch_size=2))
    path = tmp_path / "partial.ckpt"
    trainer.save_checkpoint(path)
    assert not any(k.startswith("encoder") for k in torch.load(path, weights_only=True)["state_dict"])

    # Resume: the encoder keeps its own weights, the head and the optimizer continue from the file.
    torch.manual_seed(1)
    resumed = Frozen()
    encoder_before = resumed.encoder.weight.clone()
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(resumed, random_loader(8, 4, batch_size=2), ckpt_path=path)
    assert trainer.global_step == 4  # nothing left to do in epoch 0: only the saved steps
    torch.testing.assert_close(resumed.head.weight, first.head.weight, rtol=0, atol=0)
    torch.testing.assert_close(resumed.encoder.weight, encoder_before, rtol=0, atol=0)

    loaded = Frozen.load_from_checkpoint(path, weights_only=True)  # Lightning's keyword, accepted
    torch.testing.assert_close(loaded.head.weight, first.head.weight, rtol=0, atol=0)
    with pytest.raises(MisconfigurationException, match="strict_loading"):
        Frozen.load_from_checkpoint(path, strict=True)


def test_strict_loading_true_refuses_the_partial_checkpoint(tmp_path: Path) -> None:
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(Frozen(), random_loader(4, 4, batch_size=2))
    trainer.save_checkpoint(tmp_path / "partial.ckpt")
    with pytest.raises(RuntimeError, match="encoder"):
        fast_trainer(max_epochs=2).fit(
            Frozen(strict_loading=True),
            random_loader(4, 4, batch_size=2),
            ckpt_path=tmp_path / "partial.ckpt",
        )
    with pytest.raises(RuntimeError, match="encoder"):
        Frozen.load_from_checkpoint(tmp_path / "partial.ckpt", strict_loading=True)
    assert Frozen(strict_loading=True).strict_loading and Net().strict_loading  # the default


# ---------------------------------------------------------------------------------------------- toggled_optimizer
def _alternating(base: type) -> type:
    class Alternating(base):
        """Manual optimization of two parts in turn, each inside ``toggled_optimizer`` (a GAN's shape)."""

        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.g = nn.Linear(4, 4)
            self.d = nn.Linear(4, 1)
            self.frozen_inside: list[bool] = []

        def training_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            opt_g, opt_d = self.optimizers()
            with self.toggled_optimizer(opt_d):
                self.frozen_inside.append(not any(p.requires_grad for p in self.g.parameters()))
                loss_d = nn.functional.mse_loss(self.d(self.g(x)), y)
                opt_d.zero_grad()
                self.manual_backward(loss_d)
                opt_d.step()
            with self.toggled_optimizer(opt_g):
                loss_g = self.d(self.g(x)).pow(2).mean()
                opt_g.zero_grad()
                self.manual_backward(loss_g)
                opt_g.step()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.g.parameters(), lr=0.1), torch.optim.SGD(self.d.parameters(), lr=0.1)

    return Alternating


def test_toggled_optimizer_trains_as_in_lightning() -> None:
    pl = pytest.importorskip("pytorch_lightning")
    models = []
    for base in (LightningModule, pl.LightningModule):
        torch.manual_seed(0)
        model = _alternating(base)()
        if base is LightningModule:
            trainer = fast_trainer(max_epochs=1)
        else:
            trainer = pl.Trainer(
                accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
        trainer.fit(model, random_loader(8, 4, batch_size=2))
        models.append(model)
    ours, theirs = models
    assert ours.frozen_inside == [True] * 4
    assert all(p.requires_grad for p in ours.parameters())  # untoggled after each block
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_toggled_optimizer_untoggles_when_the_block_raises() -> None:
    model = _alternating(LightningModule)()
    optimizer = torch.optim.SGD(model.d.parameters(), lr=0.1)
    with pytest.raises(ValueError), model.toggled_optimizer(optimizer):
        assert not model.g.weight.requires_grad
        raise ValueError("inside")
    assert model.g.weight.requires_grad and model.d.weight.requires_grad


# ---------------------------------------------------------------------------------------------- TorchScript
@pytest.mark.parametrize("method", ["script", "trace"])
def test_to_torchscript_runs_like_the_module(tmp_path: Path, method: str) -> None:
    torch.manual_seed(0)
    model = Net().train()
    path = tmp_path / f"{method}.pt"
    scripted = model.to_torchscript(file_path=path, method=method)
    assert model.training  # the module's mode is left as it was
    x, z = torch.randn(7, 4), torch.randn(7, 2)
    expected = model(x, z)
    torch.testing.assert_close(scripted(x, z), expected)
    torch.testing.assert_close(torch.jit.load(path)(x, z), expected)


def test_to_torchscript_errors_name_what_to_pass() -> None:
    class NoExample(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)

    with pytest.raises(ValueError, match="example_input_array"):
        NoExample().to_torchscript(method="trace")
    with pytest.raises(ValueError, match="'script' or 'trace'"):
        NoExample().to_torchscript(method="compile")
    traced = NoExample().to_torchscript(method="trace", example_inputs=torch.ones(1, 2))
    assert traced(torch.ones(3, 2)).shape == (3, 2)


def test_export_inputs_go_through_the_data_modules_transfer_hooks() -> None:
    """As in Lightning: attached to a Trainer, the data module's hooks prepare the example input too."""

    class Doubling(LightningDataModule):
        def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
            return tuple(t * 2 for t in batch)

        def train_dataloader(self) -> DataLoader:
            return DataLoader(random_data(2, 4), batch_size=2)

    model = Net()
    sample = model.example_input_array
    trainer = fast_trainer(max_steps=0)
    trainer.datamodule = Doubling()
    model.trainer = trainer
    traced = model.to_torchscript(method="trace")
    # Traced on the doubled sample: the graph is the same, so outputs match the module on any input.
    torch.testing.assert_close(traced(*sample), model(*sample))
    assert model._on_before_batch_transfer(sample)[0].sum() == (sample[0] * 2).sum()


# ---------------------------------------------------------------------------------------------- ONNX
def test_to_onnx_exports_a_graph_that_computes_the_same(tmp_path: Path) -> None:
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    from onnx.reference import ReferenceEvaluator

    torch.manual_seed(0)
    model = Net()
    path = tmp_path / "net.onnx"
    model.to_onnx(path)  # input: example_input_array
    graph = onnx.load(path)
    onnx.checker.check_model(graph)
    dims = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in graph.graph.input]
    assert dims == [[5, 4], [5, 2]]
    x, z = model.example_input_array
    (out,) = ReferenceEvaluator(graph).run(
        None, {graph.graph.input[0].name: x.numpy(), graph.graph.input[1].name: z.numpy()}
    )
    torch.testing.assert_close(torch.from_numpy(out), model(x, z).detach(), rtol=1e-5, atol=1e-6)


def test_to_onnx_passes_the_given_sample_and_keywords_and_restores_the_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    seen: dict[str, Any] = {}

    def fake_export(model: Any, sample: Any, path: Any, **kwargs: Any) -> str:
        seen.update(training=model.training, sample=sample, path=path, kwargs=kwargs)
        return "exported"

    monkeypatch.setattr(torch.onnx, "export", fake_export)
    model = Net().train()
    other = (torch.randn(2, 4), torch.randn(2, 2))
    assert model.to_onnx(Path("x.onnx"), input_sample=other, opset_version=18) == "exported"
    assert seen["training"] is False and model.training  # exported in eval mode, the mode restored after
    assert all(torch.equal(a, b) for a, b in zip(seen["sample"], other))
    assert seen["path"] == "x.onnx" and seen["kwargs"] == {"opset_version": 18}


def test_to_onnx_without_an_input_or_the_exporter_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    model = Net()
    model.example_input_array = None
    with pytest.raises(ValueError, match="input_sample"):
        model.to_onnx("never.onnx")

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # what an environment without it imports
    with pytest.raises(ModuleNotFoundError, match=ONNX_INSTALL_HINT) as info:
        Net().to_onnx("never.onnx")
    assert "onnxscript" in str(info.value)


# ---------------------------------------------------------------------------------------------- hyper-parameters
def test_one_dict_of_hyperparameters_loads_back_under_its_argument(tmp_path: Path) -> None:
    class Configured(LightningModule):
        def __init__(self, hparams: dict) -> None:
            super().__init__()
            self.save_hyperparameters(hparams)
            self.layer = nn.Linear(hparams["features"], 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    model = Configured({"features": 4, "lr": 0.1})
    trainer = fast_trainer(max_epochs=1)
    trainer.fit(model, random_loader(4, 4, batch_size=2))
    trainer.save_checkpoint(tmp_path / "dict.ckpt")
    loaded = Configured.load_from_checkpoint(tmp_path / "dict.ckpt")
    assert dict(loaded.hparams) == {"features": 4, "lr": 0.1}
    torch.testing.assert_close(loaded.layer.weight, model.layer.weight, rtol=0, atol=0)
    assert Configured.load_from_checkpoint(tmp_path / "dict.ckpt", lr=0.5).hparams.lr == 0.5


def test_hparams_initial_is_a_deep_copy() -> None:
    class Listed(LightningModule):
        def __init__(self, sizes: list) -> None:
            super().__init__()
            self.save_hyperparameters()

    model = Listed([1, 2])
    model.hparams.sizes.append(3)
    assert model.hparams.sizes == [1, 2, 3] and model.hparams_initial.sizes == [1, 2]
