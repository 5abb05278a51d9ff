"""Hyper-parameters from files a user did not write: one clear error each, in bounded time and memory.

``load_from_checkpoint(hparams_file=...)`` reads YAML (or its JSON subset) and Lightning's ``.csv``;
each way such a file can be wrong (nested 100,000 deep, a "billion laughs" of YAML aliases, not a
mapping, too big, binary, not UTF-8) is one ``MisconfigurationException`` naming the file, the type
``hparams_file`` errors already had. A checkpoint's own ``hyper_parameters`` that are not a mapping,
or that nest too deep, contain themselves or unfold through shared references to billions of entries
(a crafted pickle), are one ``CheckpointError`` naming the file, from ``load_from_checkpoint``,
``fit(ckpt_path=...)`` and ``inspect`` alike, and ``fit`` leaves the model as it was. A class of the
user's own in the hyper-parameters loads once registered, as the error says, dict and list
subclasses included.
"""

from __future__ import annotations

import re
import struct
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from boring import fast_trainer, random_loader
from torch import nn

from trainer_core import LightningDataModule, LightningModule
from trainer_core.checkpoint import format as ckpt_format
from trainer_core.checkpoint.cli import main as checkpoint_cli
from trainer_core.errors import CheckpointError, MisconfigurationException

DEEP = 100_000


class Net(LightningModule):
    def __init__(self, hidden: int = 4, lr: float = 0.1, cfg: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = nn.Linear(3, hidden)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.layer(batch[0]).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of ``Net(hidden=4, lr=0.1)`` after one step."""
    trainer = fast_trainer(max_steps=1)
    trainer.fit(Net(), random_loader(8, features=3, batch_size=4))
    path = tmp_path_factory.mktemp("hparams") / "net.ckpt"
    trainer.save_checkpoint(path)
    return path


# ---------------------------------------------------------------------- hparams_file
def _billion_laughs() -> str:
    """Nine levels of ten aliases of the level below: 200 bytes of YAML, 10**9 strings unfolded."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, 10):
        aliases = ", ".join([f"*a{level - 1}"] * 10)
        lines.append(f"a{level}: &a{level} [{aliases}]")
    return "\n".join(lines) + "\n"


BAD_FILES = [
    # (file name, content, what the message says)
    ("flow_list.yaml", "[" * DEEP + "]" * DEEP, "nests too deeply"),
    ("flow_map.yaml", "lr: " + "{a: " * DEEP + "1" + "}" * DEEP, "nests too deeply"),
    ("block_list.yaml", "lr:\n  " + "- " * DEEP + "1\n", "nests too deeply"),
    ("json_style.yaml", '{"lr": ' + '{"a": ' * DEEP + "1" + "}" * DEEP + "}", "nests too deeply"),
    ("parsed_but_deep.yaml", "lr: " + "[" * 150 + "]" * 150, "nests containers more than 100 deep"),
    ("billion_laughs.yaml", _billion_laughs(), r"unfolds to [\d,]{13,} entries"),
    ("deep_cell.csv", 'key,value\nlr,"' + "[" * 300 + "]" * 300 + '"\n', "value of 'lr' nests too deeply"),
    ("huge_cell.csv", 'key,value\nlr,"' + "[" * DEEP + "]" * DEEP + '"\n', "field larger than field limit"),
    ("three_cells.csv", "key,value\nlr,0.1,extra\n", r"\['lr', '0.1', 'extra'\] has 3 cells"),
    ("a_list.yaml", "[1, 2]", "holds a list"),
    ("a_string.yaml", "just text", "holds a str"),
    ("an_int.yaml", "3", "holds a int"),
    ("number_keys.yaml", "1: 2\n", r"maps 1 \(int\) to a value"),
    ("huge.yaml", "lr: 0.1\n" + "# padding\n" * 110_000, "larger than 1 MiB"),
    ("latin1.yaml", "lr: caf\xe9\n".encode("latin-1"), r"not UTF-8 text \(byte 7 is b'\\xe9'\)"),
    ("binary.yaml", bytes(range(256)) * 4, "not UTF-8 text"),
    ("nul.yaml", b"lr: 0.1\x00\x01\x02", "is not YAML that safe_load reads"),
]


@pytest.mark.parametrize(("name", "content", "match"), BAD_FILES, ids=[case[0] for case in BAD_FILES])
def test_a_bad_hparams_file_is_one_clear_error_naming_it(
    checkpoint: Path, tmp_path: Path, name: str, content: Any, match: str
) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)

    started = time.perf_counter()
    with pytest.raises(MisconfigurationException, match=re.escape(str(path)) + ".*" + match):
        Net.load_from_checkpoint(checkpoint, hparams_file=path)
    # Bounded, not fast: an unbounded parse takes minutes; a loaded 2-core CI machine can take a few seconds.
    assert time.perf_counter() - started < 20


