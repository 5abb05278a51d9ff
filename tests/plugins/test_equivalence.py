"""Every data-parallel plugin against one process (issue 13, part 3, second matrix).

The promise: no plugin trains a different function than one process would, silently. Two ranks
with a per-rank batch of B see, step by step, the same samples as one process with batch 2B
(``DistributedSampler`` interleaves a shuffled order; the reference below rebuilds it), so on
modules that treat samples independently the per-step losses and the final weights must match
one process. The modules are not plain chains: functional ops between submodules, a residual
connection, a module called twice. Where the function *cannot* match, the test pins what the
plugin does instead and that it says so:

* BatchNorm normalises with each rank's own half of the batch: every data-parallel plugin warns
  before training, and the run equals one process normalising each rank's half on its own.
* Dropout draws its masks from each rank's RNG: the run equals one process replaying the masks the
  ranks drew, and a second run with the same seed repeats the first bit for bit.

``make test`` runs a covering subset (every plugin with every module and both optimizers, every
module with both optimizers); ``FULL_MATRIX=1`` runs every module with every optimizer under every
plugin, accumulation everywhere, and FSDP with each ``nn.Linear`` sharded on its own.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
from boring import quiet_trainer
from equivalence_job import SEED, BatchNormNet, DropoutNet, build, dataset, parse_cell
from launch import JOBS, job_env
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from trainer_core import seed_everything
from trainer_core.plugins import SingleDevicePlugin
from trainer_core.plugins.ddp import warn_if_batch_norm

JOB = str(JOBS / "equivalence_job.py")
FULL = os.environ.get("FULL_MATRIX") == "1"
PLUGINS = ["ddp", "ddp_spawn", "ddp_sharded", "zero", "fsdp"] + (["fsdp_wrap"] if FULL else [])
MODULES = ["functional", "residual", "shared", "batchnorm", "dropout"]
#: Modules whose forward treats samples independently: the plugin must train the one-process function.
EXACT = ["functional", "residual", "shared"]
OPTIMIZERS = ["sgd", "adam"]
#: Plugins whose wrapper broadcasts rank 0's buffers at every forward; FSDP leaves each rank its own.
BROADCASTS_BUFFERS = {"ddp", "ddp_spawn", "ddp_sharded", "zero"}
PLUGIN_CLASSES = {
    "ddp": "DDPPlugin",
    "ddp_spawn": "DDPPlugin",
    "ddp_sharded": "DDPShardedPlugin",
    "zero": "ZeroPlugin",
    "fsdp": "FSDPPlugin",
    "fsdp_wrap": "FSDPPlugin",
}
WORLD = 2
BATCH = 8  # per rank
STEPS = 6  # optimizer steps per cell
LOSS_ATOL = 1e-5
WEIGHT_ATOL = 1e-5
#: BatchNorm under two ranks moves the weights at least this far from the one-process run.
BATCHNORM_DIFFERS_BY = 1e-3


# ---------------------------------------------------------------------- which cells run
def cells_for(plugin: str) -> list[str]:
    """The cells one launch of ``plugin`` trains, in order.

    Covering subset: plugin ``i`` trains module ``j`` with optimizer ``(i + j) % 2``, so every
    plugin meets every module and both optimizers, and every module meets both optimizers; every
    plugin but ``ddp_spawn`` (a spawn costs ~5 s; its DDP code is ``ddp``'s, so it trains one module
    per kind of check) adds one accumulation cell and runs the dropout cell twice. ``FULL_MATRIX=1``: everything.
    """
    if FULL:
        cells = [f"{m}-{o}" for m in MODULES for o in OPTIMIZERS]
        cells += [f"{m}-{o}-acc2" for m in EXACT for o in OPTIMIZERS]
        return cells + [f"dropout-{o}@2" for o in OPTIMIZERS]
    i = PLUGINS.index(plugin)
    cells = [f"{m}-{OPTIMIZERS[(i + j) % 2]}" for j, m in enumerate(MODULES)]
    if plugin == "ddp_spawn":
        # Every fit spawns two interpreters: one cell per kind of check (exact, BatchNorm, dropout).
        return [c for c in cells if parse_cell(c)[0] in ("functional", "batchnorm", "dropout")]
    dropout = cells[MODULES.index("dropout")]
    return [*cells, f"{EXACT[i % len(EXACT)]}-{OPTIMIZERS[(i + 1) % 2]}-acc2", f"{dropout}@2"]


def _cells(plugin: str, module: str) -> list[str]:
    return [c for c in cells_for(plugin) if parse_cell(c)[0] == module and "@" not in c]


def _repeated(plugin: str) -> list[str]:
    return [c.split("@")[0] for c in cells_for(plugin) if "@" in c]


# ---------------------------------------------------------------------- launching and reading
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One launch per plugin (on first use), training all of its cells in sequence."""

    class Lazy(dict):
        def __missing__(self, plugin: str) -> Path:
            tmp = tmp_path_factory.mktemp(f"equiv-{plugin}")
            cells = cells_for(plugin)
            env = job_env()  # one thread per rank, as the references (``one_process``) use
            cmd = [sys.executable, JOB, "--out", "out", "--plugin", plugin, "--cells", ",".join(cells)]
            cmd += ["--batch-size", str(BATCH), "--steps", str(STEPS)]
            # ~1 s per cell, ~5 s per cell under ddp_spawn, on two busy cores; generous on top.
            proc = subprocess.run(
                cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=60 + 15 * len(cells)
            )
            if proc.returncode != 0:
                pytest.fail(f"{plugin} job exited with {proc.returncode}:\n{proc.stderr[-8000:]}")
            self[plugin] = tmp / "out"
            return self[plugin]

    return Lazy()


