"""``DDPShardedPlugin`` on its own: fairscale ``OSS`` and ``ShardedDataParallel`` on a real 2-rank gloo group.

One launch of ``tests/jobs/plugin_unit_job.py ddp_sharded`` (a few seconds) trains three steps by
hand through the plugin's public methods, with gradients clipped by their total norm (which
``OSS.clip_grad_norm`` adds up over the ranks' shards), and records the weights and optimizer states
each rank holds; the rules checked are listed in ``rank_jobs.assert_sharded_optimizer_facts``.
End-to-end training and resuming under ``"ddp_sharded"`` are ``tests/plugins/test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
from rank_jobs import assert_sharded_optimizer_facts, run_case

pytest.importorskip("fairscale")
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_case(tmp_path_factory.mktemp("sharded"), "ddp_sharded")


def test_oss_and_sharded_data_parallel_are_built(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        assert (facts["plugin"], facts["optimizer"], facts["wrapper"]) == (
            "DDPShardedPlugin",
            "OSS",
            "ShardedDataParallel",
        )
        # Each gradient is reduced to its owner only: an inf shows on one rank, so the scaler agrees over all.
        assert facts["grad_scaler"] == "ShardedGradScaler"


def test_training_consolidation_and_repartitioning(ranks: list[dict[str, Any]]) -> None:
    assert_sharded_optimizer_facts(ranks)


def test_a_one_process_run_wraps_nothing_before_the_optimizers_exist() -> None:
    from torch import nn

    from trainer_core.plugins import DDPShardedPlugin

    plugin = DDPShardedPlugin()
    plugin.configure_devices("cpu", 1, 1)
    module = nn.Linear(2, 1)
    # ShardedDataParallel needs the OSS optimizers it reduces for; without any the module runs as it is.
    assert plugin.wrap_model(module) is module
