"""``LightningCLI``: a run described by a YAML file and the command line, built from signatures.

Lightning's interface, on one jsonargparse parser: ``trainer`` takes ``Trainer``'s arguments,
``model`` and ``data`` take the given ``LightningModule`` / ``LightningDataModule`` (any subclass by
import path, ``class_path: package.module.Class`` with ``init_args:``, when no class is given), and
``optimizer`` / ``lr_scheduler`` take any torch optimizer and scheduler::

    # main.py
    from trainer_core.cli import LightningCLI
    LightningCLI(MyModel, MyDataModule)

    python main.py fit --config run.yaml --trainer.max_epochs 3 --model.lr 0.01
    python main.py fit --config run.yaml --print_config > full.yaml   # every value, defaults included
    python main.py validate --config full.yaml --ckpt_path last

The package runs the same CLI with both classes open: ``python -m trainer_core fit --config run.yaml``
(the file names the code to run). ``--print_config`` writes the complete configuration, which runs
as a config itself; at the start of each run :class:`SaveConfigCallback` writes that configuration
(with the seed actually used) to ``config.yaml`` in the run's log folder, so any run can be repeated
from its logs. Parsing needs jsonargparse, an optional extra: ``pip install 'trainer-core[cli]'``.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
from collections.abc import Iterable, Sequence
from functools import partial, update_wrapper
from types import MethodType
from typing import Any, Callable, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from trainer_core import paths
from trainer_core.__about__ import __version__
from trainer_core.callbacks import Callback
from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers import Logger
from trainer_core.module import LightningModule
from trainer_core.seed import seed_everything
from trainer_core.trainer import Trainer
from trainer_core.utilities import rank_zero_warn
from trainer_core.utilities.overrides import is_overridden

try:
    from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, class_from_function

    _JSONARGPARSE_AVAILABLE = True
except ImportError:  # an optional extra: the classes below say what to install when used
    ArgumentParser = object  # type: ignore[assignment,misc]
    ActionConfigFile = object  # type: ignore[assignment,misc]
    Namespace = dict  # type: ignore[assignment,misc]
    _JSONARGPARSE_AVAILABLE = False

PROG = "python -m trainer_core"
SUBCOMMANDS = {
    "fit": "Train a model (resume with --ckpt_path last).",
    "validate": "Run the validation loop once.",
    "test": "Run the test loop once.",
    "predict": "Run predict_step over the data.",
}
CONFIG_FILE = "config.yaml"
_INSTALL_HINT = "pip install 'trainer-core[cli]'"


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ``ReduceLROnPlateau`` with the metric it watches (``monitor``), so a config can choose it."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
LRSchedulerType = Union[type[LRScheduler], type[ReduceLROnPlateau]]
ArgsType = Optional[Union[Sequence[str], dict[str, Any], Namespace]]
OptimizerCallable = Callable[[Iterable], Optimizer]
LRSchedulerCallable = Callable[[Optimizer], Union[LRScheduler, ReduceLROnPlateau]]


def _typed_trainer_arguments() -> dict[str, tuple[Any, str]]:
    """Trainer arguments whose type the parser cannot read from the signature (``Any``), typed here."""
    from trainer_core.plugins import ClusterEnvironment, TrainingTypePlugin
    from trainer_core.plugins.io import CheckpointIO
    from trainer_core.precision import Precision

    # What Trainer(plugins=[...]) takes apart (trainer_core.connectors.split_plugins).
    plugin = Union[str, TrainingTypePlugin, CheckpointIO, ClusterEnvironment, Precision]
    return {
        "logger": (
            Optional[Union[bool, Logger, list[Logger]]],
            "true (TensorBoard if installed, else CSV), false, or loggers by class_path",
        ),
        "plugins": (
            Optional[Union[plugin, list[plugin]]],
            "a registered plugin name ('ddp', 'fsdp', ...), or by class_path a plugin, a checkpoint IO, a cluster "
            "environment and a precision",
        ),
        "strategy": (
            Optional[Union[str, TrainingTypePlugin]],
            "another spelling of one training-type plugin",
        ),
    }


class _ConfigFileAction(ActionConfigFile):
    """``--config``: a file that cannot be decoded or parsed is argparse's error naming the file, not a traceback.

    jsonargparse reports YAML errors without the file's name, and lets a file that is not UTF-8
    (``UnicodeDecodeError``) or nested past Python's recursion limit escape as a raw exception.
    """

    def __call__(self, parser: Any, cfg: Any, values: Any, option_string: Optional[str] = None) -> None:
        try:
            super().__call__(parser, cfg, values, option_string)
        except (TypeError, ValueError, RecursionError, OSError) as err:  # UnicodeDecodeError is a ValueError
            raise argparse.ArgumentError(
                self, f"cannot read the config file {values}: {err}; fix the file (YAML or JSON, UTF-8)."
            ) from err


class LightningArgumentParser(ArgumentParser):
    """jsonargparse's ``ArgumentParser`` that also knows trainer-core's classes, optimizers and schedulers.

    ``env_prefix``/``default_env`` as in Lightning: with ``default_env=True`` a value is also read
    from ``PL_TRAINER__MAX_EPOCHS`` and the like, and a whole config from ``PL_CONFIG``.
    """

    def __init__(
        self,
        *args: Any,
        description: str = "trainer-core command line tool",
        env_prefix: str = "PL",
        default_env: bool = False,
        **kwargs: Any,
    ) -> None:
        if not _JSONARGPARSE_AVAILABLE:
            raise ModuleNotFoundError(f"LightningCLI needs jsonargparse, an optional extra: {_INSTALL_HINT}")
        super().__init__(
            *args, description=description, env_prefix=env_prefix, default_env=default_env, **kwargs
        )
        self.callback_keys: list[str] = []
        # Which optimizer and scheduler groups were added, and where each one's arguments go.
        self._optimizers: dict[str, tuple[Union[type, tuple[type, ...]], str]] = {}
        self._lr_schedulers: dict[str, tuple[Union[type, tuple[type, ...]], str]] = {}

    def error(self, message: str, ex: Optional[Exception] = None) -> Any:
        """argparse's error, which also names the config files the values came from when it does not already.

        A wrong value in a config file is reported by its key only ("trainer.max_steps: Expected an
        int"); the file it was read from is what the user opens to fix it.
        """
        files = [name for name in _config_files(getattr(self, "args", None) or []) if name not in message]
        if files:
            message = f"{message}\n(the arguments were read from the config file {', '.join(files)})"
        return super().error(message, ex)

    def add_lightning_class_args(
        self,
        lightning_class: Union[Callable[..., Any], type],
        nested_key: str,
        subclass_mode: bool = False,
        required: bool = True,
    ) -> list[str]:
        """The arguments of a ``Trainer``, ``LightningModule``, ``LightningDataModule`` or ``Callback`` under ``nested_key``.

        ``subclass_mode=True`` takes any subclass by ``class_path``; a callback added here is
        appended to the Trainer's callbacks.
        """
        if callable(lightning_class) and not isinstance(lightning_class, type):
            lightning_class = class_from_function(lightning_class)
        if not (
            isinstance(lightning_class, type)
            and issubclass(lightning_class, (Trainer, LightningModule, LightningDataModule, Callback))
        ):
            raise MisconfigurationException(
                f"add_lightning_class_args({lightning_class!r}, {nested_key!r}): pass a callable or a subclass of "
                "Trainer, LightningModule, LightningDataModule or Callback."
            )
        if issubclass(lightning_class, Callback):
            self.callback_keys.append(nested_key)
        if subclass_mode:
            return self.add_subclass_arguments(
                lightning_class, nested_key, fail_untyped=False, required=required
            )
        if issubclass(lightning_class, Trainer):
            return self._add_trainer_arguments(lightning_class, nested_key)
        return self.add_class_arguments(lightning_class, nested_key, fail_untyped=False, sub_configs=True)

    def _add_trainer_arguments(self, trainer_class: type[Trainer], nested_key: str) -> list[str]:
        # Trainer takes these as ``Any``; typed here, a config can name only loggers and plugins in
        # them, and jsonargparse checks the classes before anything runs.
        parameters = inspect.signature(trainer_class.__init__).parameters
        typed = {name: spec for name, spec in _typed_trainer_arguments().items() if name in parameters}
        added = self.add_class_arguments(
            trainer_class,
            nested_key,
            fail_untyped=False,
            instantiate=False,
            sub_configs=True,
            skip=set(typed),
        )
        for name, (type_, help_text) in typed.items():
            default = parameters[name].default
            self.add_argument(
                f"--{nested_key}.{name}",
                type=type_,
                default=None if default is inspect.Parameter.empty else default,
                help=help_text,
            )
            added.append(f"{nested_key}.{name}")
        return added

    def add_optimizer_args(
        self,
        optimizer_class: Union[type[Optimizer], tuple[type[Optimizer], ...]] = (Optimizer,),
        nested_key: str = "optimizer",
        link_to: str = "AUTOMATIC",
    ) -> None:
        """An optimizer's arguments (all but ``params``) under ``nested_key``; a tuple of classes takes any subclass.

        ``link_to="AUTOMATIC"``: the CLI builds ``configure_optimizers`` from it; otherwise the
        arguments go to that key (``"model.optimizer"``) and the module builds it.
        """
        classes = optimizer_class if isinstance(optimizer_class, tuple) else (optimizer_class,)
        if not all(isinstance(c, type) and issubclass(c, Optimizer) for c in classes):
            raise MisconfigurationException(
                f"add_optimizer_args({optimizer_class!r}): pass torch.optim.Optimizer subclasses."
            )
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"params"}}
        if isinstance(optimizer_class, tuple):
            self.add_subclass_arguments(optimizer_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(optimizer_class, nested_key, sub_configs=True, **kwargs)
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self,
        lr_scheduler_class: Union[LRSchedulerType, tuple[LRSchedulerType, ...]] = LRSchedulerTypeTuple,
        nested_key: str = "lr_scheduler",
        link_to: str = "AUTOMATIC",
    ) -> None:
        """A scheduler's arguments (all but ``optimizer``) under ``nested_key``, as :meth:`add_optimizer_args`."""
        classes = lr_scheduler_class if isinstance(lr_scheduler_class, tuple) else (lr_scheduler_class,)
        if not all(isinstance(c, type) and issubclass(c, LRSchedulerTypeTuple) for c in classes):
            raise MisconfigurationException(
                f"add_lr_scheduler_args({lr_scheduler_class!r}): pass LRScheduler or ReduceLROnPlateau subclasses."
            )
        kwargs: dict[str, Any] = {"instantiate": False, "fail_untyped": False, "skip": {"optimizer"}}
        if isinstance(lr_scheduler_class, tuple):
            self.add_subclass_arguments(lr_scheduler_class, nested_key, **kwargs)
        else:
            self.add_class_arguments(lr_scheduler_class, nested_key, sub_configs=True, **kwargs)
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)


