"""What the loader fuzzer (tests/reliability/test_fuzz_loaders.py) shares: valid files, ways to damage them, and checks.

Valid files are small and made fresh (``make_*``); damage is drawn by hypothesis strategies over the
bytes or the structure of a file (``*_damage``), applied in memory and written to a new path; the
checks are what every load of a damaged file must keep (:class:`Workspace` for "nothing outside the
target is touched", :func:`rss_growth_mib` for the memory bound, :func:`state_of` for "a refused load
changes nothing").
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
from hypothesis import strategies as st
from torch import nn

from trainer_core import LightningModule

#: Examples per kind; ``make stress`` sets thousands. Kinds that cost more per example take a fraction.
FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))
#: The hypothesis seed of every fuzz test; a failure replays with the same FUZZ_SEED (and FUZZ_EXAMPLES).
FUZZ_SEED = int(os.environ.get("FUZZ_SEED", "28"))
#: What a load may add to the process's peak memory: far below any inflated size the fuzzer writes
#: (2**40-byte tensors, 2**63-long shapes), far above what a tiny checkpoint needs.
MEMORY_BOUND_MIB = 256

# ---------------------------------------------------------------------- the module the files are made from


class TinyModule(LightningModule):
    """Two linear layers and Adam: a checkpoint of it has weights, hyper-parameters and optimizer state."""

    def __init__(self, hidden: int = 3, lr: float = 0.1, name: str = "tiny") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def state_of(module: nn.Module, optimizer: Any = None) -> tuple[dict[str, torch.Tensor], Any]:
    """A copy of the module's tensors and of the optimizer's state, to compare after a refused load."""
    tensors = {name: value.detach().clone() for name, value in module.state_dict().items()}
    return tensors, copy.deepcopy(optimizer.state_dict()) if optimizer is not None else None


def same_state(before: tuple[dict[str, torch.Tensor], Any], module: nn.Module, optimizer: Any = None) -> bool:
    tensors, optimizer_state = before
    now = module.state_dict()
    if now.keys() != tensors.keys():
        return False
    if not all(
        torch.equal(a.view(torch.uint8), now[k].detach().view(torch.uint8)) for k, a in tensors.items()
    ):
        return False
    return optimizer is None or _same_tree(optimizer_state, optimizer.state_dict())


def _same_tree(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return a == b


# ---------------------------------------------------------------------- where a damaged file is loaded


class Workspace:
    """A folder for one damaged target, with an unrelated file and a symlink to a folder outside beside it.

    :meth:`snapshot` records every name, size and byte under the folder and under the symlink's target
    (links recorded as links, never followed inside the folder): a load must leave both as they were.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder = root / "work"
        self.outside = root / "outside"
        self.folder.mkdir(parents=True)
        self.outside.mkdir()
        (self.outside / "keep.txt").write_bytes(b"another run's file")
        (self.folder / "unrelated.txt").write_bytes(b"a model card")
        (self.folder / "link").symlink_to(self.outside, target_is_directory=True)

    def snapshot(self) -> dict[str, Any]:
        return {**_tree(self.folder, "work"), **_tree(self.outside, "outside")}

    def clear(self, keep: tuple[str, ...] = ("unrelated.txt", "link")) -> None:
        """Remove the previous example's target (our own names only), keeping the planted neighbours."""
        for entry in self.folder.iterdir():
            if entry.name in keep:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def _tree(folder: Path, label: str) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(dirnames + filenames):
            path = Path(dirpath) / name
            key = f"{label}/{path.relative_to(folder)}"
            if path.is_symlink():
                found[key] = ("link", os.readlink(path))
            elif path.is_file():
                found[key] = ("file", path.read_bytes())
            else:
                found[key] = ("dir",)
    return found


