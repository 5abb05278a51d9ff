"""``python -m trainer_core.plot``: a CSVLogger run's metrics drawn to a PNG of the size asked for."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest

from trainer_core.loggers import CSVLogger

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (extra 'plot' or 'test')")

from trainer_core.plot import main, plot_metrics, read_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (the first one, right after the signature)."""
    assert data[:8] == PNG_SIGNATURE, "not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def _write_run(save_dir: str, **options: object) -> CSVLogger:
    """What a fit writes: a train loss per step, val loss/acc per epoch, the learning rate per epoch."""
    logger = CSVLogger(save_dir, **options)
    for step in range(30):
        logger.log_metrics({"train_loss": 2.0 / (step + 1), "epoch": step // 10}, step=step)
        if step % 10 == 0:
            logger.log_metrics({"lr-SGD": 0.1 * 0.5 ** (step // 10), "epoch": step // 10}, step=step)
        if step % 10 == 9:
            logger.log_metrics(
                {"val_loss": 1.0 / (step + 1), "val_acc": step / 30, "epoch": step // 10}, step=step
            )
    logger.save()
    return logger


def test_cli_draws_a_png_of_the_requested_size(tmp_path: Path) -> None:
    logger = _write_run(str(tmp_path))
    # The folder above the versions: the newest version is drawn.
    _write_run(str(tmp_path))
    env = dict(os.environ, MPLBACKEND="")  # the module chooses Agg itself
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer_core.plot",
            str(tmp_path / "lightning_logs"),
            "--width",
            "640",
            "--height",
            "480",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    png = tmp_path / "lightning_logs" / "version_1" / "metrics.png"
    assert proc.stdout.strip() == str(png)
    assert _png_size(png.read_bytes()) == (640, 480)
    assert not (Path(logger.log_dir) / "metrics.png").exists()


def test_series_are_read_per_column_and_the_default_size_has_a_panel_each(tmp_path: Path) -> None:
    logger = _write_run(str(tmp_path))
    series = read_metrics(f"{logger.log_dir}/metrics.csv")
    assert sorted(series) == ["lr-SGD", "train_loss", "val_acc", "val_loss"]
    assert series["lr-SGD"] == [(0.0, 0.1), (10.0, 0.05), (20.0, 0.025)]
    assert len(series["train_loss"]) == 30 and series["train_loss"][0] == (0.0, 2.0)
    output = plot_metrics(logger.log_dir, output=str(tmp_path / "out" / "curves.png"), width=900, dpi=90)
    # Three panels (losses, learning rate, accuracy) of 400 pixels each.
    assert _png_size(Path(output).read_bytes()) == (900, 1200)


def test_reads_and_writes_on_s3(s3_url: str) -> None:
    logger = _write_run(s3_url)
    output = plot_metrics(logger.log_dir, width=300, height=200)
    assert output == f"{logger.log_dir}/metrics.png"
    with fsspec.open(output, "rb") as f:
        assert _png_size(f.read()) == (300, 200)


def test_errors_name_the_folder_and_the_missing_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "nowhere" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "metrics.csv" in capsys.readouterr().err

    logger = _write_run(str(tmp_path))
    # matplotlib made unimportable in the child, as on an install without the extra.
    code = "import sys; sys.modules['matplotlib'] = None; from trainer_core.plot import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, logger.log_dir], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "pip install 'trainer-core[plot]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (Path(logger.log_dir) / "metrics.png").exists()


@pytest.mark.parametrize("content", [b"step,loss\n0,\xff\xfe\n", b"step,loss\n0," + b"x" * 200_000 + b"\n"])
def test_a_damaged_metrics_file_is_one_error_naming_it(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not UTF-8, or a cell over the csv module's field limit: one error naming the file, no traceback."""
    metrics = tmp_path / "metrics.csv"
    metrics.write_bytes(content)
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(metrics) in err and "not a CSV file of metrics" in err and "Traceback" not in err
    assert not (tmp_path / "metrics.png").exists()
