"""A fuzzer over every loader: damaged copies of valid files of each kind trainer-core reads.

From small valid files made once per module (a torch checkpoint, a sharded DCP folder, a PyTorch
Lightning ``.ckpt``, a safetensors file and a sharded safetensors folder with its index, a frozen-blob
checkpoint with its blobs and refs, ``hparams.yaml``/``.csv``, the CLI's YAML config), hypothesis draws
damage: bytes flipped, replaced, inserted or cut (in the file, in one zip member, in a JSON header),
truncation, a value anywhere swapped for another type (list, dict, str, int, null, NaN, 1e309, 2**64,
negative), nesting 1,500 to 10^5 deep, inflated sizes and offsets, files of a folder deleted, duplicated or
renamed. Each damaged copy is loaded through the user-facing API, and every load must:

* load, or end in the project's one error type for that kind of file, whose message names the file
  (or its folder): ``CheckpointError`` for checkpoints and weights; ``MisconfigurationException`` for an
  ``hparams_file`` (or ``CheckpointError`` naming the checkpoint when its values do not fit the
  module); for the CLI's ``--config``, argparse's exit (``SystemExit(2)``) with an ``error:`` line that
  names the config file, never a traceback;
* leave the module (and the optimizer, in ``fit``) bit-equal to before when it refuses;
* write and delete nothing: the folder of the target (with an unrelated file and a symlink to a folder
  outside planted beside it) and that outside folder are the same, name for name and byte for byte;
* stay within a memory bound: the process's peak RSS grows by less than ``MEMORY_BOUND_MIB``.

Size and replay: ``FUZZ_EXAMPLES`` examples per kind (200 by default; ``make stress`` sets thousands;
costlier kinds run a fraction), all drawn from ``FUZZ_SEED`` (28 by default), which the test output
prints. A failure replays with the same two variables, e.g.
``FUZZ_SEED=28 FUZZ_EXAMPLES=150 .venv/bin/python -m pytest -p no:cacheprovider
tests/reliability/test_fuzz_loaders.py -k safetensors_file``; hypothesis also prints the failing
example (each says how it damaged the file) and a ``@reproduce_failure`` blob (``print_blob``);
``FUZZ_SHRINK=1`` shrinks a failure to a smaller one (minutes). Nothing is stored between runs (no
example database), so a run depends on the seed alone.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import yaml
from boring import quiet_trainer, random_loader
from fuzz import (
    DEEP,
    FUZZ_EXAMPLES,
    FUZZ_SEED,
    MEMORY_BOUND_MIB,
    Damaged,
    TinyModule,
    Workspace,
    byte_damage,
    describe,
    json_text_swap,
    rss_peak_mib,
    same_state,
    state_of,
    torch_bytes,
    value_swap,
    with_deep_value,
    zip_member_damage,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from trainer_core import seed_everything
from trainer_core.checkpoint import load_safetensors, save_safetensors
from trainer_core.checkpoint.cli import inspect_checkpoint
from trainer_core.checkpoint.cli import main as checkpoint_cli
from trainer_core.checkpoint.format import KEY_FROZEN_PARAMETERS
from trainer_core.errors import CheckpointError, MisconfigurationException
from trainer_core.loggers import CSVLogger
from trainer_core.plugins.io import DistributedCheckpointIO, TorchCheckpointIO
from trainer_core.plugins.io.frozen_io import FrozenBlobCheckpointIO

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
    pytest.mark.timeout(600),
]


def fuzz_settings(fraction: float = 1.0) -> Callable[[Any], Any]:
    """Hypothesis settings of every fuzz test: the seed, ``FUZZ_EXAMPLES`` (times ``fraction``), no deadline."""

    def apply(test: Any) -> Any:
        test = settings(
            max_examples=max(10, int(FUZZ_EXAMPLES * fraction)),
            deadline=None,
            database=None,
            # Shrinking a failure costs minutes; each example already says how it was damaged.
            phases=[
                Phase.explicit,
                Phase.generate,
                *([Phase.shrink] if os.environ.get("FUZZ_SHRINK") else []),
            ],
            print_blob=True,
            suppress_health_check=[
                HealthCheck.too_slow,
                HealthCheck.function_scoped_fixture,
                HealthCheck.data_too_large,
                HealthCheck.large_base_example,
            ],
        )(test)
        return hypothesis_seed(FUZZ_SEED)(test)

    return apply


# ---------------------------------------------------------------------- valid files, made once


@pytest.fixture(scope="module")
def valid(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One valid file (or folder) of every kind, from one tiny trained module, and its parts in memory."""
    print(f"\nfuzz: FUZZ_SEED={FUZZ_SEED} FUZZ_EXAMPLES={FUZZ_EXAMPLES} (set both to replay a failure)")
    folder = tmp_path_factory.mktemp("valid")
    seed_everything(0, verbose=False)
    model = TinyModule()
    trainer = quiet_trainer(max_steps=2)
    trainer.fit(model, random_loader(8, 2, batch_size=4))
    trainer.save_checkpoint(folder / "model.ckpt")
    checkpoint = torch.load(folder / "model.ckpt", weights_only=True)

    DistributedCheckpointIO().save_checkpoint(checkpoint, str(folder / "sharded"))
    lightning = {
        "epoch": 0,
        "global_step": 2,
        "pytorch-lightning_version": "2.6.6",
        "state_dict": checkpoint["state_dict"],
        "loops": {},
        "callbacks": {},
        "optimizer_states": [trainer.optimizers[0].state_dict()],
        "lr_schedulers": [],
        "hparams_name": "kwargs",
        "hyper_parameters": {"hidden": 3, "lr": 0.1, "name": "tiny"},
    }
    save_safetensors(model.state_dict(), folder / "weights")
    save_safetensors(model.state_dict(), folder / "weights_sharded", max_shard_size=24)
    frozen_dir = folder / "frozen"
    frozen_dir.mkdir()
    FrozenBlobCheckpointIO().save_checkpoint(
        {**checkpoint, KEY_FROZEN_PARAMETERS: ["net.0.weight", "net.0.bias", "net.2.weight"]},
        str(frozen_dir / "frozen.ckpt"),
    )
    logger = CSVLogger(str(folder / "logs"), name="", version="")
    logger.log_hyperparams(dict(model.hparams))
    logger.save()
    hparams_yaml = next((folder / "logs").rglob("hparams.yaml"))
    cli_config = {
        "seed_everything": 1,
        "trainer": {"max_steps": 1, "logger": False, "enable_checkpointing": False, "precision": "32-true"},
        "model": {"hidden": 3, "lr": 0.1, "name": "tiny"},
    }
    return {
        "folder": folder,
        "checkpoint": checkpoint,
        "torch_file": (folder / "model.ckpt").read_bytes(),
        "sharded": folder / "sharded",
        "lightning": lightning,
        "lightning_file": torch_bytes(lightning),
        "weights_file": (folder / "weights" / "model.safetensors").read_bytes(),
        "weights_sharded": folder / "weights_sharded",
        "frozen": frozen_dir,
        "hparams_yaml": hparams_yaml.read_text(),
        "hparams": dict(model.hparams),
        "cli_config": cli_config,
    }