def _ranks(out: Path, cell: str) -> list[dict[str, Any]]:
    results = [torch.load(out / f"{cell}.rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for result in results:
        assert result["world_size"] == WORLD and result["sampler"] == "DistributedSampler"
        assert result["global_step"] == STEPS
    return results


def _batchnorm_warnings(result: dict[str, Any]) -> list[str]:
    return [w for w in result["warnings"] if "BatchNorm" in w]


# ---------------------------------------------------------------------- the one-process reference
def rank_parts(batches: int) -> list[tuple[list[int], list[int]]]:
    """The samples of each rank at each batch, as ``DistributedSampler(shuffle=True)`` deals them."""
    data = dataset()
    parts: list[tuple[list[int], list[int]]] = []
    for epoch in itertools.count():
        per_rank = []
        for rank in range(WORLD):
            sampler = DistributedSampler(data, num_replicas=WORLD, rank=rank, shuffle=True, seed=SEED)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for start in range(0, len(per_rank[0]) - BATCH + 1, BATCH):
            parts.append((per_rank[0][start : start + BATCH], per_rank[1][start : start + BATCH]))
            if len(parts) == batches:
                return parts
    raise AssertionError("unreachable")


def one_process(
    cell: str, model: Optional[Any] = None, loss_fn: Optional[Callable[..., torch.Tensor]] = None
) -> tuple[Any, list[float]]:
    """A plain loop (no Trainer) on the combined batch of both ranks; returns the model and per-step losses.

    ``loss_fn(model, x, y, part0, part1, batch_idx)`` replaces the loss on the whole batch (the
    BatchNorm reference normalises each rank's part on its own).
    """
    # One thread, as each rank of the jobs: with Adam, BatchNorm's near-zero gradients turn another
    # summation order into steps of another sign (0.03 apart after 6 steps).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(cell, model, loss_fn)
    finally:
        torch.set_num_threads(threads)


def _one_process(
    cell: str, model: Optional[Any], loss_fn: Optional[Callable[..., torch.Tensor]]
) -> tuple[Any, list[float]]:
    _, _, accumulate = parse_cell(cell)
    model = model if model is not None else build(cell)
    optimizer = model.configure_optimizers()
    x, y = dataset().tensors
    losses = []
    for i, (part0, part1) in enumerate(rank_parts(STEPS * accumulate)):
        if loss_fn is None:
            both = part0 + part1
            loss = model.training_step((x[both], y[both]), i)
        else:
            loss = loss_fn(model, x, y, part0, part1, i)
        losses.append(loss.item())
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            optimizer.step()
            optimizer.zero_grad()
    return model, losses


def _assert_losses(actual: list[torch.Tensor], expected: list[float], where: str) -> None:
    """The mean of the ranks' losses (equal parts) is the loss on the combined batch."""
    mean = torch.stack(actual).mean(dim=0)
    expected_t = torch.tensor(expected, dtype=torch.float64)
    assert mean.shape == expected_t.shape, f"{where}: {mean.shape[0]} losses, expected {expected_t.shape[0]}"
    diff = (mean - expected_t).abs().max().item()
    assert diff <= LOSS_ATOL, f"{where}: per-step loss differs by {diff:.3g} from one process"


def _max_diff(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], names: list[str]) -> float:
    return max((actual[n].double() - expected[n].double()).abs().max().item() for n in names)


def _assert_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], where: str) -> None:
    assert actual.keys() == expected.keys(), f"{where}: {sorted(actual)} != {sorted(expected)}"
    diff = _max_diff(actual, expected, list(expected))
    assert diff <= WEIGHT_ATOL, f"{where}: weights differ by {diff:.3g} from one process"


