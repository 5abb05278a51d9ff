"""Out-of-memory errors and freeing memory between batch-size trials."""

from __future__ import annotations

import gc

import torch


def is_oom_error(exception: BaseException) -> bool:
    """Whether ``exception`` is an out-of-memory error (CUDA, cuDNN's, or the CPU allocator's), by Lightning's rule."""
    if not isinstance(exception, RuntimeError) or len(exception.args) != 1:
        return False
    message = exception.args[0]
    if not isinstance(message, str):
        return False
    return (
        ("CUDA" in message and "out of memory" in message)
        or "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED." in message
        or "DefaultCPUAllocator: can't allocate memory" in message
    )


def _free_memory(failed: bool = False) -> None:
    """Release what the last trial held, so the next one starts from the same free memory.

    After a failed trial the error's frames may keep its tensors alive in reference cycles: a full
    collection frees them. Otherwise only a CUDA cache needs emptying; on the CPU tensors are freed
    as soon as they are dropped, and a full collection (Lightning runs one before every trial) can
    cost more than the trial itself.
    """
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if failed or cuda:
        gc.collect()
    if cuda:
        try:
            torch.cuda.empty_cache()
        except RuntimeError as err:  # emptying the cache can itself run out of memory
            if not is_oom_error(err):
                raise
