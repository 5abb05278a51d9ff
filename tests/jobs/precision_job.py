"""A job script for tests/plugins/test_precision_distributed.py, started the way a user starts a script.

One launch at 2 ranks trains several *cases* in sequence (a process start costs seconds, a fit on
this module much less). A case is ``<plugin>:<precision>[:resume]``. Every case trains ``STEPS``
steps with a poisoned step: at step ``POISON_STEP`` rank ``POISON_RANK`` adds ``inf * head.bias``
to its loss, so one parameter's gradient holds inf on that rank only, before any reduction. Under
``16-mixed`` every rank must skip that step. ``:resume`` also trains to ``RESUME_AT``, saves, and
resumes from that file in a second fit.

Every rank writes ``<case>.rank<r>.pt``: per step, whether any of its parameters changed and the
loss scale after the step; the final loss scale and the parameters' dtype. Rank 0 writes the
final full weights (``<case>.ckpt``, a checkpoint) and, for ``:resume``, ``<case>.resumed.ckpt``.
The module lives here so that the test builds the one-process reference from the same class.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from trainer_core import LightningModule, Trainer, seed_everything
from trainer_core.callbacks import Callback, ModelCheckpoint

STEPS = 6
POISON_STEP = 2
POISON_RANK = 1
RESUME_AT = 4
N_SAMPLES = 96
LR = 0.05
POISON = True
#: Plugins where every rank holds the whole model (its copy must equal every other rank's).
REPLICATED = ("ddp", "ddp_sharded", "zero")


class Net(LightningModule):
    """Two ``Linear + Tanh`` blocks and a head, with ``loss_fn`` (the pipeline's) and a tensor-parallel plan."""

    def __init__(self, poison_rank: Optional[int] = POISON_RANK, poison_step: int = POISON_STEP) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Sequential(nn.Linear(8, 32), nn.Tanh()), nn.Sequential(nn.Linear(32, 32), nn.Tanh())]
        )
        self.head = nn.Linear(32, 1)
        self.poison_rank = poison_rank
        self.poison_step = poison_step
        self._poison: Optional[Tensor] = None

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        if self._poisoned_now():
            # Taken here, where FSDP holds the whole (unsharded) parameter.
            self._poison = _local(self.head.bias).sum() * float("inf")
        return self.head(x)

    def _poisoned_now(self) -> bool:
        trainer = self._trainer
        return (
            trainer is not None
            and trainer.training
            and self.global_rank == self.poison_rank
            and trainer.global_step == self.poison_step
        )

    def loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        loss = F.mse_loss(output.float(), target.float())
        if self._poisoned_now():
            # Only head.bias gets an inf gradient, and only on this rank, before any reduction. (The
            # pipeline calls its stages, not forward: there the term is taken here, on the last stage.)
            term = self._poison if self._poison is not None else self.head.bias.sum() * float("inf")
            self._poison = None
            loss = loss + term
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return self.loss_fn(self(x), y)

    def configure_model(self) -> None:
        mesh = self.device_mesh
        if mesh is None or "tensor_parallel" not in (mesh.mesh_dim_names or ()):
            return
        if mesh["tensor_parallel"].size() == 1:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp = mesh["tensor_parallel"]
        parallelize_module(self.layers[0], tp, {"0": ColwiseParallel()})
        parallelize_module(self.layers[1], tp, {"0": RowwiseParallel()})

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # SGD: its steps follow the gradients' size (Adam's first steps are +-lr whatever the rounding).
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N_SAMPLES, 8, generator=g), torch.randn(N_SAMPLES, 1, generator=g))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class Record(Callback):
    """Per step on this rank: did any parameter this rank holds change, and the loss scale after it."""

    def __init__(self) -> None:
        self.changed: list[bool] = []
        self.scales: list[Optional[float]] = []
        self._before: list[Tensor] = []

    def _params(self, trainer: Trainer) -> list[Tensor]:
        return [_local(p).detach() for group in trainer.optimizers[0].param_groups for p in group["params"]]

    def on_train_batch_start(self, trainer: Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._before = [p.clone() for p in self._params(trainer)]

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        after = self._params(trainer)
        self.changed.append(any(not torch.equal(a, b) for a, b in zip(self._before, after)))
        scaler = trainer.strategy.precision.scaler
        self.scales.append(None if scaler is None else float(scaler.get_scale()))


def make_plugin(name: str) -> Any:
    from trainer_core.plugins import ModelParallelPlugin, PipelinePlugin

    if name == "pipeline":
        return PipelinePlugin(split_points=["layers.1"], n_microbatches=2)
    if name == "model_parallel":
        return ModelParallelPlugin(
            data_parallel_size=1, tensor_parallel_size=2, save_distributed_checkpoint=False
        )
    return name


def fit(
    plugin: str,
    precision: str,
    steps: int,
    ckpt_path: Optional[str] = None,
    save_to: Optional[Path] = None,
    devices: int = 2,
    clip: Optional[float] = None,
    batch_size: int = 8,
    poison_rank: int = POISON_RANK,
) -> tuple[Trainer, Net, Record]:
    seed_everything(0, verbose=False)
    # Only a loss scaler can step over an inf; other precisions would train into NaN.
    model = Net(poison_rank=poison_rank if POISON and precision == "16-mixed" else None)
    record = Record()
    callbacks: list[Callback] = [record]
    if save_to is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=str(save_to), every_n_train_steps=RESUME_AT, save_top_k=-1, save_last=False
            )
        )
    trainer = Trainer(
        plugins=[make_plugin(plugin)],
        devices=devices,
        precision=precision,
        max_steps=steps,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=save_to is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model, DataLoader(dataset(), batch_size=batch_size), ckpt_path=ckpt_path)
    return trainer, model, record


