"""Exceptions a user may catch."""

from __future__ import annotations


class MisconfigurationException(Exception):
    """An argument, hook or return value the user controls is wrong; the message says which."""


class CheckpointError(Exception):
    """A checkpoint could not be written or read; the message names the file and what is wrong."""


class _TunerExitException(Exception):
    """Raised by a finder callback the ``Tuner`` added, once its search is done: the run ends there, cleanly.

    The Trainer catches it (its teardown hooks run, nothing is reported as failed), as Lightning's does.
    """
