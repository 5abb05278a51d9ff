"""``SimpleProfiler``: the wall time of every action, as a table of mean, calls, total and share of the run."""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional, Union

from trainer_core.profilers.base import Profiler


class SimpleProfiler(Profiler):
    """Records how long each action takes and reports, per action, the mean and total time.

    Args:
        dirpath: Folder of the report file; ``None``: the Trainer's ``log_dir``.
        filename: Write the report to ``{dirpath}/{stage}-{filename}.txt`` instead of the console.
        extended: Add the number of calls and each action's share of the time since the profiler
            was made (Lightning's default, kept).

    Durations accumulate over every run the profiler sees (``fit`` then ``test`` report both), as in
    Lightning. Nested actions each count their whole time: ``run_training_epoch`` includes its
    ``run_training_batch`` calls, so shares do not add up to 100 %.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        extended: bool = True,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: defaultdict[str, list[float]] = defaultdict(list)
        self.extended = extended
        self.start_time = time.perf_counter()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        end = time.perf_counter()
        started = self.current_actions.pop(action_name, None)
        if started is None:
            raise ValueError(
                f"Attempting to stop recording an action ({action_name}) which was never started."
            )
        self.recorded_durations[action_name].append(end - started)

    def summary(self) -> str:
        sep = os.linesep
        title = f"{self._stage.upper()} Profiler Report" if self._stage else "Profiler Report"
        if not self.recorded_durations:
            return title + sep
        width = max(len(k) for k in self.recorded_durations)
        if self.extended:
            columns = ("Action", "Mean duration (s)", "Num calls", "Total time (s)", "Percentage %")
            total_time = time.perf_counter() - self.start_time
            rows = []
            for action, durations in self.recorded_durations.items():
                total = math.fsum(durations)
                rows.append(
                    (action, total / len(durations), len(durations), total, 100.0 * total / total_time)
                )
            rows.sort(key=lambda r: r[4], reverse=True)
            body = [_row(width, "Total", "-", str(sum(r[2] for r in rows)), f"{total_time:.5}", "100 %")]
            table = [_row(width, a, f"{m:.5}", str(n), f"{t:.5}", f"{p:.5}") for a, m, n, t, p in rows]
        else:
            columns = ("Action", "Mean duration (s)", "Total time (s)")
            means = [(a, math.fsum(d) / len(d), math.fsum(d)) for a, d in self.recorded_durations.items()]
            means.sort(key=lambda r: r[1], reverse=True)
            body = []
            table = [_row(width, a, f"{m:.5}", f"{t:.5}") for a, m, t in means]
        header = _row(width, *columns)
        rule = "-" * len(header.expandtabs())
        lines = [title, "", rule, header, rule]
        if body:
            lines += [*body, rule]
        lines += [*table, rule, ""]
        return sep.join(lines)


def _row(width: int, action: str, *cells: str) -> str:
    """One table row in Lightning's layout: the action padded to the longest name, then tab-separated cells."""
    return f"|  {action:<{width}s}\t|" + "".join(f"  {cell:<15}\t|" for cell in cells)
