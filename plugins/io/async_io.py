"""Checkpoints written in the background: training waits only while the state is copied off the model.

How a save goes:

* **Wait for the previous save.** One save at a time, in order, so two saves to one path end with
  the second. If the previous write failed, its error is raised here (naming its path) instead of
  training going on without the checkpoint it asked for.
* **Stage.** Every tensor is copied to host memory and every container is copied, so the
  optimizer steps that follow cannot change what is written. The host buffers are kept and
  reused by the next save when the sizes match: after the first save, staging allocates nothing
  and costs one memory copy of the state, which is all the time training is blocked. Tensors are
  copied storage by storage, as ``torch.save`` writes them, so tensors that share memory (tied
  weights, views) still share it in the file. Buffers for CUDA tensors are pinned, so the copies
  run asynchronously to each other; the save waits for them before it returns.
* **Write.** One background thread hands the staged copy to the wrapped IO, whose
  ``save_checkpoint`` makes the write atomic. A failure is kept and raised by the next save or by
  :meth:`AsyncCheckpointIO.teardown`, which the Trainer calls at the end of every run. A
  :meth:`~AsyncCheckpointIO.link` runs on the same thread after the write it shows.

Readers (load, ``is_complete``, ``list_complete``) and ``remove_checkpoint`` first wait for the
pending write, so ``ckpt_path="last"`` sees the newest checkpoint and never a half-written one, and
the wrapped IO is never called from two threads at once (it need not be thread-safe). A removal
after a failed write raises that write's error instead of removing: the file it would remove may
be the only good checkpoint left.

Staged tensors are on the CPU, so a checkpoint of a CUDA model loads onto the CPU unless a
``map_location`` says otherwise (loading into the model copies it back to its device).
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from trainer_core.errors import CheckpointError
from trainer_core.paths import PathLike
from trainer_core.plugins.io.checkpoint_io import CheckpointIO, WrappingCheckpointIO
from trainer_core.plugins.io.torch_io import TorchCheckpointIO

_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)

# A position in the checkpoint: the keys and indices leading to a value, e.g. ("state_dict", "net.0.weight").
_Position = tuple[Any, ...]


def _stages_by_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a plain strided tensor whose storage can be copied byte for byte."""
    return (
        type(tensor) in (torch.Tensor, nn.Parameter)
        and tensor.layout == torch.strided
        and tensor.device.type != "meta"
        and not tensor.is_quantized
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


class _StagingBuffers:
    """Host copies of a checkpoint's tensors, kept between saves so that repeated saves do not allocate.

    A buffer belongs to the position in the checkpoint of the first tensor that used its storage;
    the next save reuses it when the storage there has the same size. Buffers of positions a save
    no longer fills are dropped, so the pool never holds more than one checkpoint's tensors.
    """

    def __init__(self) -> None:
        self._pool: dict[_Position, torch.Tensor] = {}
        self._in_use: dict[_Position, torch.Tensor] = {}
        self._staged_storages: dict[tuple[torch.device, int, int], torch.UntypedStorage] = {}
        self._cuda_devices: set[torch.device] = set()

    def stage(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``checkpoint`` that shares no memory with it (the buffers are reused next time)."""
        self._in_use, self._staged_storages, self._cuda_devices = {}, {}, set()
        try:
            staged = self._stage(checkpoint, ())
            for device in self._cuda_devices:
                torch.cuda.current_stream(device).synchronize()
            self._pool = self._in_use
        finally:
            self._in_use, self._staged_storages, self._cuda_devices = {}, {}, set()
        return staged

    def release(self) -> None:
        self._pool = {}

    def _stage(self, value: Any, position: _Position) -> Any:
        if isinstance(value, torch.Tensor):
            return self._stage_tensor(value, position)
        if isinstance(value, _IMMUTABLE):
            return value
        if type(value) is dict:
            return {key: self._stage(item, (*position, key)) for key, item in value.items()}
        if isinstance(value, dict):
            # OrderedDict, defaultdict...: a shallow copy keeps the type and attributes such as
            # a state dict's ``_metadata``; then every entry is replaced by its staged copy.
            staged = copy.copy(value)
            if getattr(value, "__dict__", None):
                staged.__dict__.update(copy.deepcopy(value.__dict__))
            for key, item in value.items():
                staged[key] = self._stage(item, (*position, key))
            return staged
        if type(value) is list:
            return [self._stage(item, (*position, index)) for index, item in enumerate(value)]
        if type(value) is tuple:
            return tuple(self._stage(item, (*position, index)) for index, item in enumerate(value))
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*(self._stage(item, (*position, index)) for index, item in enumerate(value)))
        try:
            return copy.deepcopy(value)
        except Exception as err:
            where = "/".join(str(key) for key in position) or "the checkpoint"
            raise CheckpointError(
                f"Could not copy {where} ({type(value).__name__}) for the background write: "
                f"{type(err).__name__}: {err}. Store a copyable value there (tensors, numbers, strings, "
                "lists, dicts), or save with TorchCheckpointIO instead of AsyncCheckpointIO."
            ) from err

    def _stage_tensor(self, tensor: torch.Tensor, position: _Position) -> torch.Tensor:
        if not _stages_by_storage(tensor):
            # Sparse, quantized, subclassed (DTensor) tensors: an ordinary copy, not pooled.
            staged = tensor.detach().clone()
        else:
            storage = tensor.untyped_storage()
            source = (storage.device, storage.data_ptr(), storage.nbytes())
            staged_storage = self._staged_storages.get(source)
            if staged_storage is None:
                staged_storage = self._copy_storage(storage, position)
                self._staged_storages[source] = staged_storage
            staged = torch.empty(0, dtype=tensor.dtype).set_(
                staged_storage, tensor.storage_offset(), tensor.size(), tensor.stride()
            )
        if isinstance(tensor, nn.Parameter):
            return nn.Parameter(staged, requires_grad=tensor.requires_grad)
        return staged.requires_grad_() if tensor.requires_grad and tensor.is_leaf else staged

    def _copy_storage(self, storage: torch.UntypedStorage, position: _Position) -> torch.UntypedStorage:
        pinned = storage.device.type == "cuda"
        buffer = self._pool.get(position)
        if buffer is None or buffer.numel() != storage.nbytes() or buffer.is_pinned() != pinned:
            buffer = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
        self._in_use[position] = buffer
        source = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        buffer.copy_(source, non_blocking=pinned)
        if pinned:
            self._cuda_devices.add(storage.device)
        return buffer.untyped_storage()


@dataclass
class _Pending:
    """A write or link handed to the background thread, and what it was, for the error that names it."""

    what: str
    path: str
    future: Future


class AsyncCheckpointIO(WrappingCheckpointIO):
    """Writes checkpoints on a background thread through ``checkpoint_io``; training waits only for the copy.

    Args:
        checkpoint_io: the IO that writes (and reads) the files, :attr:`inner` from then on;
            :class:`TorchCheckpointIO` by default.

    Use it as ``Trainer(plugins=[AsyncCheckpointIO()])``. An error of a background write is raised
    by the next ``save_checkpoint`` or by :meth:`teardown` (the end of ``fit``), as a
    :class:`~trainer_core.errors.CheckpointError` naming the checkpoint (or by ``remove_checkpoint``,
    which then removes nothing). :meth:`link` runs on the same thread after the write of the
    checkpoint it shows, so training does not wait for it either.
    """

    writes_in_background = True

    def __init__(self, checkpoint_io: Optional[CheckpointIO] = None) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else TorchCheckpointIO())
        self._buffers = _StagingBuffers()
        self._lock = threading.RLock()
        self._executor: Optional[ThreadPoolExecutor] = None
        # In the order submitted; one thread runs them in that order.
        self._pending: list[_Pending] = []

    # ---------------------------------------------------------------- save and link

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[dict[str, Any]] = None
    ) -> None:
        """Copy ``checkpoint`` and write the copy in the background; returns once the copy is made."""
        with self._lock:
            self._raise_failed_save()
            staged = self._buffers.stage(checkpoint)
            self._submit("write", path, self.inner.save_checkpoint, staged, path, storage_options)

    def link(self, src: PathLike, dst: PathLike) -> None:
        """Link ``dst`` to ``src`` in the background, once the pending write of ``src`` is done.

        If that write failed, the link is not made and the write's error is raised as for a save.
        """
        with self._lock:
            previous = self._pending[-1].future if self._pending else None
            self._submit("link", dst, _link_after, previous, self.inner, src, dst)

    def _submit(self, what: str, path: PathLike, fn: Any, *args: Any) -> None:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="trainer-core-async-checkpoint"
            )
        self._pending.append(_Pending(what, os.fspath(path), self._executor.submit(fn, *args)))

    def wait(self) -> None:
        """Block until the background writes (if any) have finished; raise the first error if one failed."""
        with self._lock:
            self._raise_failed_save()

    def teardown(self) -> None:
        """Finish the pending write, stop the thread, free the staging buffers; raise a write's error.

        Safe to call again; a later save starts a new thread.
        """
        with self._lock:
            try:
                self._raise_failed_save()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=True)
                    self._executor = None
                self._buffers.release()
                super().teardown()

    def _wait_for_pending(self) -> None:
        """Block until the pending writes finished; a failure stays for the next save or teardown."""
        self._pending = [p for p in self._pending if p.future.exception() is not None]  # exception() waits

    def _raise_failed_save(self) -> None:
        self._wait_for_pending()
        failed, self._pending = self._pending, []
        if not failed:
            return
        first = failed[0]  # a link after a failed write fails because of it: the write's error says why
        err = first.future.exception()
        cause = str(err) if isinstance(err, CheckpointError) else f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"The background {first.what} of the checkpoint {first.path} failed: {cause} "
            "(AsyncCheckpointIO raises a write's error at the next save or at the end of the run.)"
        ) from err

    # ---------------------------------------------------------------- read and remove

    @contextmanager
    def _calling_inner(self) -> Iterator[None]:
        # Readers see the newest checkpoint and never a half-written one, and ``inner`` is never
        # called from two threads at once.
        with self._lock:
            self._wait_for_pending()
            yield

    def remove_checkpoint(self, path: PathLike) -> None:
        """Remove ``path`` once the pending write finished; if that write failed, raise instead.

        ``ModelCheckpoint`` removes the checkpoint a new one replaces right after saving it: a
        synchronous save would have raised before the removal, so the old file must stay here too.
        """
        with self._lock:
            self._raise_failed_save()
            self.inner.remove_checkpoint(path)


def _link_after(previous: Optional[Future], io: CheckpointIO, src: PathLike, dst: PathLike) -> None:
    """Runs on the writer thread, so ``previous`` (the write ``src`` waits for) has finished."""
    if previous is not None and previous.exception() is not None:
        raise CheckpointError(f"{os.fspath(dst)} was not linked to {os.fspath(src)}, whose write failed.")
    io.link(src, dst)
