"""A job script for the per-plugin unit tests: one rank of a gloo group, started with RANK/WORLD_SIZE.

``python plugin_unit_job.py CASE --out DIR`` drives one plugin through its public methods, without
a Trainer loop: the ranks join the group through the plugin (``configure_devices``,
``setup_environment``), wrap a small module and its optimizer, run steps by hand and record what a
user relies on (gradients, weights, optimizer states, collective results, types) in
``DIR/rank<r>.pt``. Every rank also computes the single-process reference on the combined batch, so
the test compares numbers without training anything itself. Cases: ``ddp``, ``zero``,
``ddp_sharded``, ``fsdp``, ``parallel_dims`` (see each function).
"""

from __future__ import annotations

import argparse
import copy
import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from trainer_core import LightningModule, Trainer
from trainer_core.plugins import TrainingTypePlugin, plugin_from_name

WORLD = int(os.environ.get("WORLD_SIZE", 1))
RANK = int(os.environ.get("RANK", 0))
#: Rows of one rank's batch; the reference trains on the WORLD batches together.
ROWS = 4
LR = 0.05
#: Below the reference's gradient norm (recorded), so that clipping changes the step.
CLIP = 0.05


class Net(LightningModule):
    """Two layers (four parameters, so two ranks each own a part of a sharded optimizer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.layer(x)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)


def net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def combined_batch(step: int) -> tuple[Tensor, Tensor]:
    """The batch of every rank together at ``step`` (the same on every rank)."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * ROWS, 4, generator=gen), torch.randn(WORLD * ROWS, 1, generator=gen)


def rank_batch(step: int, rank: int = RANK) -> tuple[Tensor, Tensor]:
    x, y = combined_batch(step)
    return x[rank * ROWS : (rank + 1) * ROWS], y[rank * ROWS : (rank + 1) * ROWS]


def started(name: str, module: Optional[nn.Module] = None, **kwargs: Any) -> TrainingTypePlugin:
    """The registry's plugin ``name``, in the process group of this job (joined by the first plugin).

    ``module`` is connected before the environment is set up, as the Trainer does (FSDP gives it its mesh there).
    """
    plugin = plugin_from_name(name, **kwargs)
    if module is not None:
        plugin.connect(module)
    plugin.configure_devices("cpu", WORLD, 1)
    plugin.setup_environment()
    return plugin


def grads(module: nn.Module) -> dict[str, Tensor]:
    return {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}


