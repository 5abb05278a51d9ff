"""``FSDPPlugin`` on its own: FSDP2 (``fully_shard``) on a real 2-rank gloo group, through the plugin's public methods.

One launch of ``tests/jobs/plugin_unit_job.py fsdp`` (a few seconds): ``setup`` shards a small
module, two batches accumulate (the first under ``no_backward_sync``), Adam steps, and the states
are read as ``"full"`` and ``"sharded"``; another module loads the full ones. Every number is
compared with one process holding the unsharded module. End-to-end training, sharded folders on
disk and resuming are ``tests/plugins/test_distributed.py`` and ``tests/checkpoint/``; the bucketed
gather behind ``"full"`` is ``test_fsdp_gather.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_jobs import assert_tensors_close, run_case
from torch.distributed.fsdp import MixedPrecisionPolicy

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import DistributedCheckpointIO, FSDPPlugin, TorchCheckpointIO

pytestmark = pytest.mark.timeout(120)
NAMES = ["layer.weight", "layer.bias", "head.weight", "head.bias"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_case(tmp_path_factory.mktemp("fsdp"), "fsdp")


def test_the_mesh_shards_over_every_rank(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(ranks):
        assert (facts["mesh_dims"], facts["mesh_size"]) == (("data_parallel",), 2)
        # The module sees the same mesh before configure_model (module.device_mesh).
        assert facts["module_mesh_dims"] == ("data_parallel",)
        assert facts["layout"] == {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1}
        assert facts["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        # Each rank holds the gradient shards of its parameter shards: the scaler agrees on inf over all.
        assert facts["grad_scaler"] == "ShardedGradScaler"


def test_the_full_state_dict_is_the_unsharded_modules_on_rank_0(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    assert_tensors_close(rank0["initial_full"], rank0["initial_weights"], 0.0, "before training")
    assert list(rank0["full"]) == NAMES
    assert_tensors_close(rank0["full"], rank0["reference_weights"], 1e-6, "after a step")
    assert rank1["initial_full"] == {} and rank1["full"] == {}


def test_no_backward_sync_then_one_reduction_of_the_accumulated_sum(ranks: list[dict[str, Any]]) -> None:
    """The gradients of both batches of both ranks, averaged over the ranks, reduced once."""
    for rank, facts in enumerate(ranks):
        assert facts["sharded_grads_without_sync"] == [], f"rank {rank} reduced under no_backward_sync"
        assert_tensors_close(facts["grads"], facts["reference_grads"], 1e-6, f"rank {rank}")


def test_the_sharded_state_dict_holds_each_ranks_shards_of_the_same_weights(
    ranks: list[dict[str, Any]],
) -> None:
    for rank, facts in enumerate(ranks):
        assert facts["sharded_types"] == ["DTensor"]
        assert_tensors_close(facts["sharded_full"], facts["reference_weights"], 1e-6, f"rank {rank}")
        assert facts["checkpoint_io"] == "DistributedCheckpointIO"
    # Rows split along the first dimension: 6 rows -> 3 + 3; one row -> 1 + 0.
    shapes = [facts["sharded_local_shapes"] for facts in ranks]
    assert [s["layer.weight"] for s in shapes] == [(3, 4), (3, 4)]
    assert [s["head.weight"] for s in shapes] == [(1, 6), (0, 6)]


def test_the_full_optimizer_state_is_name_keyed_on_rank_0(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = ranks
    state = rank0["full_optimizer"]
    assert sorted(state["state"]) == sorted(NAMES)
    assert_tensors_close(state["state"], rank0["reference_named_state"]["state"], 1e-6, "Adam state")
    assert [group["params"] for group in state["param_groups"]] == [NAMES]
    assert rank1["full_optimizer"] == {}


def test_full_states_load_into_a_differently_initialised_sharded_module(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(ranks):
        assert_tensors_close(facts["loaded_full"], facts["reference_weights"], 1e-6, f"rank {rank} weights")
    assert_tensors_close(ranks[0]["loaded_optimizer"], ranks[0]["full_optimizer"], 0.0, "optimizer")
    assert ranks[1]["loaded_optimizer"] == {}


def test_state_dict_type_chooses_the_checkpoint_io() -> None:
    assert isinstance(FSDPPlugin().checkpoint_io, TorchCheckpointIO)
    assert isinstance(FSDPPlugin(state_dict_type="sharded").checkpoint_io, DistributedCheckpointIO)
    with pytest.raises(MisconfigurationException) as raised:
        FSDPPlugin(state_dict_type="local")
    assert str(raised.value) == (
        "FSDPPlugin(state_dict_type='local'): use 'full' (one file, written by rank 0) or "
        "'sharded' (a folder, every rank writes its shard)."
    )


def test_hybrid_shard_must_cover_the_world() -> None:
    plugin = FSDPPlugin(hybrid_shard=(2, 2))
    plugin.configure_devices("cpu", 1, 1)
    with pytest.raises(MisconfigurationException) as raised:
        plugin.parallel_dims  # noqa: B018
    assert str(raised.value) == (
        "FSDPPlugin(hybrid_shard=(2, 2)) needs 4 processes, but the run has 1; make replicas x shards equal "
        "devices x num_nodes."
    )


def test_checkpoint_weights_load_after_setup_makes_the_shards() -> None:
    assert FSDPPlugin.restore_checkpoint_after_setup is True
    assert FSDPPlugin.optimizer_in_backward_unsupported is None
    # The cycle's unsharded gradients are saved; not with a reduce_dtype of FSDP's own (no public API reads it).
    assert FSDPPlugin().mid_accumulation_gradients_unsaved is None
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert "reduce_dtype=torch.float32" in str(
        FSDPPlugin(mixed_precision=policy).mid_accumulation_gradients_unsaved
    )
