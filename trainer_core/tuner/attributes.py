"""Where a tuned attribute lives (the module, its hparams, the datamodule, its hparams), as Lightning looks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer_core.module import LightningModule


def _attr_holders(model: LightningModule, attribute: str) -> list[Any]:
    """Where ``attribute`` lives, in Lightning's order: the module, its hparams, the datamodule, its hparams."""
    holders: list[Any] = []
    if hasattr(model, attribute):
        holders.append(model)
    if attribute in getattr(model, "hparams", {}):
        holders.append(model.hparams)
    trainer = model._trainer
    datamodule = trainer.datamodule if trainer is not None else None
    if datamodule is not None:
        if hasattr(datamodule, attribute):
            holders.append(datamodule)
        if attribute in getattr(datamodule, "hparams", {}):
            holders.append(datamodule.hparams)
    return holders


def lightning_hasattr(model: LightningModule, attribute: str) -> bool:
    """Whether the module, its ``hparams``, the datamodule or its ``hparams`` has ``attribute``."""
    return bool(_attr_holders(model, attribute))


def lightning_getattr(model: LightningModule, attribute: str) -> Any:
    """``attribute`` from the last of its holders (the datamodule wins over the module, as in Lightning)."""
    holders = _attr_holders(model, attribute)
    if not holders:
        raise AttributeError(
            f"{attribute} is neither stored in the model namespace nor the `hparams` namespace/dict, nor the datamodule."
        )
    holder = holders[-1]
    return holder[attribute] if isinstance(holder, dict) else getattr(holder, attribute)


def lightning_setattr(model: LightningModule, attribute: str, value: Any) -> None:
    """Set ``attribute`` on every holder, so the module, its hparams and the datamodule agree."""
    holders = _attr_holders(model, attribute)
    if not holders:
        raise AttributeError(
            f"{attribute} is neither stored in the model namespace nor the `hparams` namespace/dict, nor the datamodule."
        )
    for holder in holders:
        if isinstance(holder, dict):
            holder[attribute] = value
        else:
            setattr(holder, attribute, value)
