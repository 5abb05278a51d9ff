"""``AdvancedProfiler``: Python's ``cProfile`` per action, reported as ``pstats`` tables."""

from __future__ import annotations

import cProfile
import io
import os
import pstats
from pathlib import Path
from typing import Any, Optional, Union

from trainer_core.profilers.base import Profiler


class AdvancedProfiler(Profiler):
    """Which functions each action spends its time in: one ``cProfile`` per action, sorted by cumulative time.

    Args:
        dirpath: Folder of the report file (and of the ``.prof`` files); ``None``: the Trainer's ``log_dir``.
        filename: Write the report to ``{dirpath}/{stage}-{filename}.txt`` instead of the console.
        line_count_restriction: How many functions to list per action: a count, or a fraction (0 to 1)
            of them.
        dump_stats: Also write each action's raw profile to ``{dirpath}/{stage}-{filename}-{action}.prof``
            (for ``snakeviz``, ``pstats``).

    Only one ``cProfile`` can run at a time. Lightning switches the enclosing action's profile off
    for good when a nested one starts (``run_training_epoch`` then misses everything after its first
    batch); here the enclosing one resumes when the nested one stops.
    """

    def __init__(
        self,
        dirpath: Optional[Union[str, Path]] = None,
        filename: Optional[str] = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats
        self._active: list[str] = []

    def start(self, action_name: str) -> None:
        if self._active:
            self.profiled_actions[self._active[-1]].disable()
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            profile = self.profiled_actions[action_name] = cProfile.Profile()
        self._active.append(action_name)
        profile.enable()

    def stop(self, action_name: str) -> None:
        profile = self.profiled_actions.get(action_name)
        if profile is None or action_name not in self._active:
            raise ValueError(
                f"Attempting to stop recording an action ({action_name}) which was never started."
            )
        profile.disable()
        # Usually the innermost; remove the last occurrence so that the enclosing one resumes.
        del self._active[len(self._active) - 1 - self._active[::-1].index(action_name)]
        if self._active:
            self.profiled_actions[self._active[-1]].enable()

    def summary(self) -> str:
        stats = {}
        for action_name, profile in self.profiled_actions.items():
            if self.dump_stats:
                self._dump(action_name, profile)
            text = io.StringIO()
            pstats.Stats(profile, stream=text).strip_dirs().sort_stats("cumulative").print_stats(
                self.line_count_restriction
            )
            stats[action_name] = text.getvalue()
        return self._stats_to_str(stats)

    def _dump(self, action_name: str, profile: cProfile.Profile) -> None:
        if not self.dirpath:
            raise ValueError("AdvancedProfiler(dump_stats=True) needs a folder: pass `dirpath=`.")
        os.makedirs(self.dirpath, exist_ok=True)
        profile.dump_stats(os.path.join(self.dirpath, self._prepare_filename(action_name, extension=".prof")))

    def teardown(self, stage: Optional[str]) -> None:
        super().teardown(stage=stage)
        for name in self._active:
            self.profiled_actions[name].disable()
        self._active = []
        self.profiled_actions.clear()

    def __reduce__(self) -> tuple[Any, ...]:
        # A cProfile.Profile cannot be pickled; a profiler sent to spawned processes starts empty there.
        state = {
            "dirpath": self.dirpath,
            "filename": self.filename,
            "line_count_restriction": self.line_count_restriction,
            "dump_stats": self.dump_stats,
        }
        return (self.__class__, (), state)
