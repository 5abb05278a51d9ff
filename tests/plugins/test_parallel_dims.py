"""``ParallelDims`` on its own: the layout arithmetic, and the one mesh it builds on a real 2-rank gloo group.

The rank-to-coordinates table and the refusals are also checked in ``test_model_parallel.py``; here
the mesh itself: for each layout one launch of ``tests/jobs/plugin_unit_job.py parallel_dims`` records,
per rank and dimension, the ranks of that rank's group in ``submesh(name)``, and the test derives
the expected groups from ``coordinates`` alone, so "which ranks share a batch / a stage / a layer's
shards" has one answer.
"""

from __future__ import annotations

from typing import Any

import pytest
from rank_jobs import run_case

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import ParallelDims
from trainer_core.plugins.parallel_dims import DATA, DATA_REPLICATE, DATA_SHARD, PIPELINE, TENSOR

pytestmark = pytest.mark.timeout(120)
WORLD = 2
#: The layouts the job builds, with the sizes it gives ParallelDims.
LAYOUTS = {
    "dp2": {},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "hybrid": {"dp_replicate": 2, "dp_shard": 1},
}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_case(tmp_path_factory.mktemp("parallel_dims"), "parallel_dims")


def _place(dims: ParallelDims, rank: int) -> dict[str, int]:
    """Every mesh dimension's index of ``rank``, the hybrid pair included, from ``coordinates`` only."""
    place = dims.coordinates(rank)
    data = place[DATA]
    place[DATA_REPLICATE], place[DATA_SHARD] = divmod(data, dims.dp_shard)
    return place


def _expected_group(dims: ParallelDims, rank: int, name: str) -> list[int]:
    """The ranks that differ from ``rank`` only along ``name``: its group in that dimension."""
    if name == DATA:
        fixed = (PIPELINE, TENSOR)
    else:
        fixed = tuple(other for other in (*dims.dim_names, PIPELINE, TENSOR) if other != name)
    mine = _place(dims, rank)
    return [r for r in range(dims.world_size) if all(_place(dims, r)[d] == mine[d] for d in fixed)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_mesh_group_holds_the_ranks_its_coordinates_say(
    ranks: list[dict[str, Any]], layout: str
) -> None:
    dims = ParallelDims(WORLD, **LAYOUTS[layout])
    for rank, facts in enumerate(ranks):
        built = facts[layout]
        assert built["dim_names"] == dims.dim_names and built["shape"] == dims.shape
        for name, group in built["groups"].items():
            assert group == _expected_group(dims, rank, name), f"{layout}: rank {rank}'s {name} group"
        # Built once: later callers get the same mesh (and so the same process groups).
        assert built["same_mesh"]


def test_the_groups_the_layouts_give(ranks: list[dict[str, Any]]) -> None:
    """The two ranks together: in one data-parallel group for dp2 and hybrid, one tensor group for tp2, one pipeline for pp2."""
    rank0 = ranks[0]
    assert rank0["dp2"]["groups"][DATA] == [0, 1] and rank0["dp2"]["groups"][TENSOR] == [0]
    assert rank0["tp2"]["groups"][TENSOR] == [0, 1] and rank0["tp2"]["groups"][DATA] == [0]
    assert rank0["pp2"]["groups"][PIPELINE] == [0, 1] and rank0["pp2"]["groups"][DATA] == [0]
    hybrid = rank0["hybrid"]["groups"]
    assert (hybrid[DATA], hybrid[DATA_REPLICATE], hybrid[DATA_SHARD]) == ([0, 1], [0, 1], [0])
    # fully_shard takes the shard dimension, or (replicate, shard) under hybrid sharding.
    assert rank0["dp2"]["sharding_dims"] == (DATA,)
    assert rank0["hybrid"]["sharding_dims"] == (DATA_REPLICATE, DATA_SHARD)


def test_dp_shard_takes_what_the_other_sizes_leave() -> None:
    dims = ParallelDims(12, tp=2, pp=3)
    assert (dims.dp_shard, dims.dp, dims.shape) == (2, 2, (3, 2, 2))
    assert ParallelDims(8, dp_replicate=2, tp=2).dp_shard == 2


def test_the_sharding_mesh_needs_the_processes() -> None:
    with pytest.raises(
        RuntimeError, match=r"^FSDPPlugin: the device mesh is built once the processes have started\.$"
    ):
        ParallelDims(1, owner="FSDPPlugin").sharding_mesh()


def test_plugins_describe_their_layout_with_it() -> None:
    from trainer_core.plugins import DDPPlugin, FSDPPlugin, SingleDevicePlugin

    assert SingleDevicePlugin().parallel_dims is None
    assert SingleDevicePlugin().layout() == {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1}
    for plugin in (DDPPlugin(), FSDPPlugin()):
        plugin.configure_devices("cpu", 1, 1)
        dims = plugin.parallel_dims
        assert (dims.world_size, dims.dp, dims.shape, dims.owner) == (1, 1, (1, 1, 1), type(plugin).__name__)
        assert plugin.layout() == {"pipeline_parallel": 1, "data_parallel": 1, "tensor_parallel": 1}


def test_a_layout_that_does_not_fill_the_world_names_the_owner() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"^FSDPPlugin: the parallel sizes \(pipeline 1, tensor 1, "
    ):
        ParallelDims(3, dp_replicate=2, owner="FSDPPlugin")