# ---------------------------------------------------------------------- (a)-(c): the same function
@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_modules_that_are_not_chains_train_the_one_process_function(
    runs: dict[str, Path], plugin: str
) -> None:
    """Functional ops, a residual, a module called twice: per-step losses and final weights of one process."""
    out = runs[plugin]
    cells = [c for m in EXACT for c in _cells(plugin, m)]
    expected = {"functional"} if plugin == "ddp_spawn" and not FULL else set(EXACT)
    assert {parse_cell(c)[0] for c in cells} == expected
    for cell in cells:
        ranks = _ranks(out, cell)
        reference, losses = one_process(cell)
        _assert_losses([r["losses"] for r in ranks], losses, f"{plugin} {cell}")
        for rank, result in enumerate(ranks):
            _assert_weights(result["weights"], reference.state_dict(), f"{plugin} {cell} rank {rank}")


# ---------------------------------------------------------------------- (d) BatchNorm: warned, and what it computes
@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_batchnorm_is_warned_about_once_before_training(runs: dict[str, Path], plugin: str) -> None:
    """Rank 0 warns once per fit, naming the module, the layer, the plugin, what differs and what to do."""
    for cell in _cells(plugin, "batchnorm"):
        rank0, rank1 = _ranks(runs[plugin], cell)
        found = _batchnorm_warnings(rank0)
        assert len(found) == 1, f"{plugin} {cell}: rank 0 warned {len(found)} times: {rank0['warnings']}"
        message = found[0]
        for words in (
            "BatchNormNet has BatchNorm layers (bn)",
            f"{PLUGIN_CLASSES[plugin]} trains it on 2 processes",
            "its own part of the batch",
            "SyncBatchNorm.convert_sync_batchnorm",
            "LayerNorm, GroupNorm",
        ):
            assert words in message, f"{plugin}: {words!r} missing from {message!r}"
        assert ("broadcasts rank 0's buffers" in message) == (plugin in BROADCASTS_BUFFERS), message
        assert _batchnorm_warnings(rank1) == [], f"{plugin}: rank 1 warned too"


@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_modules_without_batchnorm_are_not_warned_about(runs: dict[str, Path], plugin: str) -> None:
    """The warning is about BatchNorm only: no other module of the run draws it, on any rank."""
    for cell in cells_for(plugin):
        if parse_cell(cell)[0] != "batchnorm":
            for rank, result in enumerate(_ranks(runs[plugin], cell)):
                assert _batchnorm_warnings(result) == [], f"{plugin} {cell} rank {rank}: {result['warnings']}"


def _bn_buffers(model: BatchNormNet) -> dict[str, torch.Tensor]:
    return {f"bn.{k}": v.detach().clone() for k, v in model.bn.named_buffers()}


def _set_bn_buffers(model: BatchNormNet, buffers: dict[str, torch.Tensor]) -> None:
    # Fresh tensors, not copy_: autograd saved the old ones for this step's backward.
    for name, _ in list(model.bn.named_buffers()):
        setattr(model.bn, name, buffers[f"bn.{name}"].clone())


def per_rank_batchnorm(
    cell: str,
) -> tuple[BatchNormNet, list[list[float]], dict[str, torch.Tensor], dict[str, Any]]:
    """One process computing what two ranks compute: BatchNorm over each rank's part of the batch.

    Returns the model (parameters, and rank 0's running statistics), each part's losses, and rank
    1's final running statistics both ways: ``"broadcast"`` (rank 0's buffers sent at every forward,
    then updated by rank 1's part) and ``"own"`` (rank 1's parts only).
    """
    part_losses: list[list[float]] = [[], []]
    rank1: dict[str, Any] = {}
    own: dict[str, torch.Tensor] = {}
    seen: list[torch.Tensor] = []

    def loss_fn(
        model: BatchNormNet, x: torch.Tensor, y: torch.Tensor, part0: list[int], part1: list[int], i: int
    ):
        nonlocal own
        if not own:
            own = _bn_buffers(model)
        before = _bn_buffers(model)
        loss0 = model.training_step((x[part0], y[part0]), i)
        after0 = _bn_buffers(model)
        _set_bn_buffers(model, before)
        hook = model.bn.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
        loss1 = model.training_step((x[part1], y[part1]), i)
        hook.remove()
        rank1["broadcast"] = _bn_buffers(model)
        _set_bn_buffers(model, after0)
        # Rank 1 on its own: the same update from its own statistics of the step before.
        F.batch_norm(
            seen[-1], own["bn.running_mean"], own["bn.running_var"], training=True, momentum=model.bn.momentum
        )
        own["bn.num_batches_tracked"] += 1
        part_losses[0].append(loss0.item())
        part_losses[1].append(loss1.item())
        return (loss0 + loss1) / 2

    model, _ = one_process(cell, loss_fn=loss_fn)
    rank1["own"] = own
    return model, part_losses, _bn_buffers(model), rank1


