"""The one place that turns a user's path or URL into a filesystem and a path on it.

Every user path (checkpoint folders, ``default_root_dir``, logger folders) is an fsspec URL: a
local path, ``file://``, ``memory://``, ``s3://``. Nothing else in the package calls ``os.path``
on a user path, so a remote URL works wherever a local one does.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import fsspec

PathLike = Union[str, "os.PathLike[str]"]


def resolve(url: PathLike, **storage_options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """Return ``(filesystem, path)`` for ``url``; a local path comes back absolute."""
    # Imported on first use: fsspec costs ``import trainer_core`` more than the rest of it.
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(os.fspath(url), **storage_options)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk, where rename is atomic and fsync means something."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


def join(url: PathLike, *parts: str) -> str:
    """Join ``parts`` onto ``url`` with ``/``, keeping the URL's protocol."""
    base = os.fspath(url).rstrip("/")
    return "/".join([base, *(p.strip("/") for p in parts)])
