"""``MLFlowLogger``: parameters, metrics by step and checkpoints to an MLflow tracking server (extra ``mlflow``).

Lightning's arguments and semantics: one MLflow run per logger, created on first use on global rank
0 (other ranks get an experiment that ignores every call and never import mlflow); hyper-parameters
as run parameters (nested dicts flattened with ``/``); metrics with their step; with ``log_model``
the checkpoints of ``ModelCheckpoint`` as run artifacts (``"all"``: as they are written; ``True``:
at the end of a successful run, or as written when ``save_top_k=-1``); the run ends ``FINISHED``,
``FAILED`` or ``KILLED`` (a preempted run).
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time
from argparse import Namespace
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import PurePosixPath
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

from lightning_utilities.core.imports import RequirementCache

from trainer_core import paths
from trainer_core.loggers.base import Logger, as_dict, new_checkpoints, rank_zero_experiment
from trainer_core.utilities import rank_zero_only, rank_zero_warn

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

log = logging.getLogger(__name__)

_MLFLOW = RequirementCache("mlflow>=2.10", "mlflow")
LOCAL_FILE_URI_PREFIX = "file:"
#: What ``trainer.fit`` passes to ``finalize`` -> MLflow's run status.
_RUN_STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "preempted": "KILLED"}
#: MLflow's batch limits (``mlflow.utils.validation``), the same on every supported version.
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
#: The characters MLflow accepts in a metric name; others are dropped (with a warning), as in Lightning.
_BAD_METRIC_CHARS = re.compile(r"[^a-zA-Z0-9_/. -]+")
#: ModelCheckpoint's settings written beside each logged checkpoint (``metadata.yaml``).
_CHECKPOINT_SETTINGS = (
    "monitor",
    "mode",
    "save_last",
    "save_top_k",
    "save_weights_only",
    "_every_n_train_steps",
    "_every_n_epochs",
)


def mlflow_missing_error() -> ModuleNotFoundError:
    return ModuleNotFoundError(
        f"MLFlowLogger needs the `mlflow` package ({_MLFLOW.message}); `pip install trainer-core[mlflow]` "
        "(or `pip install mlflow`), or use CSVLogger."
    )


class MLFlowLogger(Logger):
    """Log to MLflow on global rank 0.

    Args:
        experiment_name: the MLflow experiment; created when missing.
        run_name: the run's name (MLflow's ``mlflow.runName`` tag; it overrides that tag in ``tags``).
        tracking_uri: the tracking server (``http://host:port``) or store; when None,
            ``$MLFLOW_TRACKING_URI`` (read when the logger is made, not when this module is imported
            as Lightning does), else ``file:<save_dir>``.
        tags: tags of the new run.
        save_dir: the local store for ``file:`` tracking (default ``./mlruns``); unused with a server.
        log_model: ``"all"``, ``True`` or ``False``: which ``ModelCheckpoint`` files become artifacts.
        prefix: put before every metric name, joined with ``-`` (Lightning's rule).
        artifact_location: where a newly created experiment keeps its artifacts (the server's default when None).
        run_id: continue this run instead of starting one.
        synchronous: with False, MLflow logs in a background thread (mlflow's own option).

    ``name`` is the experiment id and ``version`` the run id, as in Lightning, so ``ModelCheckpoint``'s
    default folder is ``<save_dir or the working directory>/<experiment id>/<run id>/checkpoints``.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: Optional[str] = None,
        tracking_uri: Optional[str] = None,
        tags: Optional[dict[str, Any]] = None,
        save_dir: Optional[str] = "./mlruns",
        log_model: Literal[True, False, "all"] = False,
        prefix: str = "",
        artifact_location: Optional[str] = None,
        run_id: Optional[str] = None,
        synchronous: Optional[bool] = None,
    ) -> None:
        if not _MLFLOW:
            raise mlflow_missing_error()
        if log_model not in (True, False, "all"):
            raise ValueError(f"MLFlowLogger(log_model={log_model!r}): use True, False or 'all'.")
        tracking_uri = (
            tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"{LOCAL_FILE_URI_PREFIX}{save_dir}"
        )
        self._experiment_name = experiment_name
        self._experiment_id: Optional[str] = None
        self._tracking_uri = tracking_uri
        self._run_name = run_name
        self._run_id = run_id
        self.tags = tags
        self._log_model = log_model
        self._prefix = prefix
        self._artifact_location = artifact_location
        self._log_batch_kwargs = {} if synchronous is None else {"synchronous": synchronous}
        self._client: Optional[MlflowClient] = None
        # Checkpoints already logged, with the modification time they had then (``last.ckpt`` is rewritten).
        self._logged_checkpoints: dict[str, float] = {}
        self._checkpoint_callbacks: dict[int, Any] = {}
        # Lightning's Trainer puts checkpoints under its default_root_dir (the working directory by
        # default) when the tracking store is not local; the logger does not know the Trainer's.
        self._local_root = self.save_dir or os.getcwd()

    def __getstate__(self) -> dict[str, Any]:
        """Pickled for ``ddp_spawn``: without the client; the spawned rank 0 logs into the same run by its id."""
        state = self.__dict__.copy()
        state["_client"] = None
        return state

    # ------------------------------------------------------------------ the run
    @property
    @rank_zero_experiment
    def experiment(self) -> MlflowClient:
        """The ``MlflowClient``, with this logger's run created (rank 0); elsewhere an object that ignores calls."""
        if self._client is not None:
            return self._client
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self._tracking_uri)
        if self._run_id is not None:
            self._experiment_id = client.get_run(self._run_id).info.experiment_id
            self._client = client
            return client
        found = client.get_experiment_by_name(self._experiment_name)
        if found is not None and found.lifecycle_stage != "deleted":
            self._experiment_id = found.experiment_id
        else:
            log.info("MLflow experiment %r not found; creating it.", self._experiment_name)
            self._experiment_id = client.create_experiment(
                name=self._experiment_name, artifact_location=self._artifact_location
            )
        tags = dict(self.tags or {})
        if self._run_name is not None:
            from mlflow.utils.mlflow_tags import MLFLOW_RUN_NAME

            if MLFLOW_RUN_NAME in tags:
                log.warning(
                    "The tag %s in `tags` is replaced by run_name=%r.", MLFLOW_RUN_NAME, self._run_name
                )
            tags[MLFLOW_RUN_NAME] = self._run_name
        from mlflow.tracking.context.registry import resolve_tags

        run = client.create_run(experiment_id=self._experiment_id, tags=resolve_tags(tags))
        self._run_id = run.info.run_id
        self._client = client
        return client

    @property
    def run_id(self) -> Optional[str]:
        """The run's id (the run is created on first access on rank 0)."""
        _ = self.experiment
        return self._run_id

    @property
    def experiment_id(self) -> Optional[str]:
        _ = self.experiment
        return self._experiment_id

    @property
    def name(self) -> Optional[str]:  # type: ignore[override]
        """The experiment id (Lightning's choice: the folder name of the run's checkpoints)."""
        return self.experiment_id

    @property
    def version(self) -> Optional[str]:
        """The run id."""
        return self.run_id

    @property
    def save_dir(self) -> Optional[str]:
        """The local store's folder for ``file:`` tracking; None with a server."""
        if self._tracking_uri.startswith(LOCAL_FILE_URI_PREFIX):
            return self._tracking_uri[len(LOCAL_FILE_URI_PREFIX) :]
        return None

    @property
    def log_dir(self) -> str:
        """``<save_dir or working directory>/<experiment id>/<run id>``: where ``ModelCheckpoint`` puts its folder."""
        return paths.join(self._local_root, str(self.name), str(self.version))

    # ------------------------------------------------------------------ logging
    @rank_zero_only
    def log_hyperparams(self, params: Union[dict[str, Any], Namespace]) -> None:
        """``params`` as run parameters: nested dicts flattened with ``/``, values as text within MLflow's limit."""
        from mlflow.entities import Param

        try:
            from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH as limit
        except ImportError:  # pragma: no cover - every supported mlflow has it
            limit = 250
        flat = _flatten(as_dict(params))
        entries = [Param(key=k, value=str(v)[:limit]) for k, v in flat.items()]
        for start in range(0, len(entries), _PARAMS_PER_BATCH):
            self.experiment.log_batch(
                run_id=self.run_id,
                params=entries[start : start + _PARAMS_PER_BATCH],
                **self._log_batch_kwargs,
            )

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: Optional[int] = None) -> None:
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        entries = []
        for key, value in metrics.items():
            if isinstance(value, str):
                log.warning("MLFlowLogger: discarding the metric %s=%r, a string.", key, value)
                continue
            key = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key
            clean = _BAD_METRIC_CHARS.sub("", key)
            if clean != key:
                rank_zero_warn(
                    f"MLflow accepts only letters, digits and '_', '/', '.', ' ', '-' in metric names: "
                    f"{key!r} is logged as {clean!r}.",
                    category=RuntimeWarning,
                )
            entries.append(Metric(key=clean, value=float(value), timestamp=timestamp_ms, step=step or 0))
        for start in range(0, len(entries), _METRICS_PER_BATCH):
            self.experiment.log_batch(
                run_id=self.run_id,
                metrics=entries[start : start + _METRICS_PER_BATCH],
                **self._log_batch_kwargs,
            )

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """Log the checkpoints left to log, then end the run with the matching MLflow status."""
        if self._client is None:
            return
        for callback in self._checkpoint_callbacks.values():
            self._log_checkpoints(callback)
        self._client.set_terminated(self._run_id, _RUN_STATUS.get(status, status.upper()))

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Lightning's rule: ``"all"`` (or ``True`` with ``save_top_k=-1``) logs now, ``True`` at the end."""
        if self._log_model == "all" or (self._log_model is True and checkpoint_callback.save_top_k == -1):
            self._log_checkpoints(checkpoint_callback)
        elif self._log_model is True:
            self._checkpoint_callbacks[id(checkpoint_callback)] = checkpoint_callback

    @rank_zero_only
    def _log_checkpoints(self, checkpoint_callback: Any) -> None:
        """Each checkpoint not logged yet (or rewritten since) as ``<file stem>/<file>``, with its metadata and aliases.

        Laid out as Lightning lays them out: ``metadata.yaml`` (score, file name, the callback's
        settings) and ``aliases.txt`` (``['latest', 'best']`` for the best one) beside the file.
        """
        client = self.experiment
        for mtime, path, score in new_checkpoints(checkpoint_callback, self._logged_checkpoints):
            stem = PurePosixPath(path).stem
            metadata = {
                "score": float(score) if score is not None else None,
                "original_filename": PurePosixPath(path).name,
                "Checkpoint": {
                    k: getattr(checkpoint_callback, k)
                    for k in _CHECKPOINT_SETTINGS
                    if hasattr(checkpoint_callback, k)
                },
            }
            aliases = ["latest", "best"] if path == checkpoint_callback.best_model_path else ["latest"]
            with _local_file(path) as local, tempfile.TemporaryDirectory() as extra:
                client.log_artifact(self._run_id, local, stem)
                with open(os.path.join(extra, "metadata.yaml"), "w") as f:
                    f.write(_yaml(metadata))
                with open(os.path.join(extra, "aliases.txt"), "w") as f:
                    f.write(str(aliases))
                client.log_artifacts(self._run_id, extra, stem)
            self._logged_checkpoints[path] = mtime


@contextmanager
def _local_file(path: str) -> Iterator[str]:
    """A local path for ``path``: itself when local, else a temporary download (MLflow uploads local files)."""
    fs, resolved = paths.resolve(path)
    if paths.is_local(fs):
        yield resolved
        return
    with tempfile.TemporaryDirectory() as folder:
        local = os.path.join(folder, PurePosixPath(resolved).name)
        fs.get_file(resolved, local)
        yield local


def _flatten(params: Mapping[str, Any], parent: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim/lr": 0.1}`` (Lightning's flattening of nested hyper-parameters)."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if isinstance(value, Mapping):
            out.update(_flatten(value, name))
        elif isinstance(value, Namespace):
            out.update(_flatten(vars(value), name))
        else:
            out[name] = value
    return out


def _yaml(data: Mapping[str, Any]) -> str:
    """``data`` as YAML with PyYAML (an mlflow dependency), or as JSON (valid YAML) without it."""
    try:
        import yaml
    except ImportError:  # pragma: no cover - mlflow depends on PyYAML
        import json

        return json.dumps(data, indent=2, default=str)
    return yaml.safe_dump(dict(data), default_flow_style=False)