@pytest.fixture(scope="module")
def baseline_rss(valid: dict[str, Any]) -> float:
    return rss_peak_mib()


@pytest.fixture
def place(tmp_path: Path) -> Iterator[Callable[[], Workspace]]:
    """A fresh :class:`Workspace` per example (hypothesis runs many examples in one test call)."""
    made: list[str] = []

    def new() -> Workspace:
        root = tempfile.mkdtemp(dir=tmp_path)
        made.append(root)
        return Workspace(Path(root))

    yield new
    for root in made:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------------- the rule every load keeps


def check_load(
    ws: Workspace,
    load: Callable[[], Any],
    names: list[str],
    errors: tuple[type[BaseException], ...],
    baseline_rss: float,
    unchanged: Callable[[], bool] = lambda: True,
) -> bool:
    """Run ``load``: it loads, or raises one of ``errors`` naming one of ``names`` and ``unchanged()`` holds.

    Returns whether it loaded. Then nothing in the workspace changed and the memory stayed in bound.
    """
    before = ws.snapshot()
    loaded = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load()
        loaded = True
    except errors as err:
        message = str(err)
        assert any(name in message for name in names), f"the error does not name {names}: {describe(err)}"
        assert unchanged(), f"a refused load changed the module or the optimizer: {describe(err)}"
    except Exception as err:
        raise AssertionError(
            f"a raw error instead of {[e.__name__ for e in errors]}: {describe(err)}"
        ) from err
    assert ws.snapshot() == before, "the load wrote or deleted something beside its target"
    grown = rss_peak_mib() - baseline_rss
    assert grown < MEMORY_BOUND_MIB, f"peak memory grew by {grown:.0f} MiB"
    return loaded