def rss_peak_mib() -> float:
    """The process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------- damage to bytes


class Damaged(bytes):
    """Damaged file contents that say how they were damaged: hypothesis prints this, not the bytes."""

    how: str

    def __new__(cls, data: bytes, how: str) -> Damaged:
        made = super().__new__(cls, data)
        made.how = how
        return made

    def __repr__(self) -> str:
        return f"<{self.how}: {len(self)} bytes>"


@st.composite
def byte_damage(draw: Any, data: bytes, start: int = 0, end: int | None = None) -> bytes:
    """``data`` with bytes in ``[start, end)`` flipped, replaced, inserted or cut, or the whole truncated."""
    end = len(data) if end is None else end
    kind = draw(st.sampled_from(["flip", "replace", "truncate", "insert", "zero_run"]))
    if kind == "truncate" or end <= start:
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        return Damaged(data[:at], f"truncated at {at} of {len(data)}")
    buf = bytearray(data)
    if kind == "flip":
        flips = []
        for _ in range(draw(st.integers(1, 8))):
            at, mask = draw(st.integers(start, end - 1)), draw(st.integers(1, 255))
            buf[at] ^= mask
            flips.append((at, mask))
        how = f"bytes xor-ed (offset, mask) {flips}"
    elif kind == "replace":
        at = draw(st.integers(start, end - 1))
        new = draw(st.binary(min_size=1, max_size=16))[: end - at]
        buf[at : at + len(new)] = new
        how = f"{new!r} written at {at}"
    elif kind == "insert":
        at = draw(st.integers(start, end))
        new = draw(st.binary(min_size=1, max_size=16))
        buf[at:at] = new
        how = f"{new!r} inserted at {at}"
    else:
        at, n = draw(st.integers(start, end - 1)), draw(st.integers(1, 64))
        buf[at : at + n] = b""  # a run of bytes missing from the middle
        how = f"{n} bytes cut at {at}"
    return Damaged(bytes(buf), how)


def zip_members(data: bytes) -> dict[str, tuple[int, int]]:
    """Each member of the (stored, uncompressed) zip ``data`` -> the byte range of its data in ``data``."""
    import io

    ranges = {}
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        for info in archive.infolist():
            name_len, extra_len = struct.unpack(
                "<HH", data[info.header_offset + 26 : info.header_offset + 30]
            )
            begin = info.header_offset + 30 + name_len + extra_len
            ranges[info.filename] = (begin, begin + info.compress_size)
    return ranges


@st.composite
def zip_member_damage(draw: Any, data: bytes) -> bytes:
    """``data`` (a torch zip) with one member's bytes damaged in place (the zip's own structure stays)."""
    members = zip_members(data)
    name = draw(st.sampled_from(sorted(members)))
    begin, end = members[name]
    if end <= begin:
        return Damaged(data, f"zip member {name} is empty: unchanged")
    buf = bytearray(data)
    flips = []
    for _ in range(draw(st.integers(1, 4))):
        at, mask = draw(st.integers(begin, end - 1)), draw(st.integers(1, 255))
        buf[at] ^= mask
        flips.append((at, mask))
    return Damaged(bytes(buf), f"zip member {name}: bytes xor-ed (offset, mask) {flips}")


# ---------------------------------------------------------------------- damage to structure

#: Values a swapped-in leaf takes: each other type, empty and huge, negative and non-finite.
HOSTILE_PY = [
    None,
    [],
    {},
    "",
    "x",
    0,
    -1,
    1.5,
    True,
    2**64,
    -(2**63) - 1,
    10**30,
    math.nan,
    math.inf,
    -math.inf,
]
HOSTILE_PY += [[1, 2], {"a": 1}, b"\x00bytes", torch.zeros(0), torch.zeros(3, dtype=torch.int64)]
#: The same as JSON/YAML text, and sizes past any float (1e309) or any integer a reader's C types hold.
HOSTILE_TEXT = ["null", "[]", "{}", '""', '"x"', "0", "-1", "1.5", "true", "18446744073709551616"]
HOSTILE_TEXT += ["-9223372036854775809", "1e309", "-1e309", "NaN", "Infinity", "[1, 2]", '{"a": 1}', "1e400"]
HOSTILE_TEXT += ["99999999999999999999999999999999999999", "-99999999999", ".nan", ".inf"]
# Past Python's recursion limit (1,000) and the loaders' nesting bound (100); mostly shallower ones,
# since a 10^5-deep pickle costs about 0.3 s to load.
DEEP = st.sampled_from([1_500, 3_000, 10_000, 30_000, 100_000])


def paths_of(tree: Any, limit: int = 400) -> list[tuple[Any, ...]]:
    """Paths (keys and indexes) to every node of a dict/list tree, the root excluded, breadth first."""
    found: list[tuple[Any, ...]] = []
    queue: list[tuple[tuple[Any, ...], Any]] = [((), tree)]
    while queue and len(found) < limit:
        path, node = queue.pop(0)
        children = (
            node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        )
        for key, child in children:
            found.append((*path, key))
            queue.append(((*path, key), child))
    return found


def replaced(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    """A copy of ``tree`` with the node at ``path`` replaced by ``value`` (tensors are shared, not copied)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, dict):
        return {**tree, head: replaced(tree[head], rest, value)}
    copied = list(tree)
    copied[head] = replaced(tree[head], rest, value)
    return copied


