"""``TensorBoardLogger``: TensorBoard event files on any fsspec URL (needs the ``tensorboard`` package).

``logger.experiment`` is a ``torch.utils.tensorboard.SummaryWriter``, with its whole API
(``add_image``, ``add_histogram``, ...). Importing it costs about 0.3 s of CPU, so a run that only
logs metrics never does: its scalars go through :class:`~trainer_core.loggers.tfevents.ScalarEventWriter`,
which writes the same records. The SummaryWriter takes over at the first use of ``experiment``
(hyper-parameters, the graph, a program's own ``add_*`` call): the scalar file is closed first and
the SummaryWriter's file is named a second later, so TensorBoard reads the two in the order written.

Both write only to local files (TensorBoard's own object-store support knows neither fsspec nor its
``storage_options``), so for a remote ``save_dir`` they write into a local spool folder and every
``save()`` (each epoch end, after validate/test, at the end of the run) uploads the files that
changed through fsspec. An event file only grows, so the uploaded copy is always a valid prefix
of the run's events: TensorBoard pointed at the bucket shows the run up to the last epoch.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import time
from argparse import Namespace
from typing import Any, Optional, Union

import torch

from trainer_core import paths
from trainer_core.loggers.base import FolderLogger, as_dict
from trainer_core.loggers.tfevents import ScalarEventWriter
from trainer_core.utilities import rank_zero_only, rank_zero_warn

# The SummaryWriter arguments the scalar writer honours (``comment`` is unused when a folder is given);
# any other (``purge_step``) needs the SummaryWriter from the first scalar on.
_SCALAR_WRITER_KWARGS = frozenset({"comment", "max_queue", "flush_secs", "filename_suffix"})


def tensorboard_available() -> bool:
    """Whether ``tensorboard`` can be imported; found without importing it (or ``packaging``), at every ``Trainer()``."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger(FolderLogger):
    """Write ``<save_dir>/<name>/version_<n>[/<sub_dir>]/events.out.tfevents.*`` on global rank 0.

    Arguments follow Lightning's: ``log_graph`` draws the module's graph from its ``example_input_array``
    with the hyper-parameters at each stage's start, ``default_hp_metric`` logs ``hp_metric=-1`` with the
    hyper-parameters (so TensorBoard's HPARAMS tab lists the run before any metric is chosen),
    ``prefix`` is put before every metric name, extra keyword arguments go to ``SummaryWriter``
    (``flush_secs``, ``max_queue``, ``filename_suffix``), ``storage_options`` to fsspec.
    """

    def __init__(
        self,
        save_dir: Union[str, os.PathLike],
        name: Optional[str] = "lightning_logs",
        version: Optional[Union[int, str]] = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: Optional[str] = None,
        storage_options: Optional[dict[str, Any]] = None,
        **writer_kwargs: Any,
    ) -> None:
        if not tensorboard_available():
            raise ModuleNotFoundError(
                "TensorBoardLogger needs the `tensorboard` package, which is not installed: "
                "`pip install tensorboard`, or use CSVLogger."
            )
        super().__init__(save_dir, name, version, storage_options)
        self._log_graph = log_graph
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = sub_dir
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None
        # Scalars before the SummaryWriter is needed; once one was made, it writes every event after.
        self._scalars: Optional[ScalarEventWriter] = None
        self._scalars_only = _SCALAR_WRITER_KWARGS.issuperset(writer_kwargs)
        self._hparams: dict[str, Any] = {}
        self._hparams_written = False
        # Remote targets: the local folder SummaryWriter writes into, and the sizes last uploaded.
        self._spool: Optional[str] = None
        self._uploaded: dict[str, int] = {}

    @property
    def log_dir(self) -> str:
        """The version folder, or its ``sub_dir`` when one was given."""
        log_dir = super().log_dir
        return paths.join(log_dir, self._sub_dir) if self._sub_dir else log_dir

    @property
    def experiment(self) -> Any:
        """The ``SummaryWriter`` (created on first use); on other ranks than 0, an object that ignores every call."""
        if rank_zero_only.rank != 0:
            return _NoWriter()
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            target = self._target()
            if self._scalars is not None:
                self._scalars.close()
                _wait_for_second_after(self._scalars.second)
                self._scalars = None
            self._scalars_only = False
            self._writer = SummaryWriter(log_dir=target, **self._writer_kwargs)
        return self._writer

    def _target(self) -> str:
        """The folder the event files go to: the log folder, or a local spool for a remote one (made once)."""
        if self._spool is not None:
            return self._spool
        fs, folder = paths.resolve(self.log_dir, **self._storage_options)
        if paths.is_local(fs):
            fs.makedirs(folder, exist_ok=True)
            return folder
        self._spool = tempfile.mkdtemp(prefix="trainer-core-tensorboard-")
        return self._spool

    def _scalar_writer(self) -> Any:
        """Where ``log_metrics`` writes: the SummaryWriter once there is one, else the light scalar writer."""
        if self._writer is not None or not self._scalars_only:
            return self.experiment
        if self._scalars is None:
            kwargs = self._writer_kwargs
            self._scalars = ScalarEventWriter(
                self._target(), kwargs.get("filename_suffix", ""), kwargs.get("flush_secs", 120)
            )
        return self._scalars

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        writer = self._scalar_writer()
        for key, value in metrics.items():
            writer.add_scalar(f"{self._prefix}{key}", value, step)

    @rank_zero_only
    def log_hyperparams(
        self, params: Union[dict[str, Any], Namespace], metrics: Optional[dict[str, float]] = None
    ) -> None:
        """Record ``params`` in TensorBoard's HPARAMS tab (flattened to ``a/b`` names of plain values, which
        is all the tab shows) and in ``hparams.yaml`` beside the events (nested as given, as Lightning writes it).
        """
        from torch.utils.tensorboard.summary import hparams

        params = as_dict(params)
        self._hparams.update(params)
        params = _flatten(_plain(params))
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        writer = self.experiment
        if metrics:
            experiment, session_start, session_end = hparams(params, metrics)
            file_writer = writer._get_file_writer()
            for summary in (experiment, session_start, session_end):
                file_writer.add_summary(summary)
            for key, value in metrics.items():
                writer.add_scalar(key, value, 0)
        self._write_hparams_file(self._hparams)
        self._hparams_written = True

    @rank_zero_only
    def log_graph(self, model: Any, input_array: Any = None) -> None:
        """The module's graph, traced from ``input_array`` (else its ``example_input_array``), when ``log_graph``."""
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if not isinstance(input_array, (torch.Tensor, tuple)):
            rank_zero_warn(
                "TensorBoardLogger(log_graph=True) draws no graph: set the module's `example_input_array` to a "
                f"tensor or a tuple of `forward`'s positional arguments (it is {type(input_array).__name__})."
            )
            return
        device = getattr(model, "device", torch.device("cpu"))
        input_array = model.on_before_batch_transfer(input_array, 0)
        input_array = model.transfer_batch_to_device(input_array, device, 0)
        input_array = model.on_after_batch_transfer(input_array, 0)
        self.experiment.add_graph(model, input_array)

    @rank_zero_only
    def save(self) -> None:
        self._save_hparams_once()
        writer = self._writer or self._scalars
        if writer is None:
            return
        writer.flush()
        if self._spool is not None:
            self._upload()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        if status == "success":
            self._save_hparams_once()
        writer = self._writer or self._scalars
        if writer is None:
            return
        writer.flush()
        writer.close()
        self._writer = self._scalars = None
        if self._spool is not None:
            self._upload()
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None
            self._uploaded = {}

    # ------------------------------------------------------------------ files
    def _save_hparams_once(self) -> None:
        """Lightning's rule: a run's folder has an ``hparams.yaml``, ``{}`` when nothing was logged to it."""
        if not self._hparams_written:
            self._write_hparams_file(self._hparams)
            self._hparams_written = True

    def _upload(self) -> None:
        """Copy the spool's new or grown files to the remote ``log_dir`` (whole files: stores cannot append)."""
        assert self._spool is not None
        fs, folder = paths.resolve(self.log_dir, **self._storage_options)
        for directory, _, files in os.walk(self._spool):
            for file_name in files:
                local = os.path.join(directory, file_name)
                size = os.path.getsize(local)
                if self._uploaded.get(local) == size:
                    continue
                relative = os.path.relpath(local, self._spool).replace(os.sep, "/")
                fs.put_file(local, f"{folder}/{relative}")
                self._uploaded[local] = size


def _wait_for_second_after(second: int) -> None:
    """Sleep (less than a second, once per logger at most) until the clock's whole second is past ``second``.

    Event files are read in the order of their names, which start with that second; a file named
    with the same second could sort before the one written earlier, and TensorBoard would then drop
    the earlier steps as a restart's.
    """
    wait = second + 1 - time.time()
    if wait > 0:
        time.sleep(wait)


class _NoWriter:
    """What ``experiment`` is on ranks other than 0: every ``add_*`` call does nothing, so user code needs no rank test."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _plain(params: dict[str, Any]) -> dict[str, Any]:
    """What TensorBoard's HPARAMS tab can show: numbers, strings, booleans; anything else as text."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, dict):
            out[key] = _plain(value)
        elif isinstance(value, (bool, int, float, str)):
            out[key] = value
        elif value is None:
            out[key] = "None"
        else:
            out[key] = repr(value)
    return out


def _flatten(params: dict[str, Any], parent: str = "") -> dict[str, Any]:
    """``{"optim": {"lr": 0.1}}`` -> ``{"optim/lr": 0.1}``, as Lightning flattens nested hyper-parameters."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if isinstance(value, dict):
            out.update(_flatten(value, name))
        else:
            out[name] = value
    return out