def local_grads(module: nn.Module, batch: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
    """The gradients of ``batch`` on a plain copy of ``module``: what this rank computes before any reduction."""
    plain = copy.deepcopy(module)
    plain.zero_grad(set_to_none=True)
    plain.training_step(batch, 0).backward()
    return grads(plain)


def weights(module: nn.Module) -> dict[str, Tensor]:
    return {name: value.detach().clone() for name, value in module.state_dict().items()}


def loader_indices(loader: DataLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch]


def reference_run(steps: int, clip: bool) -> tuple[Net, torch.optim.Adam, list[float]]:
    """One process, Adam on the combined batches (``clip``: the total norm clipped to ``CLIP``); the norms seen."""
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        model.training_step(combined_batch(step), step).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return model, opt, norms


# ---------------------------------------------------------------------- cases
def ddp_case() -> dict[str, Any]:
    """``DDPPlugin``: ranks and data split, collectives, and ``no_backward_sync`` deferring the all-reduce.

    One batch backwards under ``no_backward_sync`` (each rank keeps its local gradient), the next
    without (DDP all-reduces the accumulated sum: every rank ends with the mean over ranks of it).
    """
    plugin = started("ddp")
    module = net()
    facts: dict[str, Any] = {
        "rank": plugin.global_rank,
        "world_size": plugin.world_size,
        "is_global_zero": plugin.is_global_zero,
        "sampler_kwargs": plugin.distributed_sampler_kwargs,
        "layout": plugin.layout(),
        "grad_scaler": type(plugin.grad_scaler()).__name__,
    }
    first, second = rank_batch(0), rank_batch(1)
    facts["local_first"] = local_grads(module, first)
    facts["local_second"] = local_grads(module, second)
    plugin.connect(module)
    plugin.model = plugin.wrap_model(module)
    facts["wrapper"] = type(plugin.model).__name__
    with plugin.no_backward_sync():
        plugin.training_step(first, 0).backward()
    facts["grads_without_sync"] = grads(module)
    plugin.training_step(second, 1).backward()
    facts["grads_after_sync"] = grads(module)

    value = torch.tensor(float(RANK + 1))
    facts["reduce"] = {op: plugin.reduce(value, reduce_op=op).item() for op in ("sum", "mean", "max", "min")}
    facts["broadcast"] = plugin.broadcast({"from": RANK})
    facts["all_gather"] = plugin.all_gather(torch.tensor([RANK, 10 * RANK]))
    facts["all_gather_object"] = plugin.all_gather_object(f"rank{RANK}")
    facts["decision_all"] = plugin.reduce_boolean_decision(RANK == 0, all=True)
    facts["decision_any"] = plugin.reduce_boolean_decision(RANK == 0, all=False)

    nine = DataLoader(list(range(9)), batch_size=2)
    facts["train_indices"] = loader_indices(plugin.process_dataloader(nine, "train", True))
    facts["val_indices"] = loader_indices(plugin.process_dataloader(nine, "val", True))
    facts["predict_indices"] = loader_indices(plugin.process_dataloader(nine, "predict", True))
    facts["kept_loader"] = plugin.process_dataloader(nine, "train", False) is nine

    # A plain optimizer's state is full on every rank: only sharded optimizers are consolidated to rank 0.
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    opt.step()
    facts["plain_state_params"] = sorted(plugin.optimizer_state(opt)["state"])
    return facts


def sharded_optimizer_case(name: str) -> dict[str, Any]:
    """``ZeroPlugin`` / ``DDPShardedPlugin``: wrapped optimizer, global clipping, the consolidation rule, re-partitioning.

    Two steps with the total gradient norm clipped, against the reference; the optimizer state as
    rank 0 writes it (every rank takes part, the others get ``{}``); then a new optimizer loads the
    name-keyed state (every rank holds the checkpoint): each rank keeps its own part, the state
    consolidates to the same one, and a further step matches the optimizer that never stopped.
    """
    plugin = started(name)
    module = net()
    plugin.connect(module)
    opt = plugin.wrap_optimizer(torch.optim.Adam(module.parameters(), lr=LR))
    plugin.optimizers = [opt]
    plugin.model = plugin.wrap_model(module)
    facts: dict[str, Any] = {
        "plugin": type(plugin).__name__,
        "optimizer": type(opt).__name__,
        "wrapper": type(plugin.model).__name__,
        "grad_scaler": type(plugin.grad_scaler()).__name__,
    }
    for step in range(2):
        _step(plugin, opt, step)
    reference, reference_opt, norms = reference_run(2, clip=True)
    facts["weights"], facts["reference_weights"] = weights(module), weights(reference)
    facts["reference_norms"] = norms
    # Copies: rank 0's own part of a consolidated state is the optimizer's tensors, which step 2 changes.
    facts["optimizer_state"] = copy.deepcopy(plugin.optimizer_state(opt))
    facts["reference_state"] = reference_opt.state_dict()
    named = copy.deepcopy(plugin.named_optimizer_state(opt))
    facts["named_state"] = named
    # The consolidation rule lives in the base: plain DDP gives the same for an optimizer the user sharded.
    facts["ddp_state"] = copy.deepcopy(started("ddp").optimizer_state(opt))

    # A copy: the loading optimizer may keep the loaded tensors (torch's load_state_dict does), and steps them.
    checkpoint_state = plugin.broadcast(copy.deepcopy(named))
    loader_plugin = started(name)
    fresh = net(seed=1)
    fresh.load_state_dict(weights(module))
    loader_plugin.connect(fresh)
    fresh_opt = loader_plugin.wrap_optimizer(torch.optim.Adam(fresh.parameters(), lr=LR))
    loader_plugin.optimizers = [fresh_opt]
    loader_plugin.model = loader_plugin.wrap_model(fresh)
    prepared = loader_plugin.prepare_optimizer_state(fresh_opt, checkpoint_state, "memory://unit.ckpt")
    loader_plugin.load_optimizer_state_dict(fresh_opt, prepared)
    names = {param: pname for pname, param in fresh.named_parameters()}
    # The local optimizer of OSS and of ZeroRedundancyOptimizer (`.optim`) holds this rank's partition.
    facts["own_state_names"] = sorted(names[p] for p in fresh_opt.optim.state)
    facts["reloaded_named_state"] = copy.deepcopy(loader_plugin.named_optimizer_state(fresh_opt))
    _step(plugin, opt, 2)
    _step(loader_plugin, fresh_opt, 2)
    facts["continued_weights"], facts["reloaded_weights"] = weights(module), weights(fresh)
    return facts


def _step(plugin: TrainingTypePlugin, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad()
    plugin.training_step(rank_batch(step), step).backward()
    plugin.clip_gradients(opt, CLIP, "norm")
    opt.step()


def fsdp_case() -> dict[str, Any]:
    """``FSDPPlugin``: the mesh, full and sharded state dicts against the unsharded module, loading, no_backward_sync.

    The module is sharded by ``setup`` (a Trainer that is not training: no optimizers are made);
    one step under ``no_backward_sync`` then one with sync accumulate the two batches' gradients
    (reduced once, at the second), Adam steps, and the states are read under ``"full"`` (rank 0
    gets whole tensors, the others ``{}``) and ``"sharded"`` (every rank its DTensor shards). A
    second module, initialised differently, loads the full states.
    """
    module = net()
    initial = weights(module)
    plugin = started("fsdp", module)
    plugin.setup(_idle_trainer(plugin))
    mesh = plugin.device_mesh
    facts: dict[str, Any] = {
        "initial_weights": initial,
        "mesh_dims": tuple(mesh.mesh_dim_names),
        "mesh_size": mesh.size(),
        "module_mesh_dims": tuple(module.device_mesh.mesh_dim_names),
        "layout": plugin.layout(),
        "sampler_kwargs": plugin.distributed_sampler_kwargs,
        "grad_scaler": type(plugin.grad_scaler()).__name__,
        "initial_full": plugin.lightning_module_state_dict(),
    }
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    with plugin.no_backward_sync():
        plugin.training_step(rank_batch(0), 0).backward()
    # The reduce-scatter is what makes the sharded gradients: skipped, there are none yet.
    facts["sharded_grads_without_sync"] = sorted(
        n for n, p in module.named_parameters() if p.grad is not None
    )
    plugin.training_step(rank_batch(1), 1).backward()
    facts["grads"] = {name: p.grad.full_tensor() for name, p in module.named_parameters()}
    opt.step()
    reference = net()
    reference_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    # Each rank's two losses are means over its rows; the reduction averages the ranks.
    for step in range(2):
        reference.training_step(combined_batch(step), step).backward()
    facts["reference_grads"] = grads(reference)
    reference_opt.step()
    facts["reference_weights"] = weights(reference)
    facts["reference_named_state"] = _named_reference_state(reference, reference_opt)

    facts["full"] = plugin.lightning_module_state_dict()
    full_optimizer = plugin.named_optimizer_state(opt)
    facts["full_optimizer"] = full_optimizer
    sharded_plugin = started("fsdp", state_dict_type="sharded")
    sharded_plugin.connect(module)
    sharded = sharded_plugin.lightning_module_state_dict()
    facts["sharded_types"] = sorted({type(v).__name__ for v in sharded.values()})
    facts["sharded_local_shapes"] = {k: tuple(v.to_local().shape) for k, v in sharded.items()}
    facts["sharded_full"] = {k: v.full_tensor() for k, v in sharded.items()}
    facts["checkpoint_io"] = type(sharded_plugin.checkpoint_io).__name__

    # Every rank of a resumed run reads the same file: rank 0's full states, on every rank.
    full_model, full_optimizer = plugin.broadcast(copy.deepcopy((facts["full"], full_optimizer)))
    other = net(seed=7)
    loader = started("fsdp", other)
    loader.setup(_idle_trainer(loader))
    other_opt = torch.optim.Adam(other.parameters(), lr=LR)
    loader.load_model_state_dict(full_model)
    prepared = loader.prepare_optimizer_state(other_opt, full_optimizer, "memory://unit.ckpt")
    loader.load_optimizer_state_dict(other_opt, prepared)
    facts["loaded_full"] = {name: p.full_tensor() for name, p in other.named_parameters()}
    facts["loaded_optimizer"] = loader.named_optimizer_state(other_opt)
    return facts


def _idle_trainer(plugin: TrainingTypePlugin) -> Trainer:
    """A Trainer that is not training: ``plugin.setup`` then shards the module and builds no optimizer."""
    return Trainer(
        plugins=plugin,
        accelerator="cpu",
        devices=WORLD,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def _named_reference_state(module: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    names = [name for name, _ in module.named_parameters()]
    state = opt.state_dict()
    return {"state": {names[i]: value for i, value in state["state"].items()}}


def parallel_dims_case() -> dict[str, Any]:
    """``ParallelDims`` over 2 ranks: each layout's mesh groups hold exactly the ranks its coordinates say.

    For every layout and dimension this rank records the ranks of its group in that dimension's
    submesh; the test derives the expected groups from ``coordinates`` alone.
    """
    from trainer_core.plugins import ParallelDims

    started("ddp")  # the process group the meshes are built in
    layouts = {
        "dp2": {},
        "tp2": {"tp": 2},
        "pp2": {"pp": 2},
        "hybrid": {"dp_replicate": 2, "dp_shard": 1},
    }
    facts: dict[str, Any] = {}
    for label, sizes in layouts.items():
        dims = ParallelDims(WORLD, owner="unit", **sizes)
        mesh = dims.build_mesh("cpu")
        groups = {
            name: dist.get_process_group_ranks(dims.submesh(name).get_group()) for name in dims.dim_names
        }
        if dims.dp_replicate > 1:
            groups["data_parallel"] = dist.get_process_group_ranks(dims.submesh("data_parallel").get_group())
        facts[label] = {
            "dim_names": tuple(mesh.mesh_dim_names),
            "shape": tuple(mesh.shape),
            "groups": {name: sorted(ranks) for name, ranks in groups.items()},
            "same_mesh": dims.build_mesh("cpu") is mesh,
            "sharding_dims": tuple(dims.sharding_mesh().mesh_dim_names),
        }
    return facts


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "ddp": ddp_case,
    "zero": lambda: sharded_optimizer_case("zero"),
    "ddp_sharded": lambda: sharded_optimizer_case("ddp_sharded"),
    "fsdp": fsdp_case,
    "parallel_dims": parallel_dims_case,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    facts = CASES[args.case]()
    torch.save(facts, Path(args.out) / f"rank{RANK}.pt")
    # Every rank has written before any tears the group down (gloo aborts a peer still using it).
    dist.barrier()


if __name__ == "__main__":
    main()
