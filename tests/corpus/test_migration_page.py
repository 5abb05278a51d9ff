"""``docs/migrating-from-lightning.md`` stays true as the code and the corpus change.

* Every difference the corpus keeps on purpose (a strict xfail of ``test_lightning_programs.py``, or an
  ``"xfail"`` of a third party's ``corpus.json``) is named, by its program name, in the page's
  differences section: adding a kept difference without documenting it fails here.
* Every trainer-core path of the import table imports and has every name the row lists; every
  Lightning path on the left exists in Lightning 2.x.
* The page's Python blocks compile, and its program prints what it prints under Lightning 2.6.6 with
  Lightning's imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import ROOT
from test_lightning_programs import ALL, PROGRAMS

PAGE = ROOT / "docs" / "migrating-from-lightning.md"
THIRD_PARTY = ROOT / "tests" / "corpus" / "third_party"
_CODE = re.compile(r"`([^`]+)`")


def section(heading: str) -> str:
    """The text of the page's ``## `` section whose title contains ``heading``, up to the next ``## ``."""
    text = PAGE.read_text()
    match = re.search(rf"^## [^\n]*{re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"{PAGE.name} has no section titled with {heading!r}"
    return match.group(1)


def lightning_program_xfails() -> list[str]:
    """The names of ``test_lightning_programs.PROGRAMS`` marked as a strict xfail."""
    names = []
    for program in PROGRAMS:
        marks = getattr(program, "marks", ())
        if any(mark.name == "xfail" and mark.kwargs.get("strict") for mark in marks):
            names.append(program.values[0])
    return names


def third_party_xfails() -> list[str]:
    """The names of every third-party program whose manifest entry carries an ``"xfail"`` reason."""
    return [
        entry["name"]
        for manifest in sorted(THIRD_PARTY.glob("*/corpus.json"))
        for entry in json.loads(manifest.read_text())
        if entry.get("xfail")
    ]


def test_lightning_programs_keep_some_differences_on_purpose() -> None:
    """The parsing above finds the kept differences at all (it reads pytest marks, which could move)."""
    assert lightning_program_xfails(), "no strict xfail found in test_lightning_programs.PROGRAMS"


@pytest.mark.parametrize("name", lightning_program_xfails() + third_party_xfails())
def test_every_kept_difference_is_named_in_the_differences_section(name: str) -> None:
    differences = section("Differences from Lightning")
    assert re.search(rf"\b{re.escape(name)}\b", differences), (
        f"{name} is a strict xfail of the corpus, kept on purpose, but docs/{PAGE.name}'s differences "
        "section does not name it: add a row with what differs and why."
    )


@dataclass(frozen=True)
class ImportRow:
    lightning: list[str]
    module: str
    names: list[str]


def import_table() -> list[ImportRow]:
    """The rows of section 1's table: Lightning's paths, the trainer-core module, the names it has."""
    rows = []
    for line in section("Imports").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 3 or set(cells[0]) <= {"-", " "}:
            continue
        if cells[0] == "Lightning 2.x":
            continue
        modules = _CODE.findall(cells[1])
        assert len(modules) == 1, f"one trainer-core path per row: {line}"
        rows.append(ImportRow(_CODE.findall(cells[0]), modules[0], _CODE.findall(cells[2])))
    return rows


ROWS = import_table()


def test_the_import_table_covers_the_packages_programs_use() -> None:
    modules = {row.module for row in ROWS}
    assert len(ROWS) >= 30
    for package in ("callbacks", "loggers", "profilers", "tuner", "cli", "utilities", "plugins"):
        assert f"trainer_core.{package}" in modules, package


@pytest.mark.parametrize("row", ROWS, ids=[row.module for row in ROWS])
def test_every_trainer_core_path_imports_and_has_its_names(row: ImportRow) -> None:
    assert row.module.split(".")[0] == "trainer_core", row
    assert row.names, f"{row.module}: the row lists no names"
    module = importlib.import_module(row.module)
    missing = [name for name in row.names if not hasattr(module, name)]
    assert missing == [], f"{row.module} lacks {missing}"


def lightning_modules(row: ImportRow) -> list[str]:
    """The Lightning modules a row's left column names (``.x`` is ``pytorch_lightning.x``)."""
    modules = []
    for path in row.lightning:
        if path.startswith("."):
            modules.append("pytorch_lightning" + path)
        elif path in ("lightning.pytorch", "pytorch_lightning"):
            modules.append("pytorch_lightning")
    return modules


@pytest.mark.parametrize("row", ROWS, ids=[row.module for row in ROWS])
def test_every_lightning_path_exists_in_lightning(row: ImportRow) -> None:
    """Looked up as files of the installed package: importing Lightning costs seconds."""
    spec = importlib.util.find_spec("pytorch_lightning")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("PyTorch Lightning is not installed")
    package = Path(spec.submodule_search_locations[0])
    modules = lightning_modules(row)
    assert modules, f"the row for {row.module} names no Lightning path"
    for name in modules:
        path = package.joinpath(*name.split(".")[1:])
        assert path.with_suffix(".py").is_file() or (path / "__init__.py").is_file(), (
            f"Lightning has no {name}"
        )


def python_blocks() -> list[tuple[int, str]]:
    lines = PAGE.read_text().splitlines()
    blocks, start = [], None
    for number, line in enumerate(lines, 1):
        if start is None and line.strip() == "```python":
            start = number
        elif start is not None and line.startswith("```"):
            blocks.append((start, "\n".join(lines[start : number - 1]) + "\n"))
            start = None
    return blocks


def test_the_python_blocks_compile() -> None:
    blocks = python_blocks()
    assert blocks
    for line, source in blocks:
        compile(source, f"{PAGE.name}:{line}", "exec")


#: The last line the page's program prints under Lightning 2.6.6, with Lightning's imports (seeded, on the CPU).
LIGHTNING_PRINTS = "3 epochs, val_loss 0.8442"


def run_example(
    source: str, folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    folder.mkdir()
    monkeypatch.chdir(folder)
    exec(compile(source, f"{PAGE.name} ({folder.name})", "exec"), {"__name__": "__main__"})
    return capsys.readouterr().out.strip().splitlines()[-1]


def test_the_example_prints_what_it_prints_under_lightning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The page's program gives Lightning's numbers: "only the import lines differ" holds.

    ``make test`` compares with the line Lightning printed; ``make stress`` (``CORPUS_LIVE=1`` or
    ``FULL_MATRIX=1``) runs the program under Lightning too, as the corpus does.
    """
    _, source = python_blocks()[0]
    assert run_example(source, tmp_path / "trainer_core", monkeypatch, capsys) == LIGHTNING_PRINTS
    if ALL:
        pytest.importorskip("pytorch_lightning")
        lightning = re.sub(r"^(import|from) trainer_core\b", r"\1 pytorch_lightning", source, flags=re.M)
        assert lightning.count("pytorch_lightning") == 3, "the example imports from three trainer-core paths"
        assert run_example(lightning, tmp_path / "lightning", monkeypatch, capsys) == LIGHTNING_PRINTS