@pytest.mark.parametrize(
    "content",
    ['{"lr": ' + "[" * DEEP + "]" * DEEP + "}", '{"lr": ' + "[" * 150 + "]" * 150 + "}"],
    ids=["100000-deep", "150-deep"],
)
def test_deep_json_without_pyyaml_is_one_clear_error(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: str
) -> None:
    path = tmp_path / "hparams.yaml"
    path.write_text(content)
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` fails, as without PyYAML
    with pytest.raises(MisconfigurationException, match=re.escape(str(path)) + ".*nests"):
        Net.load_from_checkpoint(checkpoint, hparams_file=path)


def test_a_folder_as_hparams_file_is_refused(checkpoint: Path, tmp_path: Path) -> None:
    folder = tmp_path / "hparams.yaml"
    folder.mkdir()
    with pytest.raises(MisconfigurationException, match=re.escape(str(folder)) + ".* is a folder"):
        Net.load_from_checkpoint(checkpoint, hparams_file=folder)


def test_a_good_hparams_file_with_shared_anchors_still_loads(checkpoint: Path, tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = tmp_path / "hparams.yaml"
    path.write_text("lr: 0.5\ncfg:\n  base: &base {width: 2}\n  head: *base\n")
    model = Net.load_from_checkpoint(checkpoint, hparams_file=path)
    assert model.hparams.lr == 0.5
    assert model.hparams.cfg == {"base": {"width": 2}, "head": {"width": 2}}


# ---------------------------------------------------------------------- the checkpoint's own hyper_parameters
def _with_hparams(checkpoint: Path, out: Path, hparams: Any) -> Path:
    torch.save({**torch.load(checkpoint, weights_only=True), "hyper_parameters": hparams}, out)
    return out


@pytest.mark.parametrize("hparams", [[1, 2], "lr=0.1", 3, {1: 2}], ids=["list", "str", "int", "int-key"])
def test_hyper_parameters_that_are_not_a_mapping_are_one_clear_error(
    checkpoint: Path, tmp_path: Path, hparams: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _with_hparams(checkpoint, tmp_path / "bad.ckpt", hparams)
    match = re.escape(str(path)) + r" has an invalid 'hyper_parameters'.*expected a dict of hyper-parameters"

    with pytest.raises(CheckpointError, match=match):
        Net.load_from_checkpoint(path)

    model = Net()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    trainer = fast_trainer(max_steps=2)
    with pytest.raises(CheckpointError, match=match):
        trainer.fit(model, random_loader(8, features=3, batch_size=4), ckpt_path=str(path))
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())

    assert checkpoint_cli(["inspect", str(path)]) == 2
    assert re.search(match, capsys.readouterr().err)


def _with_raw_hparams(checkpoint: Path, out: Path, raw: bytes) -> Path:
    """``checkpoint`` whose ``hyper_parameters["cfg"]`` is the object the pickle opcodes ``raw`` build.

    What torch.save cannot write (it recurses, or keeps shared references shared) is written as
    opcodes into the archive's ``data.pkl``, in place of a placeholder string.
    """
    marker = "PLACEHOLDER-FOR-RAW-OPCODES"
    source = _with_hparams(checkpoint, out.with_suffix(".source"), {"cfg": marker})
    encoded = marker.encode()
    opcode = b"X" + struct.pack("<I", len(encoded)) + encoded  # BINUNICODE
    with zipfile.ZipFile(source) as archive, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for info in archive.infolist():
            data = archive.read(info.filename)
            if info.filename.endswith("data.pkl"):
                assert opcode in data
                data = data.replace(opcode, raw)
            rewritten.writestr(info, data)
    source.unlink()
    return out


def _memo(op: bytes, index: int) -> bytes:
    return op + struct.pack("<I", 10_000 + index)  # indices far above those torch.save used


def _laughs(levels: int) -> bytes:
    """A tuple of lists, each of ten references to the one before: the last unfolds to about 10**levels entries."""
    raw = b"(]" + _memo(b"r", 0)  # MARK, EMPTY_LIST, LONG_BINPUT
    for level in range(1, levels + 1):
        raw += b"](" + _memo(b"j", level - 1) * 10 + b"e" + _memo(b"r", level)  # LONG_BINGETs, APPENDS
    return raw + b"t"  # TUPLE: every level, from the MARK


RAW_HPARAMS = [
    # (id, opcodes, what the message says)
    ("100000-deep", b"]" * DEEP + b"a" * (DEEP - 1), "nests containers more than 100 deep"),
    ("contains-itself", b"]" + _memo(b"r", 0) + _memo(b"j", 0) + b"a", "contains itself"),
    ("billion-laughs", _laughs(9), r"unfolds to [\d,]{13,} entries"),
]


@pytest.mark.parametrize(
    ("raw", "match"), [case[1:] for case in RAW_HPARAMS], ids=[c[0] for c in RAW_HPARAMS]
)
def test_crafted_hyper_parameters_are_one_clear_error(
    checkpoint: Path, tmp_path: Path, raw: bytes, match: str
) -> None:
    path = _with_raw_hparams(checkpoint, tmp_path / "crafted.ckpt", raw)
    model = Net()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    started = time.perf_counter()
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + " .*" + match):
        Net.load_from_checkpoint(path)
    trainer = fast_trainer(max_steps=2)
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + " .*" + match):
        trainer.fit(model, random_loader(8, features=3, batch_size=4), ckpt_path=str(path))
    assert time.perf_counter() - started < 10
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


def test_shared_references_within_bounds_load(checkpoint: Path, tmp_path: Path) -> None:
    """Sharing is not refused as such: three levels of ten (about 1,000 entries) load, still shared."""
    model = Net.load_from_checkpoint(_with_raw_hparams(checkpoint, tmp_path / "shared.ckpt", _laughs(3)))
    levels = model.hparams.cfg
    assert len(levels) == 4 and len(levels[3]) == 10
    assert levels[3][0] is levels[3][9] is levels[2] and levels[1][0] is levels[0]


# ---------------------------------------------------------------------- classes of the user's own
@dataclass
class MyConfig:
    width: int
    layers: list


class MyDict(dict):
    pass


class MyList(list):
    pass


def _follow_the_advice(error: CheckpointError, cls: type) -> None:
    """Do literally what the message says: call the function it names with the class it names."""
    message = str(error)
    assert f"{cls.__module__}.{cls.__qualname__}" in message
    called = re.search(r"register it with (trainer_core\.checkpoint\.register_safe_globals)", message)
    assert called is not None, message
    module, function = called.group(1).rsplit(".", 1)
    getattr(sys.modules[module], function)(cls)


@pytest.mark.parametrize(
    ("value", "check"),
    [
        (MyConfig(width=3, layers=[4, 4]), lambda loaded: loaded == MyConfig(width=3, layers=[4, 4])),
        (MyDict(width=3), lambda loaded: type(loaded) is MyDict and loaded == {"width": 3}),
        (MyList([1, 2]), lambda loaded: type(loaded) is MyList and loaded == [1, 2]),
    ],
    ids=["dataclass", "dict-subclass", "list-subclass"],
)
def test_a_class_of_the_users_own_loads_once_registered_as_the_error_says(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: Any, check: Any
) -> None:
    monkeypatch.setattr(ckpt_format, "_user_safe_globals", [])
    path = _with_hparams(checkpoint, tmp_path / "own.ckpt", {"hidden": 4, "lr": 0.1, "cfg": value})

    with pytest.raises(CheckpointError, match=re.escape(str(path))) as error:
        Net.load_from_checkpoint(path)
    _follow_the_advice(error.value, type(value))

    model = Net.load_from_checkpoint(path)
    assert check(model.hparams.cfg)


class WithAttribute(dict):
    pass


def test_a_class_that_cannot_be_rebuilt_is_not_advised_to_be_registered(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dict subclass with attributes of its own: registering cannot help, and the error says what does."""
    monkeypatch.setattr(ckpt_format, "_user_safe_globals", [])
    value = WithAttribute(width=3)
    value.note = "kept in __dict__"
    path = _with_hparams(checkpoint, tmp_path / "attr.ckpt", {"cfg": value})
    with pytest.raises(CheckpointError) as error:
        Net.load_from_checkpoint(path)
    _follow_the_advice(error.value, WithAttribute)

    with pytest.raises(
        CheckpointError, match=re.escape(str(path)) + ".*even when its class is registered"
    ) as again:
        Net.load_from_checkpoint(path)
    assert "register_safe_globals" not in str(again.value) and "plain values" in str(again.value)


def test_no_hyper_parameters_at_all_loads(checkpoint: Path, tmp_path: Path) -> None:
    model = Net.load_from_checkpoint(_with_hparams(checkpoint, tmp_path / "none.ckpt", None))
    assert model.hparams.hidden == 4


def test_another_modules_hparams_as_a_hyper_parameter_round_trips(tmp_path: Path) -> None:
    """``Net(cfg=other.hparams)``: trainer-core's own ``AttributeDict`` in the file loads back as one."""
    from trainer_core.utilities import AttributeDict

    trainer = fast_trainer(max_steps=1)
    trainer.fit(Net(cfg=Net(hidden=2).hparams), random_loader(8, features=3, batch_size=4))
    path = tmp_path / "nested.ckpt"
    trainer.save_checkpoint(path)

    cfg = Net.load_from_checkpoint(path).hparams.cfg
    assert type(cfg) is AttributeDict and cfg.hidden == 2 and cfg.lr == 0.1


@pytest.mark.parametrize("source", ["checkpoint", "hparams_file"])
def test_a_hyper_parameter_the_module_refuses_is_one_clear_error(
    checkpoint: Path, tmp_path: Path, source: str
) -> None:
    """``nn.Linear(3, -1)`` raises a RuntimeError inside ``__init__``: it reaches the user as a CheckpointError."""
    if source == "checkpoint":
        path, kwargs = _with_hparams(checkpoint, tmp_path / "negative.ckpt", {"hidden": -1, "lr": 0.1}), {}
    else:
        hparams = tmp_path / "hparams.csv"
        hparams.write_text("key,value\nhidden,-1\n")
        path, kwargs = checkpoint, {"hparams_file": hparams}
    with pytest.raises(
        CheckpointError, match=re.escape(str(path)) + r"\) failed: RuntimeError: .*negative dimension"
    ):
        Net.load_from_checkpoint(path, **kwargs)


class Data(LightningDataModule):
    def __init__(self, width: int = 2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.projection = nn.Linear(3, width)  # refuses a negative width with a RuntimeError


def test_a_hyper_parameter_the_data_module_refuses_is_one_clear_error(
    checkpoint: Path, tmp_path: Path
) -> None:
    """The data module's ``__init__`` raising (not only a ``TypeError`` for a missing argument) is a CheckpointError."""
    stored = torch.load(checkpoint, weights_only=True)
    stored["datamodule_hyper_parameters"] = {"width": -1}
    path = tmp_path / "datamodule.ckpt"
    torch.save(stored, path)
    with pytest.raises(
        CheckpointError, match=re.escape(str(path)) + r"\) failed: RuntimeError: .*negative dimension"
    ):
        Data.load_from_checkpoint(path)
    stored["datamodule_hyper_parameters"] = {"width": 5}
    torch.save(stored, path)
    assert Data.load_from_checkpoint(path).projection.out_features == 5
