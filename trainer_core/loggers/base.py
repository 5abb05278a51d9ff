"""The logger interface and the versioned folder layout the built-in loggers share."""

from __future__ import annotations

import functools
import os
import re
from abc import ABC, abstractmethod
from argparse import Namespace
from typing import Any, Callable, Optional, Union

from trainer_core import paths
from trainer_core.hparams import hparams_to_yaml
from trainer_core.utilities import rank_zero_only

#: Hyper-parameters beside the logs, nested as given: the YAML document Lightning writes (trainer_core.hparams).
HPARAMS_FILE = "hparams.yaml"
#: ``hparams_to_yaml({})``, PyYAML's document for an empty mapping.
EMPTY_HPARAMS = "{}\n"


class Logger(ABC):
    """Base class: metrics and hyper-parameters go to ``log_metrics``/``log_hyperparams``.

    Those two are abstract: a subclass lacking one cannot be built (Python's ``TypeError`` names it),
    instead of failing at the first step that logs. Everything else has a default (docs/extending.md §7).
    """

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> Union[int, str, None]:
        return None

    @property
    def save_dir(self) -> Optional[str]:
        return None

    @property
    def log_dir(self) -> Optional[str]:
        return None

    @property
    def group_separator(self) -> str:
        """What joins a group and a name in a metric's key (``grad_norm``'s ``grad_2.0_norm/layer.weight``)."""
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        """Record ``metrics`` (``{name: float}``) at training step ``step``."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Record the run's hyper-parameters."""

    def log_graph(self, model: Any, input_array: Any = None) -> None:  # noqa: B027 (optional, as save)
        """Record the model's graph, for a logger that can draw one (called with the hyper-parameters)."""

    def save(self) -> None:  # noqa: B027 (an optional hook: a logger without a buffer has nothing to flush)
        """Flush buffered records."""

    def finalize(self, status: str) -> None:
        """Flush and close at the end of a run (``status``: ``"success"``, ``"failed"`` or ``"preempted"``)."""
        self.save()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:  # noqa: B027 (an optional hook)
        """Called on global rank 0 after ``ModelCheckpoint`` saved (loggers that upload checkpoints use it)."""


class FolderLogger(Logger):
    """A logger that writes into ``<save_dir>/<name>/version_<n>`` on any fsspec URL.

    ``version`` is the next free number under ``<save_dir>/<name>`` unless given, and is chosen
    only when first needed, so a logger that never writes creates no folder.
    """

    def __init__(
        self,
        save_dir: Union[str, os.PathLike],
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        storage_options: Optional[dict[str, Any]] = None,
    ) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version
        self._storage_options = storage_options or {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        """``<save_dir>/<name>``: the folder that holds every version of this experiment."""
        return paths.join(self._save_dir, self._name) if self._name else self._save_dir

    @property
    def version(self) -> Union[int, str]:
        if self._version is None:
            self._version = next_version(self.root_dir, self._storage_options)
        return self._version

    @property
    def log_dir(self) -> str:
        return paths.join(self.root_dir, version_folder(self.version))

    def _write_hparams_file(self, params: dict[str, Any]) -> None:
        write_hparams_file(self.log_dir, params, self._storage_options)


def write_hparams_file(
    log_dir: str, params: dict[str, Any], storage_options: Optional[dict[str, Any]] = None
) -> None:
    """``params`` as ``<log_dir>/hparams.yaml`` (what ``load_from_checkpoint(hparams_file=...)`` reads)."""
    fs, folder = paths.resolve(log_dir, **(storage_options or {}))
    fs.makedirs(folder, exist_ok=True)
    # A run without hyper-parameters still gets the file (Lightning's rule): "{}" needs no YAML import.
    text = hparams_to_yaml(params) if params else EMPTY_HPARAMS
    with fs.open(f"{folder}/{HPARAMS_FILE}", "w") as f:
        f.write(text)


def next_version(root: str, storage_options: Optional[dict[str, Any]] = None) -> int:
    """One more than the highest ``version_N`` folder under ``root`` (0 when there is none)."""
    fs, path = paths.resolve(root, **(storage_options or {}))
    # Object-store clients cache listings; another process may have started a version since.
    fs.invalidate_cache(path)
    if not fs.exists(path):
        return 0
    versions = []
    for entry in fs.ls(path, detail=False):
        match = re.fullmatch(r"version_(\d+)", entry.rstrip("/").rsplit("/", 1)[-1])
        if match:
            versions.append(int(match.group(1)))
    return max(versions) + 1 if versions else 0


def version_folder(version: Union[int, str]) -> str:
    """``version_3`` for a number; a string version is the folder name itself (Lightning's rule)."""
    return version if isinstance(version, str) else f"version_{version}"


def as_dict(params: Union[dict[str, Any], Namespace]) -> dict[str, Any]:
    """Hyper-parameters as a dict: an ``argparse.Namespace`` (a script's parsed arguments) too."""
    return dict(vars(params)) if isinstance(params, Namespace) else dict(params)


class DummyExperiment:
    """What a logger's ``experiment`` is on ranks other than 0: every call does nothing, so user code needs no rank test."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None

    def __getitem__(self, key: Any) -> DummyExperiment:
        return self


def rank_zero_experiment(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """For a logger's ``experiment`` property: the real object on global rank 0, a :class:`DummyExperiment` elsewhere."""

    @functools.wraps(fn)
    def experiment(self: Any) -> Any:
        if rank_zero_only.rank != 0:
            return DummyExperiment()
        return fn(self)

    return experiment


def new_checkpoints(checkpoint_callback: Any, logged: dict[str, float]) -> list[tuple[float, str, Any]]:
    """``(mtime, path, score)`` of the callback's checkpoints not in ``logged`` or rewritten since, oldest first.

    The checkpoints are the last, the best and the top-k ones (Lightning's choice for ``log_model``);
    a file already removed is skipped.
    """
    found: dict[str, Any] = {}
    last = getattr(checkpoint_callback, "last_model_path", "")
    if last:
        found[last] = getattr(checkpoint_callback, "current_score", None)
    best = getattr(checkpoint_callback, "best_model_path", "")
    if best:
        found[best] = getattr(checkpoint_callback, "best_model_score", None)
    found.update(getattr(checkpoint_callback, "best_k_models", {}))
    out = []
    for path, score in found.items():
        fs, resolved = paths.resolve(path)
        try:
            mtime = fs.modified(resolved).timestamp()
        except (FileNotFoundError, OSError, NotImplementedError):
            continue
        if path not in logged or logged[path] < mtime:
            out.append((mtime, path, score))
    return sorted(out, key=lambda item: (item[0], item[1]))
