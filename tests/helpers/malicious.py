"""What a malicious checkpoint holds: the pieces the security and bad-file tests plant in real files."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any


class RunsShell:
    """Unpickling this runs a shell command (``touch marker``): what a malicious checkpoint does.

    A test plants it, loads the file, and asserts that ``marker`` does not exist.
    """

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def metadata_with_shard_name(folder: Path, name: str) -> None:
    """Rewrite the ``.metadata`` of the sharded checkpoint ``folder`` so that every shard is ``name``.

    With ``name`` outside the folder (``../x.distcp``, an absolute path), a reader that trusted it would
    open a file the checkpoint does not own.
    """
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own folder, written moments ago by the test
    for info in metadata.storage_data.values():
        info.relative_path = name
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
