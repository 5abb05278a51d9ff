"""``PipelinePlugin``: pipeline parallelism on ``torch.distributed.pipelining``, optionally times data parallelism.

The module is cut before named submodules (``split_points``) into stages; ``forward(input)`` is
what is split, and ``loss_fn(output, target)`` turns the last stage's output into the loss. A rank
holds one stage (``"GPipe"``, ``"1F1B"``) or several (``"Interleaved1F1B"``: with 2 ranks and 4
stages, rank 0 holds stages 0 and 2).

**Traced split (the default).** ``torch.distributed.pipelining.pipeline`` traces ``forward`` (with
``torch.export``, on one micro-batch of the first training batch, or on the module's
``example_input_array``) and cuts the graph at the split points, so everything ``forward`` computes
between submodules (functional activations, residual additions, a layer called twice) runs once,
on the stage it belongs to, and a stage runs only its own piece. Values a later stage needs (a skip
connection over a stage, the input itself) are passed on by the stages in between. It is traced
twice, in training and in evaluation mode, so dropout and batch norm behave as on one device. The
traced stages use the module's own parameter objects, under their original fully-qualified names.
A ``forward`` the tracer cannot capture (data-dependent control flow such as ``if x.sum() > 0``)
is refused before anything runs, as is a parameter used by two stages (each would train a copy).

**Manual split** (``pipeline_manual_split = True`` on the module's class, torchtitan's model-parts
style): the module declares that its ``forward`` runs its submodules as a chain, in registration
order, or skips the layers a stage lacks. A stage is then the module with every layer it does not
hold replaced by ``nn.Identity``, and it runs the whole ``forward``; nothing is traced.

Either way the user's module keeps its whole name space, with the tensors a rank does not hold
moved to the meta device (no memory), so checkpoints use the original fully-qualified names
(``layers.3.weight``) whichever rank holds them: a checkpoint written at one pipeline degree loads
at another, or under any other plugin.

Ranks are laid out as a ``(pp, dp, tp)`` mesh (``ParallelDims``): global rank = ``(pp_rank * dp +
dp_rank) * tp + tp_rank``. Replicas of a stage average their gradients after the schedule's backward,
before the optimizers step. ``PipelinePlugin`` itself has ``tp = 1``; ``PipelineModelParallelPlugin``
(``ModelParallelPlugin``'s layouts with ``pipeline_parallel_size > 1``) makes every stage
tensor-parallel inside, with the module's own plan from ``configure_model``.

The package: ``split.py`` (where the module is cut: a declared plan or the traced ``forward``),
``stages.py`` (the parts a rank holds, meta tensors, tensor-parallel shards), ``state.py`` (the
stages' state in checkpoints), ``plugin.py`` (``PipelinePlugin``) and ``model_parallel.py``
(``PipelineModelParallelPlugin``).
"""

from __future__ import annotations

from trainer_core.plugins.pipeline.model_parallel import PipelineModelParallelPlugin
from trainer_core.plugins.pipeline.plugin import SCHEDULES, PipelinePlugin
from trainer_core.plugins.pipeline.split import (
    MANUAL_SPLIT_ATTRIBUTE,
    check_split_points,
    declares_manual_split,
    plan_stages,
)

__all__ = [
    "MANUAL_SPLIT_ATTRIBUTE",
    "SCHEDULES",
    "PipelineModelParallelPlugin",
    "PipelinePlugin",
    "check_split_points",
    "declares_manual_split",
    "plan_stages",
]
