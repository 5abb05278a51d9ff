"""Every code block of the user guides runs, and every relative link of the docs points at a file.

Each ```` ```python ```` block of ``docs/extending.md`` and the guides is a whole program: it is run
as ``example.py`` in a fresh folder, in a new process started the way a user starts a script, and
must exit 0 (its own asserts check that it worked). A block marked ``<!-- fragment -->`` on the line
before is only compiled. So a change that breaks an example, or an example that stops matching the
code, fails here with the block's heading and its output.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from launch import ROOT, job_env

#: The pages whose code blocks are programs a user copies.
GUIDES = ("docs/extending.md", "docs/checkpoints.md", "docs/parallel.md", "docs/fault-tolerance.md")
#: The pages whose links are checked.
LINKED = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")))
FRAGMENT_MARK = "<!-- fragment -->"
#: A two-process example starts torch three times on a shared 2-core machine.
RUN_SECONDS = 150


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    heading: str
    source: str
    fragment: bool

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} (under {self.heading!r})"


def code_blocks(page: str) -> list[Block]:
    """The ```` ```python ```` blocks of ``page``, each with its line, the heading above it and its mark."""
    lines = (ROOT / page).read_text().splitlines()
    blocks, heading, i = [], page, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if line.strip() == "```python":
                before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                source = "\n".join(lines[i + 1 : end]) + "\n"
                blocks.append(Block(page, i + 1, heading, source, before == FRAGMENT_MARK))
            i = end + 1
            continue
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        i += 1
    return blocks


def _pages_with_code() -> list[Block]:
    return [block for page in GUIDES if (ROOT / page).exists() for block in code_blocks(page)]


BLOCKS = _pages_with_code()


def _block_id(block: Block) -> str:
    return f"{Path(block.page).stem}:{block.line}"


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.fragment], ids=_block_id)
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_example_runs(block: Block, tmp_path: Path) -> None:
    (tmp_path / "example.py").write_text(block.source)
    env = job_env()
    env.pop("TRAINER_CORE_LAUNCHED", None)
    env["PYTHONPATH"] = str(ROOT)
    try:
        proc = subprocess.run(
            [sys.executable, "example.py"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_SECONDS,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"{block.where} did not finish within {RUN_SECONDS} s:\n{_tail(err.stdout)}\n{_tail(err.stderr)}"
        )
    if proc.returncode != 0:
        pytest.fail(
            f"{block.where} exited with {proc.returncode}:\n--- stdout\n{_tail(proc.stdout)}\n--- stderr\n"
            f"{_tail(proc.stderr)}"
        )


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.fragment], ids=_block_id)
def test_fragment_compiles(block: Block) -> None:
    compile(block.source, block.where, "exec")


def test_fragments_are_few() -> None:
    """A fragment is only compiled; most blocks must be whole programs that run."""
    fragments = [b.where for b in BLOCKS if b.fragment]
    assert len(fragments) <= max(2, len(BLOCKS) // 5), f"too many fragments: {fragments}"


def test_every_extension_point_has_a_program() -> None:
    """docs/extending.md: each numbered section that documents an extension point holds a program that runs."""
    programs = {b.heading for b in code_blocks("docs/extending.md") if not b.fragment}
    sections = re.findall(r"^## (\d+\. .+)$", (ROOT / "docs/extending.md").read_text(), flags=re.M)
    assert len(sections) >= 10
    assert [s for s in sections if s not in programs] == []


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_INLINE_CODE = re.compile(r"`[^`]*`")


def _links(page: str) -> list[tuple[int, str]]:
    """The link targets of ``page`` outside code (a link's text may wrap over lines), with their line numbers."""
    lines, fenced = [], False
    for line in (ROOT / page).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            line = ""
        lines.append("" if fenced else _INLINE_CODE.sub(lambda m: "x" * len(m.group()), line))
    text = "\n".join(lines)
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(text)]


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of the headings of ``page``."""
    anchors, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", LINKED)
def test_relative_links_point_at_files(page: str) -> None:
    broken = []
    for number, target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        linked = (ROOT / page).parent / path if path else ROOT / page
        if not linked.exists():
            broken.append(f"{page}:{number}: {target} (no file {linked.relative_to(ROOT)})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
            broken.append(f"{page}:{number}: {target} (no heading #{anchor} in {linked.name})")
    assert broken == []


def test_readme_links_every_guide() -> None:
    targets = {target.partition("#")[0] for _, target in _links("README.md")}
    expected = {"docs/architecture.md", "docs/extending.md", *GUIDES[1:]}
    assert expected - targets == set()


def _tail(text: str | bytes | None, limit: int = 6000) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return (text or "")[-limit:]