def _checkpoint_loads(
    ws: Workspace, path: Path, baseline_rss: float, data: Any, names: list[str] | None = None
) -> None:
    """A checkpoint file or folder through one of the IO, ``load_from_checkpoint``, ``inspect_checkpoint`` and
    the ``inspect`` command, drawn per example: every loader sees a share of the examples, at a quarter of
    the cost of all four on each."""
    names = names or [str(path)]
    loaders: dict[str, tuple[Callable[[], Any], tuple[type[BaseException], ...]]] = {
        "TorchCheckpointIO": (lambda: TorchCheckpointIO().load_checkpoint(str(path)), (CheckpointError,)),
        "load_from_checkpoint": (lambda: TinyModule.load_from_checkpoint(str(path)), (CheckpointError,)),
        "inspect_checkpoint": (lambda: inspect_checkpoint(str(path)), (CheckpointError,)),
        "inspect command": (lambda: _inspect_command(path), (_CliRefused,)),
    }
    load, errors = loaders[data.draw(st.sampled_from(sorted(loaders)), label="loader")]
    check_load(ws, load, names, errors, baseline_rss)


def _inspect_command(path: Path) -> None:
    """``python -m trainer_core.checkpoint inspect PATH``, in this process: status 0, or 2 and an error line."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = checkpoint_cli(["inspect", str(path)])
    if status != 0:
        assert status == 2, (status, err.getvalue())
        raise _CliRefused(err.getvalue())


# ---------------------------------------------------------------------- (1) a trainer-core torch file


def _torch_file_damage(valid: dict[str, Any]) -> st.SearchStrategy[bytes]:
    data = valid["torch_file"]
    checkpoint = valid["checkpoint"]
    deep = st.builds(
        lambda key, depth: Damaged(
            with_deep_value(torch_bytes({**checkpoint, key: "__fuzz_deep__"}), "__fuzz_deep__", depth),
            f"[{key!r}] = a list nested {depth} deep",
        ),
        st.sampled_from(sorted(checkpoint)),
        DEEP,
    )
    return st.one_of(byte_damage(data), zip_member_damage(data), value_swap(checkpoint), deep)


@fuzz_settings()
@given(data=st.data())
def test_torch_checkpoint_file(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    path = ws.folder / "model.ckpt"
    path.write_bytes(data.draw(_torch_file_damage(valid), label="file"))
    _checkpoint_loads(ws, path, baseline_rss, data)


# ---------------------------------------------------------------------- (2) a sharded DCP folder


@st.composite
def _folder_damage(draw: Any, source: Path, target: Path, file_damage: Callable[[str, bytes], Any]) -> str:
    """``source`` copied to ``target`` with one file damaged, deleted, duplicated or renamed; says what."""
    shutil.copytree(source, target)
    files = sorted(p.name for p in target.iterdir() if p.is_file())
    name = draw(st.sampled_from(files))
    kind = draw(st.sampled_from(["damage", "damage", "damage", "delete", "duplicate", "rename", "empty"]))
    path = target / name
    if kind == "damage":
        path.write_bytes(draw(file_damage(name, path.read_bytes())))
    elif kind == "delete":
        path.unlink()
    elif kind == "duplicate":
        shutil.copyfile(
            path,
            target
            / draw(st.sampled_from([f for f in [*files, "copy.distcp", "model-x.safetensors"] if f != name])),
        )
    elif kind == "rename":
        path.rename(
            target
            / draw(st.sampled_from([f for f in [*files, name + ".bak", "renamed.distcp"] if f != name]))
        )
    else:
        path.write_bytes(b"")
    return f"{kind} {name}"


@fuzz_settings()
@given(data=st.data())
def test_sharded_dcp_folder(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    path = ws.folder / "sharded.ckpt"
    data.draw(_folder_damage(valid["sharded"], path, lambda name, raw: byte_damage(raw)), label="change")
    check_load(
        ws,
        lambda: DistributedCheckpointIO().load_checkpoint(str(path)),
        [str(path)],
        (CheckpointError,),
        baseline_rss,
    )
    _checkpoint_loads(ws, path, baseline_rss, data)


# ---------------------------------------------------------------------- (3) a PyTorch Lightning .ckpt


@fuzz_settings()
@given(data=st.data())
def test_lightning_checkpoint(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    path = ws.folder / "lightning.ckpt"
    lightning = valid["lightning"]
    damage = st.one_of(
        byte_damage(valid["lightning_file"]),
        value_swap(lightning),
        value_swap(lightning),
    )
    path.write_bytes(data.draw(damage, label="file"))
    _checkpoint_loads(ws, path, baseline_rss, data)


# ---------------------------------------------------------------------- (4) a safetensors file


def _header_of(raw: bytes) -> tuple[dict[str, Any], bytes]:
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


@st.composite
def _safetensors_damage(draw: Any, raw: bytes) -> bytes:
    """A safetensors file with its bytes, its header's JSON values or its header length damaged."""
    header, body = _header_of(raw)
    kind = draw(st.sampled_from(["bytes", "header", "header", "header", "length", "numbers"]))
    if kind == "bytes":
        return draw(byte_damage(raw))
    if kind == "length":  # the 8-byte prefix inflated, shrunk or negative as a signed number
        length = draw(st.sampled_from([0, 1, 2**63, 2**64 - 1, 2**40, len(raw), len(raw) - 7]))
        return Damaged(length.to_bytes(8, "little") + raw[8:], f"header length prefix = {length}")
    if kind == "numbers":  # one shape or offset entry made huge, negative or non-finite
        name = draw(st.sampled_from([k for k in header if k != "__metadata__"]))
        field = draw(st.sampled_from(["shape", "data_offsets"]))
        values = list(header[name][field]) or [0]
        at = draw(st.integers(0, len(values) - 1))
        values[at] = "__fuzz_number__"
        changed = json.dumps({**header, name: {**header[name], field: values}})
        number = draw(
            st.sampled_from(
                ["-1", "-8", "1e309", "-1e309", "NaN", "Infinity", "2e19", "1099511627776", "1.5"]
            )
        )
        text = changed.replace('"__fuzz_number__"', number).encode()
        how = f"header [{name!r}][{field!r}][{at}] = {number}"
    else:
        text = draw(json_text_swap(header))
        how = f"header {text.how}"
    text += b" " * (-len(text) % 8)
    return Damaged(len(text).to_bytes(8, "little") + text + body, how)