@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_batchnorm_trains_per_rank_statistics_not_the_one_process_function(
    runs: dict[str, Path], plugin: str
) -> None:
    """What the warning says, in numbers.

    Each rank's losses and both ranks' weights equal one process normalising each rank's part on
    its own; rank 0's running statistics follow rank 0's parts; rank 1's are rank 0's of the step
    before updated by its own part (DDP, ShardedDDP, ZeRO broadcast buffers) or its own parts
    only (FSDP); and the weights are far from one process on the whole batch.
    """
    for cell in _cells(plugin, "batchnorm"):
        ranks = _ranks(runs[plugin], cell)
        model, part_losses, rank0_buffers, rank1_buffers = per_rank_batchnorm(cell)
        for rank, result in enumerate(ranks):
            diff = (
                (result["losses"] - torch.tensor(part_losses[rank], dtype=torch.float64)).abs().max().item()
            )
            assert diff <= LOSS_ATOL, f"{plugin} {cell} rank {rank}: losses differ by {diff:.3g}"
        expected = {k: v for k, v in model.state_dict().items() if not k.startswith("bn.running")}
        expected.pop("bn.num_batches_tracked")
        params = list(expected)
        for rank, result in enumerate(ranks):
            diff = _max_diff(result["weights"], expected, params)
            assert diff <= WEIGHT_ATOL, f"{plugin} {cell} rank {rank}: parameters differ by {diff:.3g}"
        # The two ways rank 1's statistics can go are far apart, so the check below tells them apart.
        assert (
            _max_diff(rank1_buffers["broadcast"], rank1_buffers["own"], ["bn.running_mean"])
            > BATCHNORM_DIFFERS_BY
        )
        rank1_expected = rank1_buffers["broadcast" if plugin in BROADCASTS_BUFFERS else "own"]
        for rank, buffers in ((0, rank0_buffers), (1, rank1_expected)):
            diff = _max_diff(ranks[rank]["weights"], buffers, list(buffers))
            assert diff <= WEIGHT_ATOL, (
                f"{plugin} {cell} rank {rank}: running statistics differ by {diff:.3g}"
            )
            assert int(ranks[rank]["weights"]["bn.num_batches_tracked"]) == STEPS
        assert _max_diff(rank0_buffers, rank1_expected, ["bn.running_mean"]) > BATCHNORM_DIFFERS_BY
        whole_batch, _ = one_process(cell)
        diff = _max_diff(ranks[0]["weights"], whole_batch.state_dict(), params)
        assert diff > BATCHNORM_DIFFERS_BY, (
            f"{plugin}: BatchNorm matched one process ({diff:.3g}): drop the warning?"
        )


@pytest.mark.timeout(60)
def test_batchnorm_on_one_process_is_not_warned_about_and_is_the_one_process_function() -> None:
    """World size 1 (SingleDevicePlugin): nothing to warn about, and the Trainer's run is the plain loop's."""
    seed_everything(SEED, verbose=False)
    model = BatchNormNet("sgd")
    trainer = quiet_trainer(plugins=[SingleDevicePlugin()], max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, DataLoader(dataset(), batch_size=WORLD * BATCH))
    assert [str(w.message) for w in caught if "BatchNorm" in str(w.message)] == []
    seed_everything(SEED, verbose=False)
    reference = BatchNormNet("sgd")
    optimizer = reference.configure_optimizers()
    x, y = dataset().tensors
    for i in range(STEPS):
        rows = slice(i * WORLD * BATCH, (i + 1) * WORLD * BATCH)
        reference.training_step((x[rows], y[rows]), i).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert model.losses == pytest.approx(reference.losses, abs=LOSS_ATOL)
    _assert_weights(model.state_dict(), reference.state_dict(), "single device")


