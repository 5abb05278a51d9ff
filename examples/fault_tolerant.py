"""Train the digits classifier as two replica groups that survive one of them dying (``"ddp_ft"``, torchft).

On one machine the plugin starts everything itself: torchft's lighthouse and replica group 0 in
this process, group 1 as this script started again, and group 1 again whenever it dies. Run::

    python examples/fault_tolerant.py                       # two groups, nothing fails
    python examples/fault_tolerant.py --kill-group-at 30    # group 1 SIGKILLs itself at step 30

With ``--kill-group-at``, group 0 goes on alone for a few steps (the log names the group that left),
the launcher starts group 1 again, and it joins the next quorum with group 0's weights, optimizer
and position, received over the network, not from a file. Group 0 prints, at the end, the steps
each set of groups trained and the validation accuracy. On a cluster, start one ``torchrun
--nproc-per-node 1`` per group with ``REPLICA_GROUP_ID``, ``NUM_REPLICA_GROUPS`` and
``TORCHFT_LIGHTHOUSE`` set (docs/fault-tolerance.md).

Needs ``pip install 'trainer-core[ft]'`` (torchft).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from digits import DigitsClassifier, build_datamodule

from trainer_core import Trainer, seed_everything
from trainer_core.callbacks import Callback
from trainer_core.plugins import FaultTolerantDDPPlugin
from trainer_core.plugins.ddp_ft import RESTARTS_VARIABLE


class DieAt(Callback):
    """Group 1, first start only: SIGKILL at a step, as a machine that fails would leave it."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        first_start = os.environ.get(RESTARTS_VARIABLE, "0") == "0"
        if trainer.global_rank == 1 and first_start and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=120)
    parser.add_argument("--kill-group-at", type=int, default=0)
    parser.add_argument("--default-root-dir", default="ft_runs")
    args = parser.parse_args(argv)

    seed_everything(7)
    plugin = FaultTolerantDDPPlugin(replica_groups=args.groups)
    trainer = Trainer(
        plugins=plugin,
        max_steps=args.max_steps,
        max_epochs=-1,
        callbacks=[DieAt(args.kill_group_at)] if args.kill_group_at else [],
        default_root_dir=args.default_root_dir,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    model = DigitsClassifier()
    trainer.fit(model, datamodule=build_datamodule())
    if trainer.is_global_zero:
        trained: dict[str, int] = {}
        for run in plugin.steps_record:
            key = f"groups {run['groups']}" if run["committed"] else "steps that did not commit"
            trained[key] = trained.get(key, 0) + run["batches"]
        for key, batches in trained.items():
            print(f"{key}: {batches} batches")
        accuracy = float(trainer.callback_metrics.get("val_acc", float("nan")))
        print(f"global_step={trainer.global_step} val_acc={accuracy:.3f}")


if __name__ == "__main__":
    main()
