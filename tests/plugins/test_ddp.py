"""``DDPPlugin`` on its own: a real 2-rank gloo group, driven through the plugin's public methods.

One launch of ``tests/jobs/plugin_unit_job.py ddp`` (a few seconds) records what each rank saw; the
tests check it against the gradients each rank computes alone. End-to-end training under DDP (and
its checkpoints) is ``tests/plugins/test_distributed.py``; the arguments passed on to
``DistributedDataParallel`` are ``test_plugin_config.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_jobs import assert_tensors_close, run_case

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins import DDPPlugin

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_case(tmp_path_factory.mktemp("ddp"), "ddp")


def test_ranks_and_the_data_parallel_layout(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(ranks):
        assert (facts["rank"], facts["world_size"], facts["is_global_zero"]) == (rank, 2, rank == 0)
        assert facts["sampler_kwargs"] == {"num_replicas": 2, "rank": rank}
        assert facts["layout"] == {"pipeline_parallel": 1, "data_parallel": 2, "tensor_parallel": 1}
        assert facts["wrapper"] == "DistributedDataParallel"
        # Every rank holds all of its gradients, averaged: torch's own scaler agrees on inf everywhere.
        assert facts["grad_scaler"] == "GradScaler"


def test_no_backward_sync_keeps_each_ranks_own_gradient(ranks: list[dict[str, Any]]) -> None:
    for rank, facts in enumerate(ranks):
        assert_tensors_close(facts["grads_without_sync"], facts["local_first"], 1e-6, f"rank {rank}")
    first = ranks[0]["grads_without_sync"]["layer.weight"]
    assert not torch.allclose(first, ranks[1]["grads_without_sync"]["layer.weight"]), (
        "the ranks' gradients agree: the batch under no_backward_sync was all-reduced"
    )


def test_the_next_synced_backward_averages_the_accumulated_sum(ranks: list[dict[str, Any]]) -> None:
    """Both batches of both ranks: (sum over ranks of first + second) / 2, identical on every rank."""
    expected = {
        name: sum(facts[part][name] for facts in ranks for part in ("local_first", "local_second")) / 2
        for name in ranks[0]["local_first"]
    }
    for rank, facts in enumerate(ranks):
        assert_tensors_close(facts["grads_after_sync"], expected, 1e-6, f"rank {rank}")


def test_collectives(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        # Each rank gives rank + 1.
        assert facts["reduce"] == {"sum": 3.0, "mean": 1.5, "max": 2.0, "min": 1.0}
        assert facts["broadcast"] == {"from": 0}
        assert facts["all_gather"].tolist() == [[0, 0], [1, 10]]
        assert facts["all_gather_object"] == ["rank0", "rank1"]
        # True on rank 0 only: not every rank holds it, some rank does.
        assert (facts["decision_all"], facts["decision_any"]) == (False, True)


def test_each_rank_draws_its_own_part_of_the_data(ranks: list[dict[str, Any]]) -> None:
    """Nine samples over two ranks: training and validation pad to equal parts; prediction gives each sample once."""
    train = [facts["train_indices"] for facts in ranks]
    assert train == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 0]]
    assert [facts["val_indices"] for facts in ranks] == train
    assert [facts["predict_indices"] for facts in ranks] == [[0, 2, 4, 6, 8], [1, 3, 5, 7]]
    assert all(facts["kept_loader"] for facts in ranks), "use_distributed_sampler=False changed the loader"


def test_a_plain_optimizers_state_is_full_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    # The consolidation rule applies to sharded optimizers only (test_zero.py, test_sharded.py).
    assert [facts["plain_state_params"] for facts in ranks] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_one_process_needs_no_wrapper_and_no_collective() -> None:
    plugin = DDPPlugin()
    plugin.configure_devices("cpu", 1, 1)
    module = torch.nn.Linear(2, 1)
    assert plugin.world_size == 1 and plugin.wrap_model(module) is module
    assert plugin.reduce(torch.tensor(3.0), reduce_op="sum").item() == 3.0
    assert plugin.broadcast("x") == "x" and plugin.all_gather_object(1) == [1]
    assert plugin.all_gather(torch.tensor([5])).tolist() == [[5]]


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(MisconfigurationException) as raised:
        DDPPlugin(start_method="thread")
    assert str(raised.value) == (
        "DDPPlugin(start_method='thread'): use 'popen' (re-run the script), 'spawn', 'fork' or 'forkserver'."
    )