def test_batchnorm_warning_lists_the_first_layers_and_skips_sync_batchnorm() -> None:
    """A deep model is named by its first three BatchNorm layers and a count; SyncBatchNorm is already right."""
    layers = [torch.nn.BatchNorm1d(4) for _ in range(5)] + [torch.nn.SyncBatchNorm(4)]
    deep = torch.nn.Sequential(*layers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_batch_norm(deep, "DDPPlugin", 4, "note")
        warn_if_batch_norm(
            torch.nn.Sequential(torch.nn.SyncBatchNorm(4), torch.nn.LayerNorm(4)), "DDPPlugin", 4, "x"
        )
    assert len(caught) == 1
    assert (
        "Sequential has BatchNorm layers (0, 1, 2 and 2 more) and DDPPlugin trains it on 4 processes"
        in str(caught[0].message)
    )


# ---------------------------------------------------------------------- (e) dropout: reproducible, and exact given its masks
def _dropout_cells(plugin: str) -> list[str]:
    return _cells(plugin, "dropout")


@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", PLUGINS)
def test_dropout_trains_one_process_replaying_the_ranks_masks(runs: dict[str, Path], plugin: str) -> None:
    """Given the masks the ranks drew, the run is exactly one process on the combined batch with those masks.

    Seeded alike (``seed_everything`` on every rank, as in Lightning), both ranks draw the *same*
    mask sequence, for different samples: a one-process run draws independent masks per sample,
    so it matches the two-rank run in distribution only, never bit for bit.
    """
    for cell in _dropout_cells(plugin):
        ranks = _ranks(runs[plugin], cell)
        masks = [r["masks"] for r in ranks]
        assert masks[0].shape == (STEPS, BATCH, 16)
        assert torch.equal(masks[0], masks[1]), f"{plugin}: the ranks drew different dropout masks"
        kept = masks[0].float().mean().item()
        assert 0.6 < kept < 0.8, f"{plugin}: {kept:.2f} of the units kept, expected about 0.7"
        assert any(not torch.equal(masks[0][0], masks[0][k]) for k in range(1, STEPS))
        _, optimizer, _ = parse_cell(cell)
        seed_everything(SEED, verbose=False)
        replay = DropoutNet(optimizer, replay=[torch.cat([masks[0][k], masks[1][k]]) for k in range(STEPS)])
        reference, losses = one_process(cell, model=replay)
        _assert_losses([r["losses"] for r in ranks], losses, f"{plugin} {cell}")
        expected = reference.state_dict()
        for rank, result in enumerate(ranks):
            _assert_weights(result["weights"], expected, f"{plugin} {cell} rank {rank}")


@pytest.mark.timeout(600 if FULL else 150)
@pytest.mark.parametrize("plugin", [p for p in PLUGINS if _repeated(p)])
def test_dropout_run_repeats_bit_for_bit_with_the_same_seed(runs: dict[str, Path], plugin: str) -> None:
    """A second fit from the same seed draws the same masks and ends in the same losses and weights."""
    for cell in _repeated(plugin):
        first, second = _ranks(runs[plugin], cell), _ranks(runs[plugin], f"{cell}@2")
        for rank in range(WORLD):
            assert torch.equal(first[rank]["masks"], second[rank]["masks"])
            assert torch.equal(first[rank]["losses"], second[rank]["losses"])
            for name, value in first[rank]["weights"].items():
                assert torch.equal(value, second[rank]["weights"][name]), (
                    f"{plugin} {cell} rank {rank}: {name}"
                )


# ---------------------------------------------------------------------- the matrix itself
def test_the_default_cells_cover_every_pair_of_factors() -> None:
    """``make test`` meets every plugin x module, plugin x optimizer and module x optimizer pair."""
    seen = [(p, *parse_cell(c)) for p in PLUGINS for c in cells_for(p)]
    pairs = {(p, m) for p, m, _, _ in seen}
    # ddp_spawn (DDP's code, spawned) trains one module per kind of check; the others meet every module.
    assert pairs >= {(p, m) for p in PLUGINS if p != "ddp_spawn" for m in MODULES}
    assert {m for p, m in pairs if p == "ddp_spawn"} >= {"functional", "batchnorm", "dropout"}
    assert {(p, o) for p, _, o, _ in seen} >= {(p, o) for p in PLUGINS for o in OPTIMIZERS}
    assert {(m, o) for _, m, o, _ in seen} >= {(m, o) for m in MODULES for o in OPTIMIZERS}
    accumulated = {(m, o) for _, m, o, a in seen if a > 1}
    assert {m for m, _ in accumulated} == set(EXACT) and {o for _, o in accumulated} == set(OPTIMIZERS)
    assert _repeated("ddp"), "the dropout cell must run twice somewhere"
