"""The model summary: one row per layer, the parameter totals, and the layers' sizes on an example input.

The ``ModelSummary`` and ``RichModelSummary`` callbacks (the default summary at the start of ``fit``
when ``enable_model_summary``) print what :func:`summarize` collects here; this is the one
implementation. It follows Lightning's ``utilities.model_summary``: the same columns (Name, Type,
Params, Mode, FLOPs, and In sizes / Out sizes when the module has ``example_input_array``), the same
totals and the same number format, so a table reads the same under either trainer.

Sizes come from forward hooks during one dry run of the module itself on its example input, under
``torch.no_grad`` and in eval mode (each layer's mode is put back afterwards): no copy of the model.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode
from torch.utils.hooks import RemovableHandle

UNKNOWN_SIZE = "?"
LEFTOVER_PARAMS_NAME = "other params"
NOT_APPLICABLE = "n/a"
_UNITS = (" ", "K", "M", "B", "T")
# Bits per parameter of each precision; mixed precisions keep float32 parameters.
_PRECISION_BITS = {"64-true": 64, "32-true": 32, "16-true": 16, "bf16-true": 16}


class LayerSummary:
    """One layer: its type, parameter count, mode, and the input and output sizes of its first call."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module
        self._in_size: Optional[Union[str, list]] = None
        self._out_size: Optional[Union[str, list]] = None
        self._handle: Optional[RemovableHandle] = None
        if not isinstance(module, torch.jit.ScriptModule):
            self._handle = module.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        # The first call only: a layer called twice in one forward (a shared block) keeps its first sizes.
        inputs = (*args, *kwargs.values()) if kwargs else args
        self._in_size = parse_batch_shape(inputs[0] if len(inputs) == 1 else inputs)
        self._out_size = parse_batch_shape(out)
        self.detach_hook()

    def detach_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    @property
    def in_size(self) -> Union[str, list]:
        return self._in_size or UNKNOWN_SIZE

    @property
    def out_size(self) -> Union[str, list]:
        return self._out_size or UNKNOWN_SIZE

    @property
    def layer_type(self) -> str:
        return type(self._module).__name__

    @property
    def num_parameters(self) -> int:
        return sum(_numel(p) for p in self._module.parameters())

    @property
    def training(self) -> bool:
        return self._module.training


