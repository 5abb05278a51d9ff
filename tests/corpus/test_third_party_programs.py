"""Programs Lightning did not write, their imports changed to trainer-core, give Lightning's numbers.

Each folder ``tests/corpus/third_party/<owner>__<repo>/`` holds a third party's files as they wrote them
(each file's header names the commit and every change: synthetic data, smaller sizes) and a manifest,
``corpus.json``, of the programs to run there. ``run_program.py`` runs each under Lightning and under
trainer-core; besides what Lightning's own programs are compared by (steps, metrics, results,
predictions, weights), the record here has every training step's loss and learning rates, the files
the run wrote (checkpoint names, the loggers' CSV, YAML and TensorBoard scalars by content) and the
Python, NumPy and torch random states after each entry point.

Lightning's records are kept in ``tests/corpus/expected/third_party/`` (``CORPUS_UPDATE=1`` writes them
with Lightning 2.6.6); ``make test`` runs the programs marked ``every_run`` and ``make stress``
(``CORPUS_LIVE=1``) all of them beside a live Lightning. A difference kept on purpose is a strict xfail
whose reason the manifest gives; ``docs/migrating-from-lightning.md`` names each.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from test_lightning_programs import ALL, assert_same_record, compare_with_lightning, run

HERE = Path(__file__).resolve().parent
EXPECTED = HERE / "expected" / "third_party"


def manifest() -> list[dict[str, Any]]:
    """Every program of every third party's ``corpus.json``, with its entry as ``run_program.py`` takes it."""
    programs = []
    for path in sorted((HERE / "third_party").glob("*/corpus.json")):
        for entry in json.loads(path.read_text()):
            programs.append({**entry, "program": f"third_party/{path.parent.name}/{entry['entry']}"})
    return programs


PROGRAMS = manifest()


def _params() -> list[Any]:
    params = []
    for entry in PROGRAMS:
        marks = []
        if entry.get("xfail"):
            marks.append(pytest.mark.xfail(reason=f"kept on purpose: {entry['xfail']}", strict=True))
        params.append(pytest.param(entry, marks=marks, id=entry["name"]))
    return params


def _same(mine: Any, theirs: Any, where: Any) -> None:
    """Equal structure and strings; numbers (also numbers written as strings, as in a CSV) to 1e-5."""
    if isinstance(theirs, dict):
        assert isinstance(mine, dict) and sorted(mine) == sorted(theirs), where
        for key, value in theirs.items():
            _same(mine[key], value, (where, key))
    elif isinstance(theirs, list):
        assert isinstance(mine, list) and len(mine) == len(theirs), where
        for index, (a, b) in enumerate(zip(mine, theirs)):
            _same(a, b, (where, index))
    elif isinstance(theirs, (int, float)) and not isinstance(theirs, bool):
        assert isinstance(mine, (int, float)), where
        if math.isnan(theirs):
            assert math.isnan(mine), where
        else:
            assert mine == pytest.approx(theirs, rel=1e-5, abs=1e-6), where
    elif isinstance(theirs, str) and isinstance(mine, str) and mine != theirs:
        try:
            a, b = float(mine), float(theirs)
        except ValueError:
            raise AssertionError((where, mine, theirs)) from None
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6) or (math.isnan(a) and math.isnan(b)), where
    else:
        assert mine == theirs, where


def assert_same_run(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    assert_same_record(ours, theirs)
    for mine, lightning in zip(ours, theirs):
        where = mine["call"]
        for key in ("steps", "rng", "files"):
            if key in lightning:
                _same(mine.get(key), lightning[key], (where, key))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("entry", _params())
def test_third_party_program_matches_lightning(entry: dict[str, Any], tmp_path: Path) -> None:
    name = entry["name"]
    if not ALL and not entry.get("every_run"):
        pytest.skip(
            "make stress runs it (FULL_MATRIX=1 or CORPUS_LIVE=1); make test runs those marked every_run"
        )
    args, budget = entry.get("args", []), entry.get("budget") or None
    ours = run("trainer_core", entry["program"], args, tmp_path / "trainer_core", budget=budget)
    assert ours, "the program called no Trainer entry point"
    compare_with_lightning(
        ours,
        EXPECTED / f"{name}.json",
        lambda: run("lightning", entry["program"], args, tmp_path / "lightning", budget=budget),
        assert_same_run,
    )


def test_manifests_are_complete() -> None:
    """Every program names its entry (which exists), its features and a unique name; every file has a source header."""
    names = [entry["name"] for entry in PROGRAMS]
    assert len(names) == len(set(names))
    for entry in PROGRAMS:
        assert (HERE / entry["program"]).is_file(), entry["program"]
        assert entry.get("features"), entry["name"]
    for path in (HERE / "third_party").rglob("*.py"):
        head = path.read_text()[:2000]
        assert "# Source: https://github.com/" in head and "# Changes" in head, path
