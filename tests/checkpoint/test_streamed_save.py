"""The pieces of a streamed full save that need no process group (issue 32).

* ``save_torch_file`` writes, for a checkpoint holding :class:`LazyTensor` placeholders, the bytes
  ``torch.save`` writes for the real tensors (every dtype the format meets, nested optimizer-like
  state, real tensors among the lazy ones), reading each placeholder once, in the order of the file.
* ``hooks_read_checkpoint`` says whether a user hook will see the checkpoint dict (the module's or a
  callback's ``on_save_checkpoint``): a save is streamed only when none does.

The 2-rank save itself (same bytes, failures, memory, resume) is ``tests/plugins/test_fsdp_gather.py``.
"""

from __future__ import annotations

import io
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from trainer_core import LightningModule
from trainer_core.callbacks import Callback, ModelCheckpoint
from trainer_core.checkpoint.save import hooks_read_checkpoint
from trainer_core.checkpoint.stream import LazyTensor, save_torch_file


def _checkpoint(make: Any) -> dict[str, Any]:
    """A checkpoint-shaped dict whose large tensors come from ``make(name, tensor)``."""
    torch.manual_seed(0)
    weights = {
        "w": torch.randn(5, 3),
        "low": torch.randn(4, 2).to(torch.bfloat16),
        "counts": torch.arange(6).to(torch.uint16),  # pickled with _rebuild_tensor_v3
        "mask": torch.tensor([True, False]),
    }
    return {
        "epoch": 1,
        "state_dict": {name: make(name, t) for name, t in weights.items()},
        "optimizer_states": [
            {
                "state": {"w": {"step": torch.tensor(2.0), "exp_avg": make("exp_avg", torch.randn(5, 3))}},
                "param_groups": [{"lr": 0.1, "params": ["w"]}],
            }
        ],
        "rng": torch.get_rng_state(),  # a real tensor between lazy ones
    }


def test_lazy_tensors_are_written_as_torch_save_writes_the_real_ones() -> None:
    reads: list[str] = []

    def lazy(name: str, tensor: torch.Tensor) -> LazyTensor:
        def read() -> torch.Tensor:
            reads.append(name)
            return tensor

        return LazyTensor(tensor.dtype, tuple(tensor.shape), read, name)

    expected = io.BytesIO()
    torch.save(_checkpoint(lambda name, t: t), expected)
    streamed = io.BytesIO()
    save_torch_file(_checkpoint(lazy), streamed)
    assert streamed.getvalue() == expected.getvalue()
    assert reads == ["w", "low", "counts", "mask", "exp_avg"]  # once each, in the file's order
    loaded = torch.load(io.BytesIO(streamed.getvalue()), weights_only=True)
    assert torch.equal(loaded["state_dict"]["low"], _checkpoint(lambda name, t: t)["state_dict"]["low"])


def test_a_checkpoint_without_lazy_tensors_is_torch_saves() -> None:
    checkpoint = _checkpoint(lambda name, t: t)
    expected, written = io.BytesIO(), io.BytesIO()
    torch.save(checkpoint, expected)
    save_torch_file(checkpoint, written)
    assert written.getvalue() == expected.getvalue()


class _Plain(LightningModule):
    pass


class _Editing(LightningModule):
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["extra"] = 1


class _Reading(Callback):
    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        pass


class _Subclass(_Reading):
    pass


@pytest.mark.parametrize(
    ("module", "callbacks", "weights_only", "expected"),
    [
        (_Plain(), [], False, False),
        (_Plain(), [ModelCheckpoint(), Callback()], False, False),  # the built-in saver reads no dict
        (_Editing(), [], False, True),
        (_Editing(), [], True, True),  # the module's hook runs for a weights-only save too
        (_Plain(), [_Subclass()], False, True),
        (_Plain(), [_Reading()], True, False),  # callbacks' hooks do not run for a weights-only save
    ],
)
def test_a_save_is_streamed_only_when_no_hook_reads_the_dict(
    module: LightningModule, callbacks: list[Callback], weights_only: bool, expected: bool
) -> None:
    parts = SimpleNamespace(module=module, callbacks=callbacks)
    assert hooks_read_checkpoint(parts, weights_only) is expected  # type: ignore[arg-type]
