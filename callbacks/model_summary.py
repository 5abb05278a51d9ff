"""``ModelSummary`` and ``RichModelSummary``: the table of the module's layers at the start of ``fit``.

The Trainer adds one when ``enable_model_summary`` is on (the default) and the user gave none: a
``RichModelSummary`` when ``rich`` is installed, else a ``ModelSummary``, as Lightning does. The
summary itself (layers, sizes on ``example_input_array``, totals) is ``trainer_core.summary``; these
callbacks only decide when and how it is shown.
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING, Any

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.summary import (
    format_summary_table,
    get_formatted_model_size,
    get_human_readable_count,
    summarize,
)

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

log = logging.getLogger("trainer_core")


class ModelSummary(Callback):
    """Log the summary of the module's layers once, at ``on_fit_start``, on global rank 0.

    Every rank builds the summary (its dry run on ``example_input_array`` is a forward, which a
    sharded module runs on all ranks together); rank 0 shows it.

    Args:
        max_depth: how deep into nested modules the table goes; ``-1`` every layer, ``0`` no summary.
        **summarize_kwargs: passed on to :meth:`summarize` (``RichModelSummary`` reads ``header_style``).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise MisconfigurationException(
                f"ModelSummary(max_depth={max_depth!r}): use -1 (every layer), 0 (no summary) or a depth > 0."
            )
        self._max_depth = max_depth
        self._summarize_kwargs = summarize_kwargs

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._max_depth:
            return
        summary = summarize(pl_module, max_depth=self._max_depth)
        data = summary.summary_data()
        if trainer.is_global_zero:
            self.summarize(
                data,
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=summary.total_flops,
                **self._summarize_kwargs,
            )

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        """Show the table (Lightning's signature, so a subclass can send it elsewhere)."""
        table = format_summary_table(
            total_parameters,
            trainable_parameters,
            model_size,
            total_training_modes,
            total_flops,
            *summary_data,
        )
        log.info("\n" + table)


class RichModelSummary(ModelSummary):
    """The same summary drawn as a ``rich`` table (needs ``pip install rich``).

    Args:
        max_depth: as for :class:`ModelSummary`.
        **summarize_kwargs: ``header_style`` (default ``"bold magenta"``).
    """

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if not rich_available():
            raise ModuleNotFoundError(
                "RichModelSummary needs the `rich` package, which is not installed: `pip install rich`, "
                "or use ModelSummary."
            )
        super().__init__(max_depth, **summarize_kwargs)

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        from rich import get_console
        from rich.table import Table

        headers = [header for header, _ in summary_data]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        table.add_column(" ", style="dim")
        table.add_column("Name", justify="left", no_wrap=True)
        table.add_column("Type")
        table.add_column("Params", justify="right")
        table.add_column("Mode")
        table.add_column("FLOPs", justify="right")
        for header in ("In sizes", "Out sizes"):
            if header in headers:
                table.add_column(header, justify="right", style="white")
        for row in zip(*(cells for _, cells in summary_data)):
            table.add_row(*row)
        console = get_console()
        console.print(table)

        grid = Table.grid(expand=True)
        grid.add_column()
        totals = [
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", str(total_training_modes["train"])),
            ("Modules in eval mode", str(total_training_modes["eval"])),
            ("Total FLOPs", get_human_readable_count(total_flops)),
        ]
        for label, value in totals:
            grid.add_row(f"[bold]{label}[/]: {value:<10}")
        console.print(grid)


def rich_available() -> bool:
    try:
        import_rich_console()
    except ImportError:
        return False
    return True


def import_rich_console() -> Any:
    """``rich.console``, imported without moving Python's ``random``: ``rich.style`` draws 24 bits from it when
    first imported. Lightning imports rich with itself, before a program seeds; importing it later, at fit, would
    shift every draw a seeded program makes after that (a sampler's ``random.choices``, say)."""
    state = random.getstate()
    try:
        import rich.console
    finally:
        random.setstate(state)
    return rich.console
