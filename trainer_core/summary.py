"""The model summary printed at the start of ``fit`` (``enable_model_summary``)."""

from __future__ import annotations

from torch import nn


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def summary_rows(module: nn.Module) -> list[tuple[str, str, int, int]]:
    """``(name, type, parameters, trainable parameters)`` of each direct child."""
    rows = []
    for name, child in module.named_children():
        params = sum(p.numel() for p in child.parameters())
        trainable = sum(p.numel() for p in child.parameters() if p.requires_grad)
        rows.append((name, type(child).__name__, params, trainable))
    return rows


def print_summary(module: nn.Module) -> None:
    rows = summary_rows(module)
    total = sum(p.numel() for p in module.parameters())
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    name_w = max([len("Name"), *(len(r[0]) for r in rows)])
    type_w = max([len("Type"), *(len(r[1]) for r in rows)])
    header = f"  | {'Name':<{name_w}} | {'Type':<{type_w}} | Params"
    lines = [header, "-" * len(header)]
    for i, (name, kind, params, _) in enumerate(rows):
        lines.append(f"{i:<2}| {name:<{name_w}} | {kind:<{type_w}} | {_count(params)}")
    lines.append("-" * len(header))
    lines.append(f"{_count(trainable)} trainable params, {_count(total - trainable)} non-trainable params")
    print("\n".join(lines))