@st.composite
def value_swap(draw: Any, tree: Any) -> Damaged:
    """``tree`` (a Python checkpoint) saved by torch with one node, drawn anywhere, replaced by a hostile value."""
    path = draw(st.sampled_from(paths_of(tree)))
    value = draw(st.sampled_from(HOSTILE_PY))
    return Damaged(
        torch_bytes(replaced(tree, path, value)),
        f"torch.save of the checkpoint with {list(path)} = {value!r}",
    )


@st.composite
def json_text_swap(draw: Any, tree: Any, dumps: Callable[[Any], str] = json.dumps) -> Damaged:
    """``tree`` as JSON (or ``dumps``) text with one node replaced by hostile text, deep nesting included."""
    marker = "__fuzz_marker__"
    path = draw(st.sampled_from(paths_of(tree)))
    text = dumps(replaced(tree, path, marker))
    kind = draw(st.sampled_from(["value", "value", "deep_list", "deep_dict"]))
    if kind == "value":
        hostile = draw(st.sampled_from(HOSTILE_TEXT))
        how = f"{list(path)} = {hostile}"
    else:
        n = draw(DEEP)
        hostile = "[" * n + "]" * n if kind == "deep_list" else '{"a": ' * n + "1" + "}" * n
        how = f"{list(path)} = a {'list' if kind == 'deep_list' else 'dict'} nested {n} deep"
    spelled = json.dumps(marker) if dumps is json.dumps else marker
    return Damaged(text.replace(spelled, hostile, 1).encode(), how)


def deep_pickle_list(depth: int) -> bytes:
    """Pickle opcodes for a list nested ``depth`` deep, built without recursion (torch.save cannot write it)."""
    return b"]" * depth + b"a" * (depth - 1)


def with_deep_value(torch_file: bytes, placeholder: str, depth: int) -> bytes:
    """The torch zip ``torch_file`` whose string value ``placeholder`` becomes a list nested ``depth`` deep.

    The member data.pkl is rewritten: the BINUNICODE opcode of the placeholder is swapped for the
    nested list's opcodes (the pickle's memo indexes are unaffected: none refers past the swap).
    """
    import io

    source = zipfile.ZipFile(io.BytesIO(torch_file))
    out = io.BytesIO()
    encoded = placeholder.encode()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            if info.filename.endswith("data.pkl"):
                opcode = b"X" + struct.pack("<I", len(encoded)) + encoded
                assert opcode in data, "the placeholder is not in the pickle"
                data = data.replace(opcode, deep_pickle_list(depth), 1)
            target.writestr(info.filename, data)
    return out.getvalue()


def torch_bytes(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it (a zip)."""
    import io

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def describe(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__name__}: {str(exc)[:600]}"
