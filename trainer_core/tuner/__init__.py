"""``Tuner``: the learning-rate range test and the batch-size search, as Lightning 2.x runs them.

Both searches run from a callback's ``on_fit_start`` (``LearningRateFinder``, ``BatchSizeFinder``;
``Tuner`` adds one, runs ``trainer.fit`` and ends the run when the search is done). A search trains
for real, so it must leave nothing behind: before it, the run is written to a temporary checkpoint
``.lr_find_<uuid>.ckpt`` / ``.scale_batch_size_<uuid>.ckpt`` in ``default_root_dir`` through
``trainer.save_checkpoint``; after it (even after an error) the checkpoint is restored through
``restore_checkpoint`` (weights, optimizer and scheduler states, callback states) and removed, and
what a checkpoint does not hold (the loop counters as they stood, the Trainer's limits, callbacks,
loggers, dataloaders, metrics, the random generators) is put back from :class:`_Search`'s snapshot.
Only the result survives: the learning rate or batch size attribute, and the finder's record.

Deviations from Lightning, each where Lightning's result is wrong: the first batch-size trial runs
at ``init_val`` (Lightning's reuses a loader built at the module's size before ``init_val`` was set);
steps count from the step a search began at, for the loss smoothing and the divergence test of
``lr_find`` (Lightning counts the run's, so a search later in a run stops after one step) and for
a trial's ``max_steps``. Missing attributes raise ``MisconfigurationException`` (Lightning's:
``AttributeError``). For ``validate``/``test``/``predict`` from a ``BatchSizeFinder`` that does
not end the run, the size found applies from the next call (the loop under way keeps its loaders).

The package, one module per part: ``tuning`` (``Tuner``), ``lr_find`` and ``batch_size`` (the two
searches), ``search`` (the checkpoint and snapshot around a search, shared by both), ``attributes``
(where the tuned attribute lives) and ``memory`` (out-of-memory errors).
"""

from __future__ import annotations

from trainer_core.tuner.attributes import lightning_getattr, lightning_hasattr, lightning_setattr
from trainer_core.tuner.memory import is_oom_error
from trainer_core.tuner.tuning import Tuner

__all__ = [
    "Tuner",
    "is_oom_error",
    "lightning_getattr",
    "lightning_hasattr",
    "lightning_setattr",
]