def batch_of_one_process(plugin: str) -> int:
    """The batch one process trains on to match a 2-rank run: both ranks' batches, or one (no data parallelism)."""
    return 8 if plugin in ("pipeline", "model_parallel") else 16


def reference(plugin: str, precision: str, clip: Optional[float] = None) -> tuple[Trainer, Net, Record]:
    """One process on one device, the same poisoned step (its rank is 0)."""
    return fit(
        "single_device",
        precision,
        STEPS,
        devices=1,
        batch_size=batch_of_one_process(plugin),
        poison_rank=0,
        clip=clip,
    )


def run_case(case: str, out: Path) -> None:
    plugin, precision, *extra = case.split(":")
    resume = "resume" in extra
    clip = 0.5 if "clip" in extra else None
    folder = out / f"{case.replace(':', '_')}.ckpts"
    trainer, model, record = fit(plugin, precision, STEPS, save_to=folder if resume else None, clip=clip)
    rank = trainer.global_rank
    result: dict[str, Any] = {
        "changed": record.changed,
        "scales": record.scales,
        "dtype": str(next(model.parameters()).dtype),
    }
    if plugin in REPLICATED:
        # Every rank's own copy of the whole model: replicas must hold the very same weights.
        result["replica"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    name = case.replace(":", "_")
    trainer.save_checkpoint(str(out / f"{name}.ckpt"))
    if resume:
        files = sorted(folder.glob(f"*step={RESUME_AT}*"))
        path = str(files[0]) if files else str(folder / "missing")
        resumed, _, record2 = fit(plugin, precision, STEPS, ckpt_path=path)
        result["resumed_changed"] = record2.changed
        result["resumed_scales"] = record2.scales
        resumed.save_checkpoint(str(out / f"{name}.resumed.ckpt"))
    torch.save(result, out / f"{name}.rank{rank}.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True, help="comma-separated <plugin>:<precision>[:resume][:clip]")
    parser.add_argument("--no-poison", action="store_true")
    args = parser.parse_args()
    global POISON
    POISON = not args.no_poison
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for case in args.cases.split(","):
        run_case(case, out)


if __name__ == "__main__":
    main()
