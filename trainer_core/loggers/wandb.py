"""``WandbLogger``: Weights & Biases runs, online or offline (extra ``wandb``).

Lightning's arguments and semantics: the run is made by ``wandb.init`` on first use on global rank
0 (other ranks get an experiment that ignores every call and never import wandb); hyper-parameters
go to the run's config, metrics to its history with ``trainer/global_step`` as their x-axis; with
``log_model`` the checkpoints of ``ModelCheckpoint`` become ``model`` artifacts (``"all"``: as
they are written; ``True``: at the end of a successful run, or as written when
``save_top_k=-1``). ``offline=True`` writes the run under ``<save_dir>/wandb/offline-run-*`` for a
later ``wandb sync``, and needs no account.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from lightning_utilities.core.imports import RequirementCache
from torch import nn

from trainer_core import paths
from trainer_core.errors import MisconfigurationException
from trainer_core.loggers.base import Logger, as_dict, new_checkpoints, rank_zero_experiment
from trainer_core.utilities import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from wandb import Artifact
    from wandb.sdk.wandb_run import Run

_WANDB = RequirementCache("wandb>=0.17", "wandb")
#: ModelCheckpoint's settings kept in each model artifact's metadata.
_CHECKPOINT_SETTINGS = (
    "monitor",
    "mode",
    "save_last",
    "save_top_k",
    "save_weights_only",
    "_every_n_train_steps",
)


def wandb_missing_error() -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"WandbLogger needs the `wandb` package ({_WANDB.message}); `pip install trainer-core[wandb]` "
        "(or `pip install wandb`), or use CSVLogger."
    )


class WandbLogger(Logger):
    """Log to Weights & Biases on global rank 0.

    Args:
        name: the run's display name.
        save_dir: the folder wandb writes its ``wandb/`` run folders into (``dir`` when None).
        version: the run id to use or resume (``id`` is the same; ``version`` wins).
        offline: write the run locally for a later ``wandb sync`` (no account, no network).
        dir: the same as ``save_dir`` (wandb's own name for it).
        id: the run id (see ``version``).
        anonymous: let the run be logged without an account (wandb's ``anonymous="allow"``).
        project: the project; ``$WANDB_PROJECT`` or ``lightning_logs`` when None.
        log_model: ``"all"``, ``True`` or ``False``: which ``ModelCheckpoint`` files become artifacts.
        experiment: a run made beforehand (``wandb.init(...)``) to log into.
        prefix: put before every metric name, joined with ``-`` (Lightning's rule).
        checkpoint_name: the name of the model artifact (``model-<run id>`` when None).
        add_file_policy: ``"mutable"`` (wandb copies the checkpoint) or ``"immutable"``.
        **kwargs: further ``wandb.init`` arguments (``group``, ``tags``, ``config``, ``mode``, ...).

    ``name`` is the project and ``version`` the run id, as in Lightning, so ``ModelCheckpoint``'s
    default folder is ``<save_dir>/<project>/<run id>/checkpoints``.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        name: Optional[str] = None,
        save_dir: Union[str, os.PathLike] = ".",
        version: Optional[str] = None,
        offline: bool = False,
        dir: Optional[Union[str, os.PathLike]] = None,
        id: Optional[str] = None,
        anonymous: Optional[bool] = None,
        project: Optional[str] = None,
        log_model: Union[Literal["all"], bool] = False,
        experiment: Optional[Run] = None,
        prefix: str = "",
        checkpoint_name: Optional[str] = None,
        add_file_policy: Literal["mutable", "immutable"] = "mutable",
        **kwargs: Any,
    ) -> None:
        if not _WANDB:
            raise wandb_missing_error()
        if log_model not in (True, False, "all"):
            raise ValueError(f"WandbLogger(log_model={log_model!r}): use True, False or 'all'.")
        if offline and log_model:
            raise MisconfigurationException(
                f"WandbLogger(offline=True, log_model={log_model!r}): an offline run cannot upload checkpoints; "
                "set offline=False to log them, or log_model=False."
            )
        self._offline = offline
        self._log_model = log_model
        self._prefix = prefix
        self._experiment = experiment
        self._checkpoint_name = checkpoint_name
        self.add_file_policy = add_file_policy
        self._logged_checkpoints: dict[str, float] = {}
        self._checkpoint_callbacks: dict[int, Any] = {}
        folder = save_dir if save_dir is not None else dir
        self._wandb_init: dict[str, Any] = {
            "name": name,
            "project": project or os.environ.get("WANDB_PROJECT", "lightning_logs"),
            "dir": os.fspath(folder) if folder is not None else None,
            "id": version or id,
            "resume": "allow",
        }
        if anonymous:
            # Only when asked: recent wandb warns about the setting whenever it is passed.
            self._wandb_init["anonymous"] = "allow"
        if offline:
            # wandb's own switch; Lightning sets WANDB_MODE in the environment instead, which leaks into
            # every later run of the process.
            self._wandb_init["mode"] = "offline"
        self._wandb_init.update(kwargs)
        self._project = self._wandb_init["project"]
        self._save_dir = self._wandb_init["dir"]
        self._name = self._wandb_init["name"]
        self._id = self._wandb_init["id"]

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for ``ddp_spawn``: without the run (it cannot be pickled); the spawned rank 0 resumes it by id."""
        state = self.__dict__.copy()
        if self._experiment is not None:
            state["_id"] = self._experiment.id
            state["_wandb_init"] = {**self._wandb_init, "id": self._experiment.id}
        state["_experiment"] = None
        return state

    # ------------------------------------------------------------------ the run
    @property
    @rank_zero_experiment
    def experiment(self) -> Run:
        """The wandb run (made on first use on rank 0); elsewhere an object that ignores every call."""
        if self._experiment is not None:
            return self._experiment
        import wandb

        if self._save_dir is not None:
            os.makedirs(self._save_dir, exist_ok=True)
        if wandb.run is not None:
            rank_zero_warn(
                "A wandb run is already in progress; this WandbLogger logs into it. Call `wandb.finish()` before "
                "making the logger to start a new run."
            )
            self._experiment = wandb.run
        else:
            self._experiment = wandb.init(**self._wandb_init)
        run = self._experiment
        if getattr(run, "define_metric", None) is not None:
            if self._wandb_init.get("sync_tensorboard"):
                run.define_metric("*", step_metric="global_step")
            else:
                # Every metric is plotted against the trainer's step, not wandb's own call counter.
                run.define_metric("trainer/global_step")
                run.define_metric("*", step_metric="trainer/global_step", step_sync=True)
        return run

    @property
    def save_dir(self) -> Optional[str]:
        return self._save_dir

    @property
    def name(self) -> Optional[str]:  # type: ignore[override]
        """The project (not the run's display name: that is ``experiment.name``)."""
        return self._project

    @property
    def version(self) -> Optional[str]:
        """The run id: the run's once made, else the one given."""
        return self._experiment.id if self._experiment else self._id

    @property
    def log_dir(self) -> str:
        """``<save_dir>/<project>/<run id>``: where ``ModelCheckpoint`` puts its folder (the run is made for its id)."""
        if rank_zero_only.rank == 0:
            _ = self.experiment
        return paths.join(self._save_dir or ".", str(self.name), str(self.version))

    def watch(
        self, model: nn.Module, log: Optional[str] = "gradients", log_freq: int = 100, log_graph: bool = True
    ) -> None:
        """wandb's ``watch``: gradients and/or parameters of ``model`` every ``log_freq`` steps."""
        self.experiment.watch(model, log=log, log_freq=log_freq, log_graph=log_graph)

    # ------------------------------------------------------------------ logging
    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace]) -> None:
        """``params`` into the run's config: callables by name, what JSON cannot hold as text."""
        self.experiment.config.update(_config_values(as_dict(params)), allow_val_change=True)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, Any], step: Optional[int] = None) -> None:
        if self._prefix:
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        if step is not None and not self._wandb_init.get("sync_tensorboard"):
            self.experiment.log({**metrics, "trainer/global_step": step})
        else:
            self.experiment.log(dict(metrics))

    @rank_zero_only
    def log_table(
        self,
        key: str,
        columns: Optional[list[str]] = None,
        data: Optional[list[list[Any]]] = None,
        dataframe: Any = None,
        step: Optional[int] = None,
    ) -> None:
        """A ``wandb.Table`` from ``columns`` and ``data``, or from ``dataframe``."""
        import wandb

        self.log_metrics({key: wandb.Table(columns=columns, data=data, dataframe=dataframe)}, step)

    @rank_zero_only
    def log_text(
        self,
        key: str,
        columns: Optional[list[str]] = None,
        data: Optional[list[list[str]]] = None,
        dataframe: Any = None,
        step: Optional[int] = None,
    ) -> None:
        """Text as a table."""
        self.log_table(key, columns, data, dataframe, step)

    @rank_zero_only
    def log_image(self, key: str, images: list[Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Images (tensors, arrays, PIL images or paths); each keyword is a list with one item per image."""
        import wandb

        self.log_metrics({key: _media(wandb.Image, "images", images, kwargs)}, step)

    @rank_zero_only
    def log_audio(self, key: str, audios: list[Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Audio (arrays or paths); each keyword (``caption``, ``sample_rate``) is a list with one item per clip."""
        import wandb

        self.log_metrics({key: _media(wandb.Audio, "audios", audios, kwargs)}, step)

    @rank_zero_only
    def log_video(self, key: str, videos: list[Any], step: Optional[int] = None, **kwargs: Any) -> None:
        """Videos (arrays or paths); each keyword (``caption``, ``fps``, ``format``) is a list with one item per video."""
        import wandb

        self.log_metrics({key: _media(wandb.Video, "videos", videos, kwargs)}, step)

    # ------------------------------------------------------------------ checkpoints
    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Lightning's rule: ``"all"`` (or ``True`` with ``save_top_k=-1``) logs now, ``True`` at the end."""
        if self._log_model == "all" or (self._log_model is True and checkpoint_callback.save_top_k == -1):
            self._log_checkpoints(checkpoint_callback)
        elif self._log_model is True:
            self._checkpoint_callbacks[id(checkpoint_callback)] = checkpoint_callback

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Log the checkpoints left to log (after a successful run only, as Lightning does).

        The run itself stays open, as in Lightning: a later ``trainer.test`` logs into it; wandb
        finishes it when the process exits (or call ``wandb.finish()``).
        """
        if status != "success" or self._experiment is None:
            return
        for callback in self._checkpoint_callbacks.values():
            self._log_checkpoints(callback)

    def _log_checkpoints(self, checkpoint_callback: Any) -> None:
        import wandb

        for mtime, path, score in new_checkpoints(checkpoint_callback, self._logged_checkpoints):
            metadata = {
                "score": float(score) if score is not None else None,
                "original_filename": PurePosixPath(path).name,
                type(checkpoint_callback).__name__: {
                    k: getattr(checkpoint_callback, k)
                    for k in _CHECKPOINT_SETTINGS
                    if hasattr(checkpoint_callback, k)
                },
            }
            if not self._checkpoint_name:
                self._checkpoint_name = f"model-{self.experiment.id}"
            artifact = wandb.Artifact(name=self._checkpoint_name, type="model", metadata=metadata)
            if "://" in path:  # a checkpoint on an object store: wandb records where it is
                artifact.add_reference(path, name="model.ckpt")
            else:
                artifact.add_file(path, name="model.ckpt", policy=self.add_file_policy)
            aliases = ["latest", "best"] if path == checkpoint_callback.best_model_path else ["latest"]
            self.experiment.log_artifact(artifact, aliases=aliases)
            self._logged_checkpoints[path] = mtime

    @staticmethod
    @rank_zero_only
    def download_artifact(
        artifact: str,
        save_dir: Optional[Union[str, os.PathLike]] = None,
        artifact_type: Optional[str] = None,
        use_artifact: Optional[bool] = True,
    ) -> str:
        """Download ``artifact`` (``entity/project/name:alias``) and return its folder."""
        import wandb

        if wandb.run is not None and use_artifact:
            found = wandb.run.use_artifact(artifact)
        else:
            found = wandb.Api().artifact(artifact, type=artifact_type)
        return found.download(root=None if save_dir is None else os.fspath(save_dir))

    def use_artifact(self, artifact: str, artifact_type: Optional[str] = None) -> Artifact:
        """Record in the run that it uses ``artifact``."""
        return self.experiment.use_artifact(artifact, type=artifact_type)


def _config_values(params: Mapping[str, Any]) -> dict[str, Any]:
    """What a wandb config holds: JSON values; a callable by its name, anything else as its text."""
    import json

    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Mapping):
            out[key] = _config_values(value)
            continue
        if callable(value) and not isinstance(value, type) and hasattr(value, "__name__"):
            value = value.__name__
        elif isinstance(value, type):
            value = value.__name__
        try:
            json.dumps(value)
        except (TypeError, ValueError, OverflowError):
            value = str(value)
        out[key] = value
    return out


def _media(kind: Any, what: str, items: list[Any], options: dict[str, list[Any]]) -> list[Any]:
    if not isinstance(items, list):
        raise TypeError(f"`{what}` must be a list, got {type(items).__name__}.")
    for key, values in options.items():
        if len(values) != len(items):
            raise ValueError(f"`{key}` has {len(values)} items for {len(items)} {what}; give one per item.")
    return [kind(item, **{k: v[i] for k, v in options.items()}) for i, item in enumerate(items)]
