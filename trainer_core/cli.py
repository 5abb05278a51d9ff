"""``python -m trainer_core fit --config run.yaml``: a whole run described by one file.

The parser is built from signatures, as LightningCLI's is: ``trainer`` takes ``Trainer``'s
arguments, ``model`` and ``data`` take any ``LightningModule`` / ``LightningDataModule`` by import
path (``class_path: package.module.Class`` with ``init_args:``), so the file names the code to run
and every argument it gets::

    python -m trainer_core fit --config run.yaml                      # run it
    python -m trainer_core fit --config run.yaml --trainer.max_epochs 3 --model.init_args.lr 0.01
    python -m trainer_core fit --config run.yaml --print_config > full.yaml   # every value, defaults included

``--print_config`` writes the complete configuration, which runs as a config itself. At the start of
each run the same complete configuration (with the seed actually used) is written to
``config.yaml`` in the run's log folder, so any run can be repeated from its logs.

The subcommands are ``fit``, ``validate``, ``test`` and ``predict``, each with ``--ckpt_path``.
Parsing needs jsonargparse, an optional extra: ``pip install 'trainer-core[cli]'``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Optional, Union

from trainer_core import paths
from trainer_core.datamodule import LightningDataModule
from trainer_core.loggers import Logger
from trainer_core.module import LightningModule
from trainer_core.seed import seed_everything
from trainer_core.trainer import Trainer
from trainer_core.utilities import rank_zero_only

PROG = "python -m trainer_core"
SUBCOMMANDS = {
    "fit": "Train a model (resume with --ckpt_path last).",
    "validate": "Run the validation loop once.",
    "test": "Run the test loop once.",
    "predict": "Run predict_step over the data.",
}
CONFIG_FILE = "config.yaml"
_INSTALL_HINT = "pip install 'trainer-core[cli]'"


def _typed_trainer_arguments() -> dict[str, tuple[Any, str]]:
    """Trainer arguments whose type the parser cannot read from the signature (``Any``), typed here."""
    from trainer_core.plugins import TrainingTypePlugin
    from trainer_core.plugins.io import CheckpointIO

    plugin = Union[str, TrainingTypePlugin, CheckpointIO]
    return {
        "logger": (
            Optional[Union[bool, Logger, list[Logger]]],
            "true (TensorBoard if installed, else CSV), false, or loggers by class_path",
        ),
        "plugins": (
            Optional[Union[plugin, list[plugin]]],
            "a registered plugin name ('ddp', 'fsdp', ...), or plugins and checkpoint IO by class_path",
        ),
        "strategy": (
            Optional[Union[str, TrainingTypePlugin]],
            "another spelling of one training-type plugin",
        ),
    }


def build_parser() -> Any:
    """The jsonargparse parser: one subcommand per entry point, each with the whole run's arguments."""
    return _build_parsers()[0]


def _build_parsers() -> tuple[Any, dict[str, Any]]:
    """The parser and, by subcommand name, the parser of each subcommand."""
    try:
        from jsonargparse import ActionConfigFile, ArgumentParser
    except ImportError as err:
        raise ModuleNotFoundError(f"`{PROG}` needs jsonargparse, an optional extra: {_INSTALL_HINT}") from err

    parser = ArgumentParser(prog=PROG, description="Run trainer-core from a YAML configuration.")
    typed = _typed_trainer_arguments()
    subcommands = parser.add_subcommands(required=True, dest="subcommand")
    sub_parsers = {}
    for name, help_text in SUBCOMMANDS.items():
        sub = ArgumentParser(description=help_text)
        sub.add_argument(
            "-c", "--config", action=ActionConfigFile, help="a YAML file with any of the arguments"
        )
        sub.add_argument(
            "--seed_everything",
            type=Union[bool, int],
            default=True,
            help="a seed; true draws one (written into the saved config), false seeds nothing",
        )
        # Trainer takes these as ``Any``; typed here, a config can name only loggers and plugins
        # in them, and jsonargparse checks the classes before anything runs.
        sub.add_class_arguments(Trainer, "trainer", instantiate=False, skip=set(typed))
        for argument, (type_, argument_help) in typed.items():
            sub.add_argument(f"--trainer.{argument}", type=type_, default=None, help=argument_help)
        sub.add_subclass_arguments(LightningModule, "model", required=True)
        sub.add_subclass_arguments(LightningDataModule, "data", required=False)
        sub.add_argument(
            "--ckpt_path", type=Optional[str], default=None, help='a checkpoint, "last" or "best"'
        )
        subcommands.add_subcommand(name, sub, help=help_text)
        sub_parsers[name] = sub
    return parser, sub_parsers


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse ``argv``, build the objects, run the subcommand; returns the exit status."""
    try:
        parser, sub_parsers = _build_parsers()
    except ModuleNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    config = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    stage = config.subcommand
    sub_config = config[stage]
    sub_parser = sub_parsers[stage]

    seed = sub_config.seed_everything
    if seed is not False:
        # True: draw one (ranks started later inherit it through the environment) and record it.
        sub_config.seed_everything = seed_everything(None if seed is True else int(seed))

    objects = sub_parser.instantiate(sub_config)
    trainer = Trainer(**_as_kwargs(objects.trainer))
    model = objects.model
    datamodule = objects.get("data")
    _save_config(sub_parser, sub_config, trainer)

    ckpt_path = sub_config.ckpt_path
    if stage == "fit":
        trainer.fit(model, datamodule=datamodule, ckpt_path=ckpt_path)
    elif stage == "predict":
        trainer.predict(model, datamodule=datamodule, ckpt_path=ckpt_path, return_predictions=False)
    else:
        getattr(trainer, stage)(model, datamodule=datamodule, ckpt_path=ckpt_path)
    return 0


def _as_kwargs(namespace: Any) -> dict[str, Any]:
    return dict(namespace.items()) if hasattr(namespace, "items") else dict(vars(namespace))


@rank_zero_only
def _save_config(sub_parser: Any, sub_config: Any, trainer: Trainer) -> None:
    """Write the run's complete configuration to ``<log_dir>/config.yaml`` (the run's own record)."""
    text = sub_parser.dump(sub_config, skip_unset=False)
    folder = trainer.log_dir or trainer.default_root_dir
    fs, path = paths.resolve(folder)
    fs.makedirs(path, exist_ok=True)
    with fs.open(f"{path}/{CONFIG_FILE}", "w") as f:
        f.write(text)
