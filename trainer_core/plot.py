"""Draw a CSVLogger run's metrics to a PNG: ``python -m trainer_core.plot LOGDIR``.

``LOGDIR`` is a version folder holding ``metrics.csv`` (``lightning_logs/version_3``), the
folder above the versions (the newest is drawn), or the CSV file itself; any fsspec URL. The
picture has one panel for the losses (every column with ``loss`` in its name), one for the
learning rates (``lr`` columns, as LearningRateMonitor names them) and one for the other
metrics (accuracies and the like), each against the optimizer step.

matplotlib is an optional extra (``pip install 'trainer-core[plot]'``) and is drawn with the
Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, Optional

from trainer_core import paths
from trainer_core.loggers.csv_logger import METRICS_FILE

DEFAULT_OUTPUT = "metrics.png"
_INSTALL_HINT = "pip install 'trainer-core[plot]'"
# Columns the loggers add for bookkeeping: the x axis, not a curve.
_AXIS_COLUMNS = ("step", "epoch")


class PlotError(Exception):
    """The log folder or the output cannot be used; the message says which and why."""


def find_metrics_file(log_dir: str, storage_options: Optional[dict[str, Any]] = None) -> str:
    """The ``metrics.csv`` that ``log_dir`` names: the file, the version folder's, or the newest version's."""
    fs, path = paths.resolve(log_dir, **(storage_options or {}))
    if fs.isfile(path):
        return log_dir
    if not fs.isdir(path):
        raise PlotError(
            f"{log_dir}: no such folder or file; pass a CSVLogger folder such as lightning_logs/version_0."
        )
    if fs.isfile(f"{path.rstrip('/')}/{METRICS_FILE}"):
        return paths.join(log_dir, METRICS_FILE)
    versions = []
    for entry in fs.ls(path, detail=False):
        match = re.fullmatch(r"version_(\d+)", entry.rstrip("/").rsplit("/", 1)[-1])
        if match and fs.isfile(f"{entry.rstrip('/')}/{METRICS_FILE}"):
            versions.append((int(match.group(1)), entry.rstrip("/").rsplit("/", 1)[-1]))
    if not versions:
        raise PlotError(
            f"{log_dir}: holds no {METRICS_FILE} and no version_N folder with one; point at the folder CSVLogger "
            "wrote (its `log_dir`)."
        )
    return paths.join(log_dir, max(versions)[1], METRICS_FILE)


def read_metrics(
    metrics_file: str, storage_options: Optional[dict[str, Any]] = None
) -> dict[str, list[tuple[float, float]]]:
    """``{column: [(step, value), ...]}`` for every metric column, skipping empty cells."""
    fs, path = paths.resolve(metrics_file, **(storage_options or {}))
    try:
        with fs.open(path, "r", newline="") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise PlotError(
            f"{metrics_file}: is not a CSV file of metrics ({type(err).__name__}: {err}); point at the folder "
            "CSVLogger wrote."
        ) from None
    series: dict[str, list[tuple[float, float]]] = {}
    for index, row in enumerate(rows):
        step = _number(row.get("step"))
        x = float(index) if step is None else step
        for column, cell in row.items():
            if column in _AXIS_COLUMNS or column is None:
                continue
            value = _number(cell)
            if value is not None:
                series.setdefault(column, []).append((x, value))
    return series


def plot_metrics(
    log_dir: str,
    output: Optional[str] = None,
    width: int = 1200,
    height: Optional[int] = None,
    dpi: int = 100,
    storage_options: Optional[dict[str, Any]] = None,
) -> str:
    """Draw ``log_dir``'s metrics to a ``width`` x ``height`` pixel PNG; returns where it went.

    ``output`` defaults to ``metrics.png`` beside ``metrics.csv``; ``height`` to 400 pixels per panel.
    """
    plt = _pyplot()
    metrics_file = find_metrics_file(log_dir, storage_options)
    series = read_metrics(metrics_file, storage_options)
    if not series:
        raise PlotError(f"{metrics_file}: has no metric values to draw yet.")
    panels = _panels(series)
    if height is None:
        height = 400 * len(panels)
    if width < 50 or height < 50 or dpi < 10:
        raise PlotError(f"width={width}, height={height}, dpi={dpi}: use at least 50 pixels and 10 dpi.")
    if output is None:
        output = metrics_file.rsplit("/", 1)[0] + "/" + DEFAULT_OUTPUT

    figure, axes = plt.subplots(len(panels), 1, figsize=(width / dpi, height / dpi), dpi=dpi, squeeze=False)
    try:
        for ax, (title, columns) in zip(axes[:, 0], panels):
            for column in columns:
                steps, values = zip(*series[column])
                # A column logged once per epoch has few points: markers keep them visible.
                marker = "o" if len(steps) <= 50 else None
                # A learning rate holds until the scheduler changes it: draw it as steps, not slopes.
                drawstyle = "steps-post" if title == "learning rate" else "default"
                ax.plot(steps, values, label=column, marker=marker, markersize=3, drawstyle=drawstyle)
            ax.set_title(title)
            ax.set_xlabel("step")
            ax.grid(True, alpha=0.3)
            ax.legend(loc="best", fontsize="small")
            if title == "learning rate" and all(v > 0 for c in columns for _, v in series[c]):
                values = [v for c in columns for _, v in series[c]]
                if max(values) / min(values) > 100:
                    ax.set_yscale("log")
        with warnings.catch_warnings():
            # A small picture cannot fit every label; it is still drawn, as asked.
            warnings.simplefilter("ignore", UserWarning)
            figure.tight_layout()
        buffer = io.BytesIO()
        # No bbox_inches="tight": the PNG is exactly width x height pixels.
        figure.savefig(buffer, format="png", dpi=dpi)
    finally:
        plt.close(figure)
    fs, out_path = paths.resolve(output, **(storage_options or {}))
    parent = out_path.rsplit("/", 1)[0]
    if parent and parent != out_path:
        fs.makedirs(parent, exist_ok=True)
    with fs.open(out_path, "wb") as f:
        f.write(buffer.getvalue())
    return output


def _panels(series: dict[str, list[tuple[float, float]]]) -> list[tuple[str, list[str]]]:
    losses = [c for c in series if "loss" in c.lower()]
    rates = [c for c in series if c not in losses and re.match(r"^(lr|learning_rate)([-_/].*)?$", c.lower())]
    others = [c for c in series if c not in losses and c not in rates]
    panels = [("loss", losses), ("learning rate", rates), ("metrics", others)]
    return [(title, sorted(columns)) for title, columns in panels if columns]


def _number(cell: Any) -> Optional[float]:
    if cell is None or cell == "":
        return None
    try:
        value = float(cell)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ModuleNotFoundError(
            f"Drawing metrics needs matplotlib, which is an optional extra: {_INSTALL_HINT}"
        ) from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer_core.plot", description="Draw a CSVLogger run's metrics to a PNG."
    )
    parser.add_argument(
        "log_dir", help="CSVLogger folder (version_N, the folder of versions, or metrics.csv); any fsspec URL"
    )
    parser.add_argument(
        "-o", "--output", default=None, help=f"PNG to write (default: {DEFAULT_OUTPUT} beside metrics.csv)"
    )
    parser.add_argument("--width", type=int, default=1200, help="pixels (default 1200)")
    parser.add_argument("--height", type=int, default=None, help="pixels (default 400 per panel)")
    parser.add_argument("--dpi", type=int, default=100)
    args = parser.parse_args(argv)
    try:
        output = plot_metrics(args.log_dir, args.output, args.width, args.height, args.dpi)
    except (PlotError, ModuleNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
