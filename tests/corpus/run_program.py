"""Run one of Lightning's own programs under Lightning or under trainer-core, changing only its imports.

    python tests/corpus/run_program.py {lightning,trainer_core} PROGRAM OUT_DIR [program arguments...]

``PROGRAM`` is a path under ``tests/corpus/lightning/`` (a verbatim copy of Lightning's file). The
program is copied into the current directory with its imports rewritten for the framework (the
table :data:`IMPORTS`, applied the same way to Lightning's demo modules it uses) and run as
``__main__``. Three things differ from running it by hand, the same for both frameworks:

* **Synthetic data in place of downloads**: MNIST files (Lightning's own ``PL_USE_MOCKED_MNIST``
  format) and a WikiText-2 text are written where the programs look, from a fixed seed; the few
  torchvision names the programs use come from ``tests/corpus/stand_ins``.
* **A small budget**: every ``Trainer`` the program builds gets at most 2 epochs and a few batches
  per stage, on the CPU, without a progress bar.
* **A record**: after each ``fit``/``validate``/``test``/``predict`` the trainer's step, epoch and
  metrics, the returned results, the predictions' sums and each weight's sum and sum of squares go
  to ``OUT_DIR/record.json`` (the weights themselves to ``weights.pt``), for the test to compare the
  two frameworks.
"""

from __future__ import annotations

import functools
import json
import os
import re
import runpy
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
        (r"^import lightning as L$", "import trainer_core as L"),
    ],
    "lightning": [
        (r"\blightning\.pytorch\.demos\b", "corpus_demos"),
        (r"\blightning\.fabric\b", "lightning_fabric"),
        (r"\blightning\.pytorch\b", "pytorch_lightning"),
        (r"^import lightning as L$", "import pytorch_lightning as L"),
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


def _float(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def instrument(trainer_cls: type, record: list[dict[str, Any]], weights: list[dict[str, Any]]) -> None:
    """Give every Trainer the budget, and record what each entry point leaves behind."""
    original_init = trainer_cls.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
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

    source = SOURCES / program
    target = root / program
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(rewrite(source.read_text(), framework))

    import torch

    if framework == "lightning":
        from pytorch_lightning import Trainer
    else:
        from trainer_core import Trainer
    global MAX_EPOCHS
    budget = dict(PROGRAM_BUDGET.get(program, {}))
    MAX_EPOCHS = budget.pop("max_epochs", MAX_EPOCHS)
    BUDGET.update(budget)
    record: list[dict[str, Any]] = []
    weights: list[dict[str, Any]] = []
    instrument(Trainer, record, weights)
    torch.manual_seed(0)
    sys.argv = [str(target), *program_args]
    try:
        runpy.run_path(str(target), run_name="__main__")
    finally:
        (out / "record.json").write_text(json.dumps(record, indent=1))
        torch.save(weights, out / "weights.pt")


if __name__ == "__main__":
    main()