class SaveConfigCallback(Callback):
    """Writes the run's complete configuration to ``<log_dir>/config.yaml`` when the run sets up (rank 0).

    An existing file is an error unless ``overwrite=True``, so a run never silently replaces the
    record of another. Override :meth:`save_config` to also store it elsewhere (a logger);
    ``save_to_log_dir=False`` then skips the file. The folder may be any fsspec URL.
    """

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Namespace,
        config_filename: str = CONFIG_FILE,
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser = parser
        self.config = config
        self.config_filename = config_filename
        self.overwrite = overwrite
        self.multifile = multifile
        self.save_to_log_dir = save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and not is_overridden("save_config", self, SaveConfigCallback):
            raise ValueError(
                "SaveConfigCallback(save_to_log_dir=False) saves nothing: subclass it and implement `save_config` "
                "to store the configuration elsewhere."
            )

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.already_saved:
            return
        plugin = trainer.plugin
        if self.save_to_log_dir:
            folder = trainer.log_dir or trainer.default_root_dir
            fs, path = paths.resolve(folder)
            config_path = f"{path.rstrip('/')}/{self.config_filename}"
            exists = fs.isfile(config_path) if trainer.is_global_zero and not self.overwrite else False
            if plugin.broadcast(exists):
                raise RuntimeError(
                    f"{type(self).__name__}: {config_path} exists already (the record of an earlier run); delete it, "
                    "pass LightningCLI(save_config_kwargs={'overwrite': True}), or LightningCLI(save_config_callback=None)."
                )
            if trainer.is_global_zero:
                fs.makedirs(path, exist_ok=True)
                if self.multifile:
                    self.parser.save(
                        self.config, config_path, skip_unset=False, overwrite=self.overwrite, multifile=True
                    )
                else:
                    with fs.open(config_path, "w") as f:
                        f.write(self.parser.dump(self.config, skip_unset=False))
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = plugin.broadcast(self.already_saved)

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Store the configuration somewhere else too (called on rank 0 only: no collectives here)."""


class LightningCLI:
    """Parse a configuration (``args`` or ``sys.argv``), build the model, data and Trainer from it, and run.

    As Lightning's: ``model_class``/``datamodule_class`` are classes or functions returning one;
    ``None`` (or ``subclass_mode_*=True``) takes any subclass by ``class_path``. ``run=False``
    builds without subcommands and runs nothing (``cli.trainer.fit(cli.model)`` is then yours).
    The parsed configuration is ``cli.config``; the objects are ``cli.model``, ``cli.datamodule``
    and ``cli.trainer``. ``trainer_defaults`` override the Trainer's defaults (its ``callbacks``
    are always added). With ``auto_configure_optimizers`` the config may name an ``optimizer``
    and an ``lr_scheduler``, which then replace the module's ``configure_optimizers``.
    ``load_from_checkpoint_support`` is accepted for Lightning's signature and changes nothing:
    hyper-parameters are saved as the module's ``save_hyperparameters`` stores them.
    """

    def __init__(
        self,
        model_class: Optional[Union[type[LightningModule], Callable[..., LightningModule]]] = None,
        datamodule_class: Optional[
            Union[type[LightningDataModule], Callable[..., LightningDataModule]]
        ] = None,
        save_config_callback: Optional[type[SaveConfigCallback]] = SaveConfigCallback,
        save_config_kwargs: Optional[dict[str, Any]] = None,
        trainer_class: Union[type[Trainer], Callable[..., Trainer]] = Trainer,
        trainer_defaults: Optional[dict[str, Any]] = None,
        seed_everything_default: Union[bool, int] = True,
        parser_kwargs: Optional[Union[dict[str, Any], dict[str, dict[str, Any]]]] = None,
        parser_class: type[LightningArgumentParser] = LightningArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class = trainer_class
        self.trainer_defaults = trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs = parser_kwargs or {}
        self.parser_class = parser_class
        self.auto_configure_optimizers = auto_configure_optimizers

        self.model_class = model_class
        self._model_class = model_class or LightningModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.datamodule_class = datamodule_class
        self._datamodule_class = datamodule_class or LightningDataModule
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        main_kwargs, subparser_kwargs = self._setup_parser_kwargs(self.parser_kwargs)
        self.setup_parser(run, main_kwargs, subparser_kwargs)
        self.parse_arguments(self.parser, args)
        self._check_class_groups(run)
        self._parse_ckpt_path()
        self.subcommand: Optional[str] = self.config["subcommand"] if run else None
        self._set_seed()

        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ parser
    def _setup_parser_kwargs(self, parser_kwargs: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        names = self.subcommands().keys()
        main_kwargs = {k: v for k, v in parser_kwargs.items() if k not in names}
        subparser_kwargs = {k: v for k, v in parser_kwargs.items() if k in names}
        return main_kwargs, subparser_kwargs

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """A parser with ``--config`` (and, from jsonargparse, ``--print_config``)."""
        kwargs.setdefault("dump_header", [f"trainer_core=={__version__}"])
        parser = self.parser_class(**kwargs)
        parser.add_argument(
            "-c", "--config", action=_ConfigFileAction, help="a YAML (or JSON) file with any of the arguments"
        )
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        """The parser: one subcommand per entry point, or (``run=False``) the arguments directly."""
        self.parser = self.init_parser(**main_kwargs)
        if add_subcommands:
            self._subcommand_method_arguments: dict[str, list[str]] = {}
            self._add_subcommands(self.parser, **subparser_kwargs)
        else:
            self._add_arguments(self.parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--seed_everything",
            type=Union[bool, int],
            default=self.seed_everything_default,
            help="a seed; true draws one (written into the saved config), false seeds nothing",
        )

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """``trainer``, ``model`` and ``data``."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        parser.set_defaults(defaults)
        parser.add_lightning_class_args(self._model_class, "model", subclass_mode=self.subclass_mode_model)
        # Not required without a class: the module may have its own dataloaders.
        parser.add_lightning_class_args(
            self._datamodule_class,
            "data",
            subclass_mode=self.subclass_mode_data,
            required=self.datamodule_class is not None,
        )

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:  # unless add_arguments_to_parser added its own
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments (``parser.add_lightning_class_args(EarlyStopping, "early_stopping")``) or links."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands, each with the Trainer method arguments the CLI fills itself (not from the config)."""
        return {
            "fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
            "validate": {"model", "dataloaders", "datamodule"},
            "test": {"model", "dataloaders", "datamodule"},
            "predict": {"model", "dataloaders", "datamodule"},
        }

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        parser_subcommands = parser.add_subcommands(required=True, dest="subcommand")
        trainer_class = (
            self.trainer_class
            if isinstance(self.trainer_class, type)
            else class_from_function(self.trainer_class)
        )
        for subcommand in self.subcommands():
            description = SUBCOMMANDS.get(subcommand) or _first_line(getattr(trainer_class, subcommand))
            subparser_kwargs = dict(kwargs.get(subcommand, {}))
            subparser_kwargs.setdefault("description", description)
            sub = self.init_parser(**subparser_kwargs)
            self._add_arguments(sub)
            # The method's own arguments: --ckpt_path, and --verbose / --return_predictions.
            skip: set[Union[str, int]] = set(self.subcommands()[subcommand])
            self._subcommand_method_arguments[subcommand] = sub.add_method_arguments(
                trainer_class, subcommand, skip=skip
            )
            self._subcommand_parsers[subcommand] = sub
            parser_subcommands.add_subcommand(subcommand, sub, help=description)

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: LightningArgumentParser) -> None:
        """Send the optimizer and scheduler groups added with a ``link_to`` key to that key."""
        for key, (class_type, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to == "AUTOMATIC":
                continue
            if isinstance(class_type, tuple):
                parser.link_arguments(key, link_to)
            else:
                parser.link_arguments(key, link_to, compute_fn=partial(_with_class_path, class_type))

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parse ``args`` (a command line as a list, or a dict / Namespace of values) into ``self.config``."""
        if args is not None and len(sys.argv) > 1:
            rank_zero_warn(
                f"LightningCLI(args={args!r}) parses `args`, and this process also has command-line arguments "
                f"{sys.argv[1:]}, which are ignored; pass one or the other."
            )
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(None if args is None else list(args))

    def _check_class_groups(self, run: bool) -> None:
        """A class's group (``trainer:``, ``model:``, ``data:``) set to a non-mapping is the config's error.

        jsonargparse accepts ``model: null`` (or ``5``) for a group of arguments and fails only when it
        builds the class (``TypeError: argument after ** must be a mapping``); say so while parsing.
        """
        subcommand = self.config.get("subcommand") if run else None
        config = self.config[subcommand] if subcommand else self.config
        groups = {"trainer": False, "model": self.subclass_mode_model, "data": self.subclass_mode_data}
        for key, subclass_mode in groups.items():
            value = config.get(key) if key in config else Namespace()
            # Subclass mode takes `null` (no data module); a class's own group takes only its arguments.
            if isinstance(value, Namespace) or (subclass_mode and value is None):
                continue
            self._parser(subcommand).error(
                f'Parser key "{key}": expected a mapping of arguments, got {type(value).__name__} {value!r}; '
                f"write `{key}:` followed by indented `name: value` lines, or leave it out."
            )

    def _parse_ckpt_path(self) -> None:
        """With ``--ckpt_path``, the module is built with the hyper-parameters its checkpoint saved (Lightning's rule)."""
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        ckpt_path = self.config[subcommand].get("ckpt_path")
        if not ckpt_path or not os.path.isfile(os.fspath(ckpt_path)):
            return  # "last", "best", or a remote file: the Trainer resolves it; the config stands
        from trainer_core.checkpoint.format import KEY_HPARAMS, KEY_HPARAMS_NAME
        from trainer_core.plugins.io import TorchCheckpointIO

        checkpoint = TorchCheckpointIO().load_checkpoint(os.fspath(ckpt_path), map_location="cpu")
        hparams = dict(checkpoint.get(KEY_HPARAMS) or {})
        hparams.pop("_instantiator", None)  # what Lightning's own CLI adds to the hyper-parameters
        if not hparams or checkpoint.get(KEY_HPARAMS_NAME) not in (None, "kwargs"):
            return  # nothing saved, or one dict argument the parser cannot spread over the signature
        model = self.config[subcommand].get("model")
        if "_class_path" in hparams:
            hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
        elif self.subclass_mode_model and model is not None and model.get("class_path"):
            hparams = {"class_path": model["class_path"], "init_args": hparams}
        try:
            self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
        except SystemExit:
            sys.stderr.write(f"The hyper-parameters saved in {ckpt_path} do not fit the model's arguments.\n")
            raise

    # ------------------------------------------------------------------ objects
    def before_instantiate_classes(self) -> None:
        """Override to run code before the classes are built."""

    def instantiate_classes(self) -> None:
        """Build the model, the data module and the Trainer from ``self.config``."""
        parser = self._parser(self.subcommand)
        try:
            self.config_init = parser.instantiate(self._subconfig(self.config))
        except (TypeError, ValueError, OverflowError, RuntimeError) as err:
            # A value of the config that a class refuses (`hidden: 1e30` reaching nn.Linear): argparse's error,
            # naming the file. Other exceptions are bugs in the class and keep their traceback.
            cause = (str(err).strip().splitlines() or [""])[0]
            parser.error(f"building the classes of the config failed: {type(err).__name__}: {cause}", err)
        self.datamodule = self.config_init.get("data")
        self.model = self.config_init.get("model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def after_instantiate_classes(self) -> None:
        """Override to run code after the classes are built."""

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The Trainer from the config's ``trainer`` arguments; ``kwargs`` override them."""
        parser = self._parser(self.subcommand)
        extra_callbacks = [self.config_init.get(key) for key in parser.callback_keys]
        trainer_config = {**_as_dict(self.config_init.get("trainer", {})), **kwargs}
        return self._instantiate_trainer(trainer_config, extra_callbacks)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        key = "callbacks"
        current = config.get(key)
        config[key] = [] if current is None else list(current) if isinstance(current, list) else [current]
        config[key].extend(callbacks)
        if key in self.trainer_defaults:
            value = self.trainer_defaults[key]
            config[key] += value if isinstance(value, list) else [value]
        if self.save_config_callback is not None and not config.get("fast_dev_run", False):
            config[key].append(
                self.save_config_callback(
                    self._parser(self.subcommand), self._subconfig(self.config), **self.save_config_kwargs
                )
            )
        try:
            return self.trainer_class(**config)
        except MisconfigurationException as err:
            # A value the config gave (`max_steps:` left empty is null): argparse's error, naming the file too.
            self.parser.error(str(err), err)

    def _parser(self, subcommand: Optional[str]) -> LightningArgumentParser:
        return self.parser if subcommand is None else self._subcommand_parsers[subcommand]

    def _subconfig(self, config: Namespace) -> Namespace:
        return config[self.subcommand] if self.subcommand is not None else config

    # ------------------------------------------------------------------ optimizers from the config
    @staticmethod
    def configure_optimizers(
        lightning_module: LightningModule,
        optimizer: Optimizer,
        lr_scheduler: Optional[LRSchedulerTypeUnion] = None,
    ) -> Any:
        """What the module's ``configure_optimizers`` returns when the config names the optimizer (override to change)."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor},
            }
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """Replace the module's ``configure_optimizers`` when the config names an (AUTOMATIC) optimizer."""
        if not self.auto_configure_optimizers or self.model is None:
            return
        parser = self._parser(subcommand)
        optimizers = _automatic(Optimizer, parser._optimizers)
        lr_schedulers = _automatic(LRSchedulerTypeTuple, parser._lr_schedulers)
        if not optimizers:
            return
        if len(optimizers) > 1 or len(lr_schedulers) > 1:
            raise MisconfigurationException(
                f"{type(self).__name__} can build at most one optimizer and one lr_scheduler itself ('AUTOMATIC'), "
                f"found {optimizers + lr_schedulers}; link the groups to the model with `link_to=` and build them in "
                "configure_optimizers."
            )
        optimizer_class = parser._optimizers[optimizers[0]][0]
        optimizer_init = self.config_init.get(optimizers[0])
        if not isinstance(optimizer_class, tuple):
            optimizer_init = _with_class_path(optimizer_class, optimizer_init)
        if not optimizer_init:
            return  # the config names no optimizer: the module's configure_optimizers stands
        lr_scheduler_init = None
        if lr_schedulers:
            lr_scheduler_class = parser._lr_schedulers[lr_schedulers[0]][0]
            lr_scheduler_init = self.config_init.get(lr_schedulers[0])
            if not isinstance(lr_scheduler_class, tuple):
                lr_scheduler_init = _with_class_path(lr_scheduler_class, lr_scheduler_init)
        if is_overridden("configure_optimizers", self.model, LightningModule):
            rank_zero_warn(
                f"{type(self.model).__name__}.configure_optimizers is replaced by {type(self).__name__}.configure_optimizers "
                "because the config names an optimizer."
            )
        optimizer = instantiate_class(self.model.parameters(), optimizer_init)
        lr_scheduler = instantiate_class(optimizer, lr_scheduler_init) if lr_scheduler_init else None
        fn = partial(self.configure_optimizers, optimizer=optimizer, lr_scheduler=lr_scheduler)
        update_wrapper(fn, self.configure_optimizers)
        self.model.configure_optimizers = MethodType(fn, self.model)  # type: ignore[method-assign]

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        """``before_<subcommand>``, the Trainer's method (or this class's of that name), ``after_<subcommand>``."""
        before = getattr(self, f"before_{subcommand}", None)
        if callable(before):
            before()
        fn = getattr(self, subcommand, getattr(self.trainer, subcommand))
        fn(**self._prepare_subcommand_kwargs(subcommand))
        after = getattr(self, f"after_{subcommand}", None)
        if callable(after):
            after()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = {
            k: v for k, v in self.config_init.items() if k in self._subcommand_method_arguments[subcommand]
        }
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        return kwargs

    def _set_seed(self) -> None:
        """Seed as ``seed_everything`` says, and write the seed used into the config (so the record repeats the run)."""
        config = self._subconfig(self.config)
        seed = config.get("seed_everything")
        if seed is False:
            return
        # `null` draws a seed, as `true` does (Lightning's rule); it must not reach int().
        try:
            config["seed_everything"] = seed_everything(
                None if seed is True or seed is None else int(seed), workers=True
            )
        except ValueError as err:  # a seed outside [0, 2**32 - 1]: argparse's error, naming the file
            self._parser(self.subcommand).error(f"seed_everything: {err}", err)


def instantiate_class(args: Union[Any, tuple[Any, ...]], init: dict[str, Any]) -> Any:
    """``init["class_path"]`` built with ``args`` (positional) and ``init["init_args"]``: Lightning's helper."""
    kwargs = init.get("init_args", {})
    if not isinstance(args, tuple):
        args = (args,)
    module_name, class_name = init["class_path"].rsplit(".", 1)
    module = __import__(module_name, fromlist=[class_name])
    return getattr(module, class_name)(*args, **kwargs)


def _with_class_path(
    class_type: type, init_args: Optional[Union[Namespace, dict[str, Any]]] = None
) -> dict[str, Any]:
    if _JSONARGPARSE_AVAILABLE and isinstance(init_args, Namespace):
        init_args = init_args.as_dict()
    return {"class_path": f"{class_type.__module__}.{class_type.__name__}", "init_args": init_args or {}}


def _automatic(class_type: Any, register: dict[str, tuple[Union[type, tuple[type, ...]], str]]) -> list[str]:
    """The keys of ``register`` whose classes are ``class_type`` and that the CLI builds itself."""
    found = []
    for key, (base, link_to) in register.items():
        bases = base if isinstance(base, tuple) else (base,)
        if link_to == "AUTOMATIC" and any(issubclass(c, class_type) for c in bases):
            found.append(key)
    return found


def _config_files(args: Sequence[str]) -> list[str]:
    """The files ``--config``/``-c`` names in the command line ``args`` (``--config x``, ``--config=x``, ``-c x``)."""
    files = []
    for i, arg in enumerate(args):
        if arg in ("--config", "-c") and i + 1 < len(args):
            files.append(args[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _first_line(fn: Any) -> Optional[str]:
    doc = inspect.getdoc(fn)
    return doc.splitlines()[0] if doc else None


def _as_dict(namespace: Any) -> dict[str, Any]:
    """The top level of a jsonargparse ``Namespace`` (its own ``keys()`` flattens nested groups to dotted names)."""
    if isinstance(namespace, dict):
        return dict(namespace)
    return {
        key: value.as_dict() if isinstance(value, Namespace) else value
        for key, value in vars(namespace).items()
    }


class _PackageCLI(LightningCLI):
    """``python -m trainer_core``: ``main(argv)`` is given its command line on purpose, so ``sys.argv`` is not a mistake."""

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        self.config = parser.parse_args(None if args is None else list(args))  # type: ignore[arg-type]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m trainer_core``: the CLI with the model and data module named by ``class_path``; returns the exit status."""
    try:
        _PackageCLI(
            args=None if argv is None else list(argv),
            parser_kwargs={"prog": PROG, "description": "Run trainer-core from a YAML configuration."},
        )
    except ModuleNotFoundError as err:
        if _JSONARGPARSE_AVAILABLE:
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
