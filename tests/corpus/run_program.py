"""Run a corpus program under Lightning or under trainer-core, changing only its imports.

    python tests/corpus/run_program.py {lightning,trainer_core} PROGRAM OUT_DIR [program arguments...]

``PROGRAM`` is a path under ``tests/corpus/lightning/`` (a verbatim copy of Lightning's file), or
``third_party/<owner>__<repo>/<path>`` (a program somebody else wrote, see ``third_party/README.md``).
The program is copied into the current directory with its imports rewritten for the framework (the
table :data:`IMPORTS`, applied the same way to Lightning's demo modules it uses, and to every Python
file of a third party's folder, which is copied whole) and run as ``__main__``. Three things differ
from running it by hand, the same for both frameworks:

* **Synthetic data in place of downloads**: MNIST files (Lightning's own ``PL_USE_MOCKED_MNIST``
  format) and a WikiText-2 text are written where the programs look, from a fixed seed; the few
  torchvision names the programs use come from ``tests/corpus/stand_ins``.
* **A small budget**: every ``Trainer`` the program builds gets at most 2 epochs and a few batches
  per stage, on the CPU, without a progress bar.
* **A record**: after each ``fit``/``validate``/``test``/``predict`` the trainer's step, epoch and
  metrics, the returned results, the predictions' sums and each weight's sum and sum of squares go
  to ``OUT_DIR/record.json`` (the weights themselves to ``weights.pt``), for the test to compare the
  two frameworks. Each entry point's record also has the training steps it ran (loss and every
  learning rate), the checkpoint files and the files the loggers wrote (by content), and digests of
  the Python, NumPy and torch random states; a test compares what the reference has.

``CORPUS_BUDGET`` (JSON) changes the budget for one program: other values for :data:`BUDGET`'s keys and
``max_epochs``, or ``{"keep": true}`` to keep the program's own Trainer arguments (still on one CPU).
"""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import os
import random
import re
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SOURCES = HERE / "lightning"
DEMOS = SOURCES / "src" / "lightning" / "pytorch" / "demos"

# (pattern, replacement) pairs, applied in order: what a user moving the program changes.
IMPORTS: dict[str, list[tuple[str, str]]] = {
    "trainer_core": [
        (r"\blightning\.pytorch\.demos\b", "corpus_demos"),
        (r"\blightning\.fabric\b", "lightning_fabric"),
        (r"\blightning\.pytorch\b", "trainer_core"),
        (r"\bpytorch_lightning\b", "trainer_core"),
        (r"^(\s*)import lightning as (\w+)", r"\1import trainer_core as \2"),
        (r"\bL\.pytorch\.", "L."),  # `import lightning as L` then `L.pytorch.seed_everything(...)`
        (r"^(\s*)from lightning import ", r"\1from trainer_core import "),
    ],
    "lightning": [
        (r"\blightning\.pytorch\.demos\b", "corpus_demos"),
        (r"\blightning\.fabric\b", "lightning_fabric"),
        (r"\blightning\.pytorch\b", "pytorch_lightning"),
        (r"^(\s*)import lightning as (\w+)", r"\1import pytorch_lightning as \2"),
        (r"\bL\.pytorch\.", "L."),  # `import lightning as L` then `L.pytorch.seed_everything(...)`
        (r"^(\s*)from lightning import ", r"\1from pytorch_lightning import "),
    ],
}

BUDGET = {
    "limit_train_batches": 4,
    "limit_val_batches": 2,
    "limit_test_batches": 2,
    "limit_predict_batches": 2,
    "enable_progress_bar": False,
}
MAX_EPOCHS = 2
# A larger budget where a program names a file that only a longer run writes (a path under tests/corpus/lightning/).
PROGRAM_BUDGET: dict[str, dict[str, Any]] = {
    # Loads "./lightning_logs/version_0/checkpoints/epoch=0-step=100.ckpt": its own limit_train_batches=100 stays.
    "docs/source-pytorch/starter/introduction_1.py": {"limit_train_batches": 100},
    # The learning-rate finder skips its first 10 points: 2 epochs of 4 batches leave it no suggestion.
    "docs/source-pytorch/advanced/training_tricks_1.py": {"limit_train_batches": 16},
    "docs/source-pytorch/advanced/training_tricks_3.py": {"limit_train_batches": 16},
    # EMA starts after 100 steps and SWA at epoch 10: 12 epochs of 10 batches reach both.
    "docs/source-pytorch/advanced/training_tricks_4.py": {"limit_train_batches": 10, "max_epochs": 12},
}