class ModelSummary:
    """The summary of ``model`` down to ``max_depth`` levels (``-1``: every layer; ``0``: no layer rows).

    ``str(summary)`` is Lightning's table; the callbacks print it. ``precision`` (the Trainer's
    precision name) sets the bytes per parameter of the estimated size; unknown or mixed precisions
    count 32 bits, as Lightning does.
    """

    def __init__(self, model: nn.Module, max_depth: int = 1, precision: Optional[str] = None) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ValueError(
                f"ModelSummary(max_depth={max_depth!r}): use -1 (every layer), 0 (none) or a depth > 0."
            )
        self._model = model
        self._max_depth = max_depth
        # Depth + 1: the root module counts as depth 0 in the counter's names.
        self._flop_counter = FlopCounterMode(display=False, depth=max_depth + 1)
        self._bytes_per_param = _PRECISION_BITS.get(precision or "32-true", 32) / 8.0
        self._layers = self._summarize()

    # ------------------------------------------------------------------ collecting
    def _named_modules(self) -> list[tuple[str, nn.Module]]:
        if self._max_depth == 0:
            return []
        if self._max_depth == 1:
            return list(self._model.named_children())
        return list(self._model.named_modules())[1:]

    def _summarize(self) -> OrderedDict[str, LayerSummary]:
        layers = OrderedDict((name, LayerSummary(module)) for name, module in self._named_modules())
        try:
            if self.example_input is not None:
                self._forward_example_input()
        finally:
            for layer in layers.values():
                layer.detach_hook()
        if self._max_depth >= 1:
            for name in [name for name in layers if name.count(".") >= self._max_depth]:
                del layers[name]
        return layers

    @property
    def example_input(self) -> Any:
        # ``example_input_array`` is a LightningModule property; a plain nn.Module may set it too.
        return getattr(self._model, "example_input_array", None)

    def _forward_example_input(self) -> None:
        """One forward on the example input, as a batch reaches the module, without gradients or a copy."""
        model = self._model
        example = self.example_input
        to_device = getattr(model, "_example_on_device", None)
        if callable(to_device):
            example = to_device(example)
        else:
            from lightning_utilities.core.apply_func import apply_to_collection

            device = next((p.device for p in model.parameters()), torch.device("cpu"))
            example = apply_to_collection(example, torch.Tensor, lambda t: t.to(device))
        modes = {name: m.training for name, m in model.named_modules()}
        trainer = getattr(model, "_trainer", None)
        precision = getattr(getattr(trainer, "plugin", None), "precision", None)
        forward_context = precision.forward_context() if precision is not None else contextlib.nullcontext()
        model.eval()
        try:
            with torch.no_grad(), forward_context, self._flop_counter:
                if isinstance(example, (list, tuple)):
                    model(*example)
                elif isinstance(example, dict):
                    model(**example)
                else:
                    model(example)
        finally:
            for name, m in model.named_modules():
                if name in modes:
                    m.training = modes[name]

    # ------------------------------------------------------------------ what the table shows
    @property
    def layer_names(self) -> list[str]:
        return list(self._layers)

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self._layers.values()]

    @property
    def in_sizes(self) -> list:
        return [layer.in_size for layer in self._layers.values()]

    @property
    def out_sizes(self) -> list:
        return [layer.out_size for layer in self._layers.values()]

    @property
    def param_nums(self) -> list[int]:
        return [layer.num_parameters for layer in self._layers.values()]

    @property
    def training_modes(self) -> list[bool]:
        return [layer.training for layer in self._layers.values()]

    @property
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for m in self._model.modules()][1:]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @property
    def total_parameters(self) -> int:
        return sum(_numel(p) for p in self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return sum(_numel(p) for p in self._model.parameters() if p.requires_grad)

    @property
    def total_layer_params(self) -> int:
        return sum(self.param_nums)

    @property
    def model_size(self) -> float:
        """Megabytes of the parameters at the run's precision."""
        return self.total_parameters * self._bytes_per_param * 1e-6

    @property
    def total_flops(self) -> int:
        return self._flop_counter.get_total_flops()

    @property
    def flop_counts(self) -> dict[str, dict[Any, int]]:
        counts = self._flop_counter.get_flop_counts()
        root = type(self._model).__name__
        return {name: counts.get(f"{root}.{name}", {}) for name in self.layer_names}

    def summary_data(self) -> list[tuple[str, list[str]]]:
        """The table's columns: ``(header, cells)``, with a row for parameters that belong to no layer."""
        flops = self.flop_counts
        columns = [
            (" ", [str(i) for i in range(len(self._layers))]),
            ("Name", self.layer_names),
            ("Type", self.layer_types),
            ("Params", [get_human_readable_count(n) for n in self.param_nums]),
            ("Mode", ["train" if mode else "eval" for mode in self.training_modes]),
            ("FLOPs", [get_human_readable_count(sum(flops[name].values())) for name in self.layer_names]),
        ]
        if self.example_input is not None:
            columns.append(("In sizes", [str(size) for size in self.in_sizes]))
            columns.append(("Out sizes", [str(size) for size in self.out_sizes]))
        leftover = self.total_parameters - self.total_layer_params
        if leftover > 0:
            by_header = dict(columns)
            by_header[" "].append(" ")
            by_header["Name"].append(LEFTOVER_PARAMS_NAME)
            by_header["Params"].append(get_human_readable_count(leftover))
            for header in ("Type", "Mode", "FLOPs", "In sizes", "Out sizes"):
                if header in by_header:
                    by_header[header].append(NOT_APPLICABLE)
        return columns

    def __str__(self) -> str:
        return format_summary_table(
            self.total_parameters,
            self.trainable_parameters,
            self.model_size,
            self.total_training_modes,
            self.total_flops,
            *self.summary_data(),
        )

    __repr__ = __str__


def summarize(model: nn.Module, max_depth: int = 1) -> ModelSummary:
    """The summary of ``model``, at the precision of the Trainer it is attached to (if any)."""
    trainer = getattr(model, "_trainer", None)
    precision = getattr(trainer, "precision", None) if trainer is not None else None
    return ModelSummary(model, max_depth=max_depth, precision=precision)


def parse_batch_shape(batch: Any) -> Union[str, list]:
    """A tensor's shape as a list; nested lists for lists and tuples; ``"?"`` for anything else."""
    if hasattr(batch, "shape"):
        return list(batch.shape)
    if isinstance(batch, (list, tuple)):
        return [parse_batch_shape(item) for item in batch]
    return UNKNOWN_SIZE


def format_summary_table(
    total_parameters: int,
    trainable_parameters: int,
    model_size: float,
    total_training_modes: dict[str, int],
    total_flops: int,
    *columns: tuple[str, list[str]],
) -> str:
    """Lightning's plain-text table: the columns, a rule, then one line per total."""
    n_rows = len(columns[0][1]) if columns else 0
    widths = [max([len(header), *(len(str(cell)) for cell in cells)]) for header, cells in columns]
    total_width = sum(widths) + 3 * (len(columns) + 1)
    lines = [" | ".join(f"{header:<{w}}" for (header, _), w in zip(columns, widths)), "-" * total_width]
    for i in range(n_rows):
        lines.append(" | ".join(f"{cells[i]!s:<{w}}" for (_, cells), w in zip(columns, widths)))
    lines.append("-" * total_width)
    totals = [
        (get_human_readable_count(trainable_parameters), "Trainable params"),
        (get_human_readable_count(total_parameters - trainable_parameters), "Non-trainable params"),
        (get_human_readable_count(total_parameters), "Total params"),
        (get_formatted_model_size(model_size), "Total estimated model params size (MB)"),
        (total_training_modes["train"], "Modules in train mode"),
        (total_training_modes["eval"], "Modules in eval mode"),
        (get_human_readable_count(total_flops), "Total Flops"),
    ]
    lines.extend(f"{value!s:<10}{label}" for value, label in totals)
    return "\n".join(lines)


def get_formatted_model_size(total_model_size: float) -> str:
    return f"{total_model_size:,.3f}"


def get_human_readable_count(number: int) -> str:
    """``123`` -> ``"123  "``, ``1234`` -> ``"1.2 K"``, ``2e6`` -> ``"2.0 M"``; trillions at most (``"5,000 T"``)."""
    if number < 0:
        raise ValueError(f"get_human_readable_count({number}): the count cannot be negative.")
    digits = int(math.floor(math.log10(number)) + 1) if number > 0 else 1
    groups = min(math.ceil(digits / 3), len(_UNITS))
    scaled = number * 10 ** (-3 * (groups - 1))
    index = groups - 1
    if index < 1 or scaled >= 100:
        return f"{int(scaled):,d} {_UNITS[index]}"
    return f"{scaled:,.1f} {_UNITS[index]}"


def _numel(param: torch.Tensor) -> int:
    # A lazy layer's parameter has no size until its first forward (Lightning counts it as 0 too).
    return 0 if isinstance(param, nn.parameter.UninitializedParameter) else param.numel()
