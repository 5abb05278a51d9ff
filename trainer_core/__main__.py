"""``python -m trainer_core {fit,validate,test,predict} --config run.yaml``; see :mod:`trainer_core.cli`."""

from __future__ import annotations

from trainer_core.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