def rewrite(source: str, framework: str) -> str:
    for pattern, replacement in IMPORTS[framework]:
        source = re.sub(pattern, replacement, source, flags=re.M)
    return source


def write_synthetic_data(root: Path) -> None:
    """MNIST (60,000 + 10,000 28x28 images) where the programs and Lightning's MNIST demo look, and WikiText-2."""
    import torch

    gen = torch.Generator().manual_seed(0)
    train = (
        torch.randint(0, 256, (60000, 28, 28), dtype=torch.uint8, generator=gen),
        torch.randint(0, 10, (60000,), generator=gen),
    )
    test = (
        torch.randint(0, 256, (10000, 28, 28), dtype=torch.uint8, generator=gen),
        torch.randint(0, 10, (10000,), generator=gen),
    )
    for folder in (root / "data", root / "examples" / "Datasets"):
        complete = folder / "MNIST" / "complete"
        complete.mkdir(parents=True, exist_ok=True)
        torch.save(train, complete / "training.pt")
        torch.save(test, complete / "test.pt")
    words = [f"w{i}" for i in range(200)]
    lines = [
        " ".join(words[int(j)] for j in torch.randint(0, 200, (12,), generator=gen)) for _ in range(12000)
    ]
    (root / "data" / "wikitext-2.txt").write_text("\n".join(lines) + "\n")


def install_demos(root: Path, framework: str) -> None:
    """Lightning's demo modules, their imports rewritten for ``framework``, as the package ``corpus_demos``."""
    package = root / "corpus_demos"
    package.mkdir(exist_ok=True)
    for path in DEMOS.glob("*.py"):
        (package / path.name).write_text(rewrite(path.read_text(), framework))


def copy_third_party(program: str, root: Path, framework: str) -> Path:
    """A third party's whole folder into ``root`` (its Python files rewritten); the entry's path there."""
    folder = Path(*Path(program).parts[:2])
    source = HERE / folder
    for path in source.rglob("*"):
        if path.is_dir() or "__pycache__" in path.parts or path.name == "corpus.json":
            continue
        target = root / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".py":
            target.write_text(rewrite(path.read_text(), framework))
        else:
            shutil.copyfile(path, target)
    return root / Path(program).relative_to(folder)


