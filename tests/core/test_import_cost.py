"""What ``import trainer_core`` loads: nothing optional or heavy that only a feature or a run needs.

Every rank of every job and every CLI call pays the import, so the built-in callbacks, the loggers,
the plugins (with fsspec), ``lightning_utilities`` (with ``packaging``) and optional libraries load
where they are first used. Each check runs in a fresh interpreter and compares with what
``import torch`` alone loads there (torch itself loads ``tqdm``, ``unittest.mock`` and, in recent
versions, ``torch.distributed.rpc``). It counts modules, not seconds: ``benchmarks/import_cost.py``
measures the time.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import warm_python
from launch import job_env

ROOT = Path(__file__).resolve().parents[2]
_NOT_BUILT_INS = {"__init__", "base"}
BUILT_IN_CALLBACKS = sorted(
    f"trainer_core.callbacks.{path.stem}"
    for path in (ROOT / "callbacks").glob("*.py")
    if path.stem not in _NOT_BUILT_INS
)
# Modules ``import trainer_core`` must not load (a package stands for its submodules too).
HEAVY = [
    *BUILT_IN_CALLBACKS,
    "trainer_core.loggers.csv_logger",
    "trainer_core.loggers.mlflow",
    "trainer_core.loggers.tensorboard",
    "trainer_core.loggers.wandb",
    "trainer_core.plugins",
    "trainer_core.checkpoint.safetensors",
    "trainer_core.cli",
    "trainer_core.summary",
    "trainer_core.tuner",
    "trainer_core.profilers.pytorch",
    "fsspec",
    "lightning_utilities",
    "packaging",
    "mlflow",
    "wandb",
    "tensorboard",
    "torch.utils.tensorboard",
    "torch.utils.flop_counter",
    "torch.distributed.rpc",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch._dynamo",
    "fairscale",
    "torchmetrics",
    "jsonargparse",
    "rich",
    "tqdm",
    "yaml",
    "pandas",
    "matplotlib",
    "safetensors",
    "onnx",
    "statistics",
]

# Prints the HEAVY modules that ``statement`` loads on top of ``import torch``.
_PROBE = """
import json, sys
import torch
before = set(sys.modules)
exec(compile(sys.argv[1], "<statement>", "exec"))
heavy = json.loads(sys.argv[2])
new = set(sys.modules) - before
print(json.dumps(sorted(m for m in new if any(m == h or m.startswith(h + ".") for h in heavy))))
"""


def _heavy_loaded_by(statement: str) -> list[str]:
    result = subprocess.run(
        [warm_python.REAL_EXECUTABLE, "-c", _PROBE, statement, json.dumps(HEAVY)],
        capture_output=True,
        text=True,
        timeout=180,
        env=job_env(),
        cwd=tempfile.gettempdir(),  # not the checkout: the import goes through the installed package
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "statement",
    ["import trainer_core", "from trainer_core import Trainer, LightningModule, LightningDataModule"],
)
def test_import_loads_nothing_heavy(statement: str) -> None:
    assert _heavy_loaded_by(statement) == []


def test_the_probe_sees_a_heavy_import() -> None:
    """The check above can fail: a logger module and a callback imported with the package are reported."""
    found = _heavy_loaded_by(
        "import trainer_core\n"
        "from trainer_core.callbacks import EarlyStopping\n"
        "from trainer_core.loggers import MLFlowLogger"
    )
    assert {"trainer_core.loggers.mlflow", "trainer_core.callbacks.early_stopping"} <= set(found)


def test_a_default_trainer_loads_only_the_callbacks_it_uses(tmp_path: Path) -> None:
    """``Trainer()`` builds checkpointing, the progress bar and the summary; other callbacks stay unloaded."""
    found = _heavy_loaded_by(
        f"from trainer_core import Trainer\nTrainer(logger=False, default_root_dir={str(tmp_path)!r})"
    )
    assert {m for m in found if m in BUILT_IN_CALLBACKS} == {
        "trainer_core.callbacks.model_checkpoint",
        "trainer_core.callbacks.model_summary",
        "trainer_core.callbacks.progress",
    }
    assert not {m for m in found if m.startswith(("trainer_core.loggers.", "mlflow", "wandb"))}


def test_a_fit_with_the_defaults_off_loads_no_callback_io_or_packaging(tmp_path: Path) -> None:
    """Checkpointing, the bar, the summary and the logger off: a fit loads the plugin it runs under and none of
    the callbacks, the checkpoint IO (fsspec), ``lightning_utilities`` (``packaging``) or the FLOP counter
    (about 25 ms of every such run before, a tenth of the tiny overhead benchmark's)."""
    found = _heavy_loaded_by(
        "import torch\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from trainer_core import LightningModule, Trainer\n"
        "class M(LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = torch.nn.Linear(2, 1)\n"
        "    def training_step(self, batch, batch_idx):\n"
        "        return self.net(batch[0]).sum()\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n"
        f"trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False, "
        f"enable_model_summary=False, max_steps=2, default_root_dir={str(tmp_path)!r})\n"
        "trainer.fit(M(), DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2))\n"
        "assert trainer.global_step == 2\n"
    )
    assert found, "the probe saw no module at all (the plugins at least load)"
    assert not {m for m in found if m in BUILT_IN_CALLBACKS}
    assert not {m for m in found if m.startswith(("fsspec", "lightning_utilities", "packaging", "tqdm"))}
    assert "torch.utils.flop_counter" not in found
    assert not {m for m in found if m.startswith("trainer_core.plugins.io.")}


def test_lazy_packages_give_every_public_name() -> None:
    """``from trainer_core.callbacks import X`` (loggers, plugins, their IO) and ``dir()`` work for every name of
    ``__all__``, as before."""
    import trainer_core.callbacks as callbacks
    import trainer_core.loggers as loggers
    import trainer_core.plugins as plugins
    import trainer_core.plugins.io as plugins_io
    from trainer_core.callbacks.model_checkpoint import ModelCheckpoint

    for package in (callbacks, loggers, plugins, plugins_io):
        assert set(package.__all__) <= set(dir(package))
        for name in package.__all__:
            assert getattr(getattr(package, name), "__name__", name) == name  # a constant has none
        with pytest.raises(AttributeError, match="no attribute 'Nope'"):
            package.Nope  # noqa: B018
    assert callbacks.ModelCheckpoint is ModelCheckpoint
    assert set(callbacks.__all__) == {"Callback", *callbacks._LAZY}
    assert set(loggers.__all__) == {"FolderLogger", "Logger", *loggers._LAZY}
