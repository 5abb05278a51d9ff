"""``python -m trainer_core.checkpoint {inspect,consolidate}``; see :mod:`trainer_core.checkpoint.cli`."""

from __future__ import annotations

from trainer_core.checkpoint.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
