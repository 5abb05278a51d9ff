"""``SingleDevicePlugin``: one process on one device, the plugin every other one generalises."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import torch

from trainer_core.plugins.base import TrainingTypePlugin

if TYPE_CHECKING:
    from trainer_core.plugins.io import CheckpointIO


class SingleDevicePlugin(TrainingTypePlugin):
    """Train on ``device`` (default: the CPU, or ``cuda:0`` when ``accelerator`` picks a GPU)."""

    name = "single_device"

    def __init__(
        self, device: Optional[Union[str, torch.device]] = None, checkpoint_io: Optional[CheckpointIO] = None
    ) -> None:
        super().__init__(checkpoint_io=checkpoint_io)
        # A device the user names is kept; otherwise the Trainer picks one from `accelerator`.
        self._device_given = device is not None
        self._device = torch.device(device if device is not None else "cpu")

    @property
    def root_device(self) -> torch.device:
        return self._device

    def set_default_device(self, device: Union[str, torch.device]) -> None:
        """The device the Trainer picks from ``accelerator``/``devices``; a device the user named is kept."""
        if not self._device_given:
            self._device = torch.device(device)