def _float(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def rng_digests() -> dict[str, str]:
    """Short digests of the Python, NumPy and torch random states: equal digests, equal draws to come."""
    import numpy as np
    import torch

    def digest(data: bytes) -> str:
        return hashlib.sha1(data).hexdigest()[:16]

    kind, keys, pos, *_ = np.random.get_state()
    return {
        "python": digest(repr(random.getstate()).encode()),
        "numpy": digest(keys.tobytes() + str((kind, pos)).encode()),
        "torch": digest(torch.get_rng_state().numpy().tobytes()),
    }


def _number(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("loss")
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        return None


def step_recorder(callback_cls: type, steps: list[dict[str, Any]]) -> Any:
    """A callback (of the framework's own base) that notes each training batch's loss and learning rates."""

    class StepRecorder(callback_cls):  # type: ignore[misc, valid-type]
        def on_train_batch_end(
            self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            steps.append(
                {
                    "global_step": int(trainer.global_step),
                    "batch_idx": int(batch_idx),
                    "loss": _number(outputs),
                    "lr": [[float(group["lr"]) for group in opt.param_groups] for opt in trainer.optimizers],
                }
            )

    return StepRecorder()


def _tensor_sum(value: Any) -> float:
    import torch

    if isinstance(value, torch.Tensor):
        return float(value.detach().double().sum()) if value.is_floating_point() else float(value.sum())
    if isinstance(value, dict):
        return sum(_tensor_sum(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_sum(v) for v in value)
    return 0.0


def _file_content(path: Path) -> Any:
    """What a file the run wrote holds, in a form two runs can be compared by (None: compare the name only)."""
    if path.suffix == ".csv":
        with path.open(newline="") as handle:
            return list(csv.DictReader(handle))
    if path.suffix in (".yaml", ".yml"):
        import yaml

        class Loader(yaml.SafeLoader):
            """Python tags (``!!python/tuple`` in an hparams.yaml) come back as ``{tag: value}``, to compare too."""

        def tagged(loader: Any, suffix: str, node: Any) -> Any:
            if isinstance(node, yaml.MappingNode):
                return {f"!!python/{suffix}": loader.construct_mapping(node, deep=True)}
            if isinstance(node, yaml.SequenceNode):
                return {f"!!python/{suffix}": loader.construct_sequence(node, deep=True)}
            return {f"!!python/{suffix}": loader.construct_scalar(node)}

        Loader.add_multi_constructor("tag:yaml.org,2002:python/", tagged)
        return yaml.load(path.read_text(), Loader=Loader)
    if path.name.startswith("events.out.tfevents"):
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(path), size_guidance={"scalars": 0, "images": 0})
        events.Reload()
        tags = events.Tags()
        return {
            "scalars": {t: [[e.step, e.value] for e in events.Scalars(t)] for t in sorted(tags["scalars"])},
            "images": {t: len(events.Images(t)) for t in sorted(tags["images"])},
        }
    if path.suffix in (".pt", ".pth"):
        import torch

        try:
            return _tensor_sum(torch.load(path, map_location="cpu", weights_only=True))
        except Exception:
            return None
    return None


def written_files(root: Path, before: set[Path]) -> dict[str, Any]:
    """Every file the run has written under ``root`` so far, by relative name, with its content where comparable.

    TensorBoard's event files carry the time and host in their names: they are named by their folder.
    """
    found: dict[str, Any] = {}
    for path in sorted(root.rglob("*")):
        if not path.is_file() or path in before or "__pycache__" in path.parts or path.suffix == ".pyc":
            continue
        name = path.relative_to(root).as_posix()
        if path.name.startswith("events.out.tfevents"):
            name = f"{path.parent.relative_to(root).as_posix()}/events.out.tfevents"
        found[name] = None if path.suffix == ".ckpt" else _file_content(path)
    return found


def instrument(
    trainer_cls: type,
    record: list[dict[str, Any]],
    weights: list[dict[str, Any]],
    callback_cls: Any = None,
    files: Any = None,
) -> None:
    """Give every Trainer the budget, and record what each entry point leaves behind.

    With ``callback_cls`` (the framework's ``Callback``) each Trainer also gets a step recorder; with
    ``files`` (a function of no arguments) each entry point's record has the files written so far.
    """
    original_init = trainer_cls.__init__
    steps: list[dict[str, Any]] = []

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if callback_cls is not None:
            given = kwargs.get("callbacks")
            given = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
            kwargs["callbacks"] = [*given, step_recorder(callback_cls, steps)]
        if BUDGET.get("keep"):
            kwargs["accelerator"] = "cpu"
            kwargs["devices"] = 1
            original_init(self, *args, **kwargs)
            return
        for key, limit in BUDGET.items():
            given = kwargs.get(key)
            # The program's own smaller limit stays (a number of batches, not a fraction).
            if not (
                isinstance(given, int)
                and not isinstance(given, bool)
                and isinstance(limit, int)
                and given < limit
            ):
                kwargs[key] = limit
        kwargs["accelerator"] = "cpu"
        kwargs["devices"] = 1
        if os.environ.get("CORPUS_PRECISION"):
            # The same program at another precision, for both frameworks alike.
            kwargs["precision"] = os.environ["CORPUS_PRECISION"]
        epochs = kwargs.get("max_epochs")
        kwargs["max_epochs"] = MAX_EPOCHS if epochs is None or epochs < 0 else min(epochs, MAX_EPOCHS)
        original_init(self, *args, **kwargs)

    trainer_cls.__init__ = __init__

    def recorded(name: str) -> None:
        original = getattr(trainer_cls, name)

        @functools.wraps(original)
        def entry(self: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            module = self.lightning_module
            entry_record: dict[str, Any] = {
                "call": name,
                "global_step": int(self.global_step),
                "current_epoch": int(self.current_epoch),
                "callback_metrics": {k: _float(v) for k, v in sorted(self.callback_metrics.items())},
            }
            if name in ("validate", "test"):
                entry_record["results"] = [{k: _float(v) for k, v in d.items()} for d in out]
            if name == "predict" and out is not None:
                import torch

                flat = [p for batch in out for p in (batch if isinstance(batch, list) else [batch])]
                entry_record["predictions"] = [float(torch.as_tensor(p).double().sum()) for p in flat]
            if module is not None:
                state = {k: v.detach().clone() for k, v in module.state_dict().items()}
                weights.append(state)
                # Sum and sum of squares per tensor: enough to tell two runs apart, small enough to keep as a reference.
                entry_record["weights"] = {
                    k: [float(v.double().sum()), float(v.double().square().sum())]
                    for k, v in state.items()
                    if v.is_floating_point()
                }
            if callback_cls is not None:
                entry_record["steps"] = list(steps)
                steps.clear()
                entry_record["rng"] = rng_digests()
            if files is not None:
                entry_record["files"] = files()
            record.append(entry_record)
            return out

        setattr(trainer_cls, name, entry)

    for name in ("fit", "validate", "test", "predict"):
        recorded(name)


def main() -> None:
    framework, program, out_dir, *program_args = sys.argv[1:]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    root = Path.cwd()
    sys.path.insert(0, str(HERE / "stand_ins"))
    sys.path.insert(0, str(root))
    os.environ["PL_USE_MOCKED_MNIST"] = "1"
    write_synthetic_data(root)
    install_demos(root, framework)

    third_party = program.startswith("third_party/")
    if third_party:
        target = copy_third_party(program, root, framework)
    else:
        target = root / program
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(rewrite((SOURCES / program).read_text(), framework))

    import torch

    if framework == "lightning":
        from pytorch_lightning import Callback, Trainer
    else:
        from trainer_core import Callback, Trainer
    global MAX_EPOCHS
    budget = dict(PROGRAM_BUDGET.get(program, {}))
    budget.update(json.loads(os.environ.get("CORPUS_BUDGET") or "{}"))
    MAX_EPOCHS = budget.pop("max_epochs", MAX_EPOCHS)
    BUDGET.update(budget)
    record: list[dict[str, Any]] = []
    weights: list[dict[str, Any]] = []
    if third_party:
        before = {path for path in root.rglob("*") if path.is_file()}
        instrument(Trainer, record, weights, Callback, lambda: written_files(root, before))
        sys.path.insert(0, str(target.parent))
    else:
        instrument(Trainer, record, weights)
    torch.manual_seed(0)
    if third_party:
        # The record has all three generators' states: one the program never seeds starts alike too. rich draws
        # from Python's generator when it is first imported, which Lightning does on import and trainer-core only
        # when a rich bar is used: it is imported first, as a program's own imports would come before its seed.
        import importlib.util

        import numpy as np

        if importlib.util.find_spec("rich") is not None:
            import rich.style  # noqa: F401

        random.seed(0)
        np.random.seed(0)
    sys.argv = [str(target), *program_args]
    try:
        runpy.run_path(str(target), run_name="__main__")
    finally:
        (out / "record.json").write_text(json.dumps(record, indent=1))
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