@fuzz_settings()
@given(data=st.data())
def test_safetensors_file(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    path = ws.folder / "model.safetensors"
    path.write_bytes(data.draw(_safetensors_damage(valid["weights_file"]), label="file"))
    for strict in (True, False):
        module = TinyModule()
        before = state_of(module)
        check_load(
            ws,
            lambda: load_safetensors(module, path, strict=strict),  # noqa: B023 (called at once)
            [str(path)],
            (CheckpointError,),
            baseline_rss,
            unchanged=lambda: same_state(before, module),  # noqa: B023 (called at once)
        )


# ---------------------------------------------------------------------- (5) a sharded safetensors folder


def _weights_file_damage(name: str, raw: bytes) -> st.SearchStrategy[bytes]:
    if name.endswith(".json"):
        index = json.loads(raw)
        return st.one_of(byte_damage(raw), json_text_swap(index), json_text_swap(index))
    return _safetensors_damage(raw)


@fuzz_settings()
@given(data=st.data())
def test_sharded_safetensors_folder(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    path = ws.folder / "weights"
    data.draw(_folder_damage(valid["weights_sharded"], path, _weights_file_damage), label="change")
    module = TinyModule()
    before = state_of(module)
    check_load(
        ws,
        lambda: load_safetensors(module, path),
        [str(path)],
        (CheckpointError,),
        baseline_rss,
        unchanged=lambda: same_state(before, module),
    )


# ---------------------------------------------------------------------- (6) a frozen-blob checkpoint


@st.composite
def _frozen_damage(draw: Any, source: Path, target: Path) -> str:
    """The frozen-blob folder copied, then its checkpoint's references, a blob, or a refs list damaged."""
    shutil.copytree(source, target)
    ckpt = target / "frozen.ckpt"
    blobs = sorted((target / "blobs").iterdir(), key=lambda p: p.name)
    blobs = [p for p in blobs if p.is_file()]
    refs = sorted((target / "blobs" / "refs").glob("*.json"))
    kind = draw(st.sampled_from(["reference", "reference", "checkpoint_bytes", "blob", "blob_gone", "refs"]))
    if kind == "reference":
        checkpoint = torch.load(ckpt, weights_only=True)
        ckpt.write_bytes(torch_bytes(draw(value_swap(checkpoint))))
    elif kind == "checkpoint_bytes":
        ckpt.write_bytes(draw(byte_damage(ckpt.read_bytes())))
    elif kind == "blob":
        blob = draw(st.sampled_from(blobs))
        blob.write_bytes(draw(byte_damage(blob.read_bytes())))
    elif kind == "blob_gone":
        draw(st.sampled_from(blobs)).unlink()
    else:
        ref = draw(st.sampled_from(refs))
        ref.write_bytes(draw(byte_damage(ref.read_bytes())))
    return kind


@fuzz_settings()
@given(data=st.data())
def test_frozen_blob_checkpoint(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    folder = ws.folder / "run"
    data.draw(_frozen_damage(valid["frozen"], folder), label="change")
    path = folder / "frozen.ckpt"
    check_load(
        ws,
        lambda: FrozenBlobCheckpointIO().load_checkpoint(str(path)),
        [str(path)],
        (CheckpointError,),
        baseline_rss,
    )
    _checkpoint_loads(ws, path, baseline_rss, data)


# ---------------------------------------------------------------------- (7) hparams .yaml and .csv


@st.composite
def _hparams_file(draw: Any, valid: dict[str, Any]) -> tuple[str, bytes]:
    """An ``hparams_file``: CSVLogger's ``hparams.yaml`` or Lightning's ``.csv``, damaged."""
    hparams = valid["hparams"]
    if draw(st.booleans()):
        kind = draw(st.sampled_from(["bytes", "swap", "swap", "yaml_tag"]))
        if kind == "bytes":
            return "yaml", draw(byte_damage(valid["hparams_yaml"].encode()))
        if kind == "yaml_tag":
            return "yaml", Damaged(b"hidden: !!python/object/apply:os.system ['true']\n", "a python tag")
        return "yaml", draw(json_text_swap(hparams))
    rows = "key,value\n" + "".join(f"{k},{v}\n" for k, v in hparams.items())
    kind = draw(st.sampled_from(["bytes", "cell"]))
    if kind == "bytes":
        return "csv", draw(byte_damage(rows.encode()))
    n = draw(DEEP)
    cell = draw(
        st.sampled_from(
            ["[" * 1000 + "]" * 1000, "-" * n + "1", "(" * n, "1e309", '"' * 3, "{1: [}", "9" * 5000]
        )
    )
    key = draw(st.sampled_from(sorted(hparams)))
    how = f"cell {key} = {cell[:12]!r}... ({len(cell)} characters)"
    return "csv", Damaged(rows.replace(f"{key},{hparams[key]}", f'{key},"{cell}"').encode(), how)


@fuzz_settings(0.3)  # each example also loads the checkpoint and builds the module (~130 ms)
@given(data=st.data())
def test_hparams_file(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    ws = place()
    ckpt = ws.root / "model.ckpt"  # beside the workspace: the load reads it, the workspace holds the hparams
    ckpt.write_bytes(valid["torch_file"])
    extension, raw = data.draw(_hparams_file(valid), label="hparams_file")
    path = ws.folder / f"hparams.{extension}"
    path.write_bytes(raw)
    check_load(
        ws,
        lambda: TinyModule.load_from_checkpoint(str(ckpt), hparams_file=str(path)),
        [str(path), str(ckpt)],
        (MisconfigurationException, CheckpointError),
        baseline_rss,
    )


# ---------------------------------------------------------------------- (8) the CLI's YAML config


def _cli_config(config: dict[str, Any]) -> st.SearchStrategy[Damaged]:
    """The config damaged as bytes, or one value swapped in its JSON spelling or in block-style YAML."""
    block_yaml = lambda tree: yaml.safe_dump(tree, default_flow_style=False)  # noqa: E731
    return st.one_of(
        byte_damage(yaml.safe_dump(config).encode()),
        json_text_swap(config),
        json_text_swap(config, block_yaml),
    )


def _run_cli(path: Path) -> None:
    from trainer_core.cli import LightningCLI

    LightningCLI(
        TinyModule,
        args=["--config", str(path)],
        run=False,
        save_config_callback=None,
        trainer_defaults={"enable_progress_bar": False, "enable_model_summary": False},
    )


@fuzz_settings(0.3)  # each example parses a config and builds a Trainer
@given(data=st.data())
def test_cli_config(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    pytest.importorskip("jsonargparse")
    ws = place()
    path = ws.folder / "run.yaml"
    path.write_bytes(data.draw(_cli_config(valid["cli_config"]), label="config"))
    stderr = io.StringIO()

    def run() -> None:
        with contextlib.redirect_stderr(stderr):
            try:
                _run_cli(path)
            except SystemExit as exit:
                # argparse's way to refuse: status 2 and an error line that names the file.
                assert exit.code == 2, exit.code
                raise _CliRefused(stderr.getvalue()) from None

    old = os.getcwd()
    os.chdir(ws.root)  # anything a run writes to the working directory shows as a change next door
    try:
        check_load(ws, run, [f"{path}"], (_CliRefused,), baseline_rss)
    finally:
        os.chdir(old)


class _CliRefused(Exception):
    """The CLI exited with status 2 (its ``error:`` output is the message)."""


# ---------------------------------------------------------------------- a few through fit(ckpt_path)


@fuzz_settings(0.1)
@given(data=st.data())
def test_fit_from_a_damaged_checkpoint(
    valid: dict[str, Any], place: Callable[[], Workspace], baseline_rss: float, data: Any
) -> None:
    """The torch file and the Lightning file, damaged, handed to ``fit``: the model and optimizer stay as they were."""
    ws = place()
    path = ws.folder / "resume.ckpt"
    damage = st.one_of(_torch_file_damage(valid), value_swap(valid["lightning"]))
    path.write_bytes(data.draw(damage, label="file"))
    seed_everything(1, verbose=False)
    model = TinyModule()
    trainer = quiet_trainer(max_steps=3)
    before = state_of(model)

    def unchanged() -> bool:
        fresh = all(not opt.state_dict()["state"] for opt in trainer.optimizers)
        return same_state(before, model) and fresh and trainer.global_step == 0

    check_load(
        ws,
        lambda: trainer.fit(model, random_loader(8, 2, batch_size=4), ckpt_path=str(path)),
        [str(path)],
        (CheckpointError,),
        baseline_rss,
        unchanged=unchanged,
    )


@pytest.mark.parametrize(
    "text, expected",
    [
        (b"\xff\xfe not utf-8", "cannot read the config file"),  # was a raw UnicodeDecodeError
        (
            b"model: null\n",
            'Parser key "model": expected a mapping of arguments, got NoneType',
        ),  # was a TypeError
        (b"trainer: [1, 2]\n", 'Parser key "trainer"'),
        (b"trainer:\n  max_steps: [1]\n", 'Parser key "trainer.max_steps"'),  # named the key, not the file
        (b"trainer:\n  max_steps:\n", "Trainer(max_steps=None)"),  # was a raw MisconfigurationException
        (b"a: " + b"[" * 20000 + b"]" * 20000 + b"\n", "nesting depth"),
        (b"seed_everything: -1\n", "seed_everything: seed_everything(seed=-1)"),  # was a raw ValueError
        (  # a value the model's nn.Linear refuses: was a raw TypeError from torch
            b"model:\n  hidden: 18446744073709551616\n",
            "building the classes of the config failed: TypeError: empty(): argument 'size'",
        ),
    ],
)
def test_cli_config_errors_name_the_file(tmp_path: Path, text: bytes, expected: str) -> None:
    """What the fuzzer found in the CLI's config reading: each is argparse's exit 2 naming the file."""
    pytest.importorskip("jsonargparse")
    path = tmp_path / "run.yaml"
    path.write_bytes(text)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit:
        _run_cli(path)
    assert exit.value.code == 2
    error = stderr.getvalue().split("error: ", 1)[1]
    assert expected in error and str(path) in error, error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]
