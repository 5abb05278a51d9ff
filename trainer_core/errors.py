"""Exceptions a user may catch."""

from __future__ import annotations


class MisconfigurationException(Exception):
    """An argument, hook or return value the user controls is wrong; the message says which."""


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message names the file and what is wrong."""
