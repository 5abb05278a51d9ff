"""``ZeroPlugin`` on its own: DDP with torch's ``ZeroRedundancyOptimizer``, on a real 2-rank gloo group.

One launch of ``tests/jobs/plugin_unit_job.py zero`` (a few seconds) trains three steps by hand
through the plugin's public methods and records the weights and optimizer states each rank holds;
the rules checked are listed in ``rank_jobs.assert_sharded_optimizer_facts``. End-to-end training
and resuming under ``"zero"`` are ``tests/plugins/test_distributed.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_jobs import assert_sharded_optimizer_facts, run_case

from trainer_core.plugins import ZeroPlugin

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_case(tmp_path_factory.mktemp("zero"), "zero")


def test_the_optimizer_is_sharded_and_ddp_reduces_the_gradients(ranks: list[dict[str, Any]]) -> None:
    for facts in ranks:
        assert (facts["plugin"], facts["optimizer"]) == ("ZeroPlugin", "ZeroRedundancyOptimizer")
        assert facts["wrapper"] == "DistributedDataParallel"
        # Every rank holds every averaged gradient: torch's own scaler sees the same inf everywhere.
        assert facts["grad_scaler"] == "GradScaler"


def test_training_consolidation_and_repartitioning(ranks: list[dict[str, Any]]) -> None:
    assert_sharded_optimizer_facts(ranks)


def test_one_process_keeps_the_users_optimizer() -> None:
    plugin = ZeroPlugin()
    plugin.configure_devices("cpu", 1, 1)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    assert plugin.wrap_optimizer(optimizer) is optimizer
