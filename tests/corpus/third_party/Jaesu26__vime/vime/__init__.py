# Source: https://github.com/Jaesu26/vime, commit 6afbcfd3ec2b4b1f9ecab2727b6d1f681e207d50, path vime/__init__.py
# License: MIT License (Copyright (c) 2023 Jaesu Han)
# Changes (everything that differs from the original):
# - none

__all__ = ["VIMESelf", "VIMESelfDataModule", "VIMESemi", "VIMESemiDataModule"]

from vime.datamodules import VIMESelfDataModule, VIMESemiDataModule
from vime.lightningmodules import VIMESelf, VIMESemi
