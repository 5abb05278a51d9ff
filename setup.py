"""Package metadata for trainer-core.

Three source folders make one import package: ``trainer_core/`` is ``trainer_core``,
``plugins/`` is ``trainer_core.plugins`` and ``callbacks/`` is ``trainer_core.callbacks``.
"""

from __future__ import annotations

import re
from pathlib import Path

from setuptools import find_packages, setup

_ROOT = Path(__file__).parent
_VERSION = re.search(r'__version__ = "([^"]+)"', (_ROOT / "trainer_core" / "__about__.py").read_text()).group(
    1
)

# torch is deliberately a floor, not a pin: installers pin it first (the Makefile installs
# torch==2.13.0 before the project) so that this range never pulls a different build.
_INSTALL_REQUIRES = [
    "torch>=2.4",
    "lightning-utilities>=0.10",
    "fsspec>=2023.6",
    "tqdm>=4.60",
    "numpy>=1.24",
]

_EXTRAS = {
    "sharded": ["fairscale==0.4.13"],
    # TensorBoardLogger; with it installed, Trainer(logger=True) picks TensorBoard over CSV.
    "tensorboard": ["tensorboard>=2.9"],
    # `python -m trainer_core.plot LOGDIR`: metrics.csv to a PNG.
    "plot": ["matplotlib>=3.5"],
    # `python -m trainer_core fit --config run.yaml`.
    "cli": ["jsonargparse[signatures]>=4.49"],
    # self.log("acc", metric) with a torchmetrics Metric; MLFlowLogger; WandbLogger (offline works without an account).
    "metrics": ["torchmetrics>=1.0"],
    "mlflow": ["mlflow>=2.10"],
    "wandb": ["wandb>=0.17"],
    # LightningModule.to_onnx: torch's exporter needs onnx and onnxscript.
    "onnx": ["onnx>=1.16", "onnxscript>=0.1"],
    # consolidate --to safetensors writes the format itself; load_safetensors maps local files with the library.
    "safetensors": ["safetensors>=0.4"],
    # Trainer(plugins="ddp_ft"): per-step fault tolerance across replica groups (torchft's Manager and lighthouse).
    "ft": ["torchft==0.2.0"],
    "demo": ["scikit-learn>=1.3", "fairscale==0.4.13", "matplotlib>=3.5"],
    "test": [
        "pytest>=8",
        "pytest-timeout>=2.2",
        # `make test` runs the files in two workers.
        "pytest-xdist>=3.5",
        "scikit-learn>=1.3",
        "ruff>=0.5",
        # A real S3 server on loopback for object-store paths, and the client that talks to it.
        "moto[server]>=5",
        "s3fs>=2023.6",
        # StatefulDataLoader, for mid-epoch resume of the loader's own position.
        "torchdata>=0.8",
        "psutil>=5.9",
        "fairscale==0.4.13",
        # FaultTolerantDDPPlugin's replica groups, quorum and lighthouse.
        "torchft==0.2.0",
        # RichProgressBar, an optional progress bar.
        "rich>=13",
        # Property-based round trips of random modules and optimizers (tests/reliability/test_bad_files.py).
        "hypothesis>=6.100",
        # TensorBoardLogger (event files read back with TensorBoard's reader), the plot and the CLI.
        "tensorboard>=2.9",
        "matplotlib>=3.5",
        "jsonargparse[signatures]>=4.49",
        # Lightning's surface: torchmetrics in self.log, a real MLflow tracking server on loopback, W&B offline,
        # ONNX export, and Lightning itself to write the .ckpt files a moving project brings along and to run
        # the same programs side by side.
        "torchmetrics>=1.0",
        "mlflow>=2.10",
        "wandb>=0.17",
        "onnx>=1.16",
        "onnxscript>=0.1",
        "pytorch-lightning==2.6.6",
        "safetensors>=0.4",
    ],
    "bench": [
        "pytorch-lightning==2.6.6",
        "psutil>=5.9",
        "fairscale==0.4.13",
        # consolidate --to safetensors against the library's writer; s3:// throughput against a moto server.
        "safetensors>=0.4",
        "moto[server]>=5",
        "s3fs>=2023.6",
    ],
}


def _packages() -> list[str]:
    """``trainer_core`` and its subpackages, with ``plugins/`` and ``callbacks/`` under their import names."""
    found = []
    for name, folder in (
        ("trainer_core", "trainer_core"),
        ("trainer_core.plugins", "plugins"),
        ("trainer_core.callbacks", "callbacks"),
    ):
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(str(_ROOT / folder))]
    return sorted(set(found))


setup(
    name="trainer-core",
    version=_VERSION,
    description="A Lightning-style trainer whose distributed behaviour lives in training-type plugins.",
    long_description=(_ROOT / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # Every package below the three source folders (a subpackage left out of this list is missing from
    # a wheel even though an editable install finds it).
    packages=_packages(),
    package_dir={
        "trainer_core": "trainer_core",
        "trainer_core.plugins": "plugins",
        "trainer_core.callbacks": "callbacks",
    },
    install_requires=_INSTALL_REQUIRES,
    extras_require=_EXTRAS,
    license="Apache-2.0",
)
