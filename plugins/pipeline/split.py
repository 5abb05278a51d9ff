"""Where a pipeline cuts the module: the stage plan of a declared split, and the traced split of ``forward``.

A declared split (``pipeline_manual_split = True``) assigns whole submodules to stages in registration
order (:func:`plan_stages`). Otherwise ``torch.distributed.pipelining.pipeline`` traces ``forward`` in
training and in evaluation mode and cuts the graph at the split points (:class:`_TracedSplit`): each
stage runs only its own piece, and passes on what a later stage still needs.
"""

from __future__ import annotations

import bisect
import dataclasses
import inspect
import re
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn

from trainer_core.errors import MisconfigurationException
from trainer_core.plugins.pipeline.stages import _tensor_part

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

#: The class attribute with which a module declares that its forward is a chain of its submodules
#: (or skips the layers a stage lacks), so that stages are built by hand instead of by the tracer.
MANUAL_SPLIT_ATTRIBUTE = "pipeline_manual_split"
_MAX_LISTED = 30


def plan_stages(module: nn.Module, split_points: Sequence[str]) -> list[list[str]]:
    """The submodules (fully-qualified names of whole subtrees) of each stage, in pipeline order.

    Submodules are ordered as ``named_modules()`` lists them (registration order); each split point
    begins a stage. A container that spans a split point (``layers``) is not held whole: its
    children are assigned one by one.
    """
    named = dict(module.named_modules())
    order = {name: index for index, name in enumerate(named)}
    check_split_points(module, split_points)
    positions = [order[p] for p in split_points]
    subtree_end: dict[str, int] = {}
    names = list(named)
    for name in reversed(names):
        children = [f"{name}.{c}" if name else c for c, _ in named[name].named_children()]
        children = [c for c in children if c in order and order[c] > order[name]]
        subtree_end[name] = max([subtree_end[c] for c in children], default=order[name])

    stages: list[list[str]] = [[] for _ in range(len(split_points) + 1)]

    def assign(name: str) -> None:
        start, end = order[name], subtree_end[name]
        if not any(start < p <= end for p in positions):
            stages[bisect.bisect_right(positions, start)].append(name)
            return
        mod = named[name]
        own = [n for n, _ in mod.named_parameters(recurse=False)] + [
            n for n, _ in mod.named_buffers(recurse=False)
        ]
        if own:
            raise MisconfigurationException(
                f"PipelinePlugin: {name or type(module).__name__!r} spans split points but holds tensors itself "
                f"({', '.join(own)}), which no single stage can own; move them into a submodule."
            )
        for child, _ in mod.named_children():
            full = f"{name}.{child}" if name else child
            if full in order and order[full] > start:
                assign(full)

    assign("")
    for index, held in enumerate(stages):
        if not held:
            raise MisconfigurationException(
                f"PipelinePlugin(split_points={list(split_points)}): stage {index} would hold no submodule; "
                "remove a split point."
            )
    return stages


def check_split_points(module: nn.Module, split_points: Sequence[str]) -> None:
    """Each split point names a submodule, once, in registration order (the order a chain runs them)."""
    named = dict(module.named_modules())
    order = {name: index for index, name in enumerate(named)}
    for point in split_points:
        if point not in named or point == "":
            raise MisconfigurationException(
                f"PipelinePlugin(split_points={list(split_points)}): {point!r} names no submodule of "
                f"{type(module).__name__}. Its submodules: {_submodule_listing(module)}."
            )
    positions = [order[p] for p in split_points]
    if positions != sorted(set(positions)):
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): list each split point once, in the order the "
            f"module's forward runs them ({', '.join(p for p in sorted(split_points, key=order.get))})."
        )


def declares_manual_split(module: nn.Module) -> bool:
    """Whether the module's class set ``pipeline_manual_split = True`` (stages by hand, no tracing)."""
    return getattr(module, MANUAL_SPLIT_ATTRIBUTE, False) is True


def _submodule_listing(module: nn.Module) -> str:
    names = [name for name, _ in module.named_modules() if name and name.count(".") < 2]
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


# ---------------------------------------------------------------------- traced split
_MODES = (True, False)  # training, evaluation


@dataclasses.dataclass
class _StageProgram:
    """One stage's piece of the traced forward, and the values it receives and passes on.

    The split graph may hand a stage values from any earlier stage (a skip connection) or the
    input itself, but a schedule connects a stage only to the next one; so every stage passes on,
    after its own results, whatever a later stage still needs (``outputs``), in one fixed order.
    """

    graph: nn.Module  # the tracer's module for this stage (parameters under their original names)
    call: str  # the stage's node in the split graph
    inputs: list[str]  # the values received, in order
    args: list[str]  # the values the stage's graph takes, in order
    picks: dict[str, int]  # values that are one element of the stage's results: their index
    outputs: Any  # names passed on; on the last stage, the forward's output structure of names

    def run(self, *values: Any) -> Any:
        env = dict(zip(self.inputs, values))
        result = self.graph(*(env[name] for name in self.args))
        env[self.call] = result
        for name, index in self.picks.items():
            env[name] = result[index]
        if isinstance(self.outputs, list):
            passed = tuple(env[name] for name in self.outputs)
            return passed[0] if len(passed) == 1 else passed
        out = torch.fx.node.map_aggregate(
            self.outputs, lambda name: env[name] if isinstance(name, str) else name
        )
        # The tracer returns the forward's outputs flattened; a single one is what loss_fn expects.
        return out[0] if isinstance(out, (tuple, list)) and len(out) == 1 else out


class _TracedSplit:
    """``forward`` traced by ``torch.distributed.pipelining.pipeline`` and cut at the split points.

    ``tensors[s]`` are the fully-qualified names of the module's state that stage ``s`` holds:
    what its graph uses, and for the first stage also what no stage uses (unused parameters and
    non-tensor state still need an owner, for the optimizer and for checkpoints).
    """

    def __init__(
        self, module: nn.Module, programs: dict[bool, list[_StageProgram]], tensors: list[list[str]]
    ):
        self.module = module
        self.programs = programs
        self.tensors = tensors

    @classmethod
    def trace(cls, module: LightningModule, split_points: Sequence[str], example: Any) -> _TracedSplit:
        num_stages = len(split_points) + 1
        was_training = module.training
        programs: dict[bool, list[_StageProgram]] = {}
        used: dict[bool, list[list[str]]] = {}
        try:
            for mode in _MODES:
                module.train(mode)
                pipe = _run_tracer(module, split_points, example)
                if pipe.num_stages != num_stages:
                    raise MisconfigurationException(
                        f"PipelinePlugin(split_points={list(split_points)}): the traced "
                        f"{type(module).__name__}.forward makes {pipe.num_stages} stages, not {num_stages}: a split "
                        "point that forward never calls (or calls inside another split point) begins no stage. "
                        "Split at submodules that forward calls, one after another."
                    )
                _refuse_shared_parameters(module, split_points, pipe)
                programs[mode] = _stage_programs(pipe)
                used[mode] = [_state_names(program.graph, module) for program in programs[mode]]
        finally:
            module.train(was_training)
        # A tensor may be used in one mode only (batch norm counts batches only in training), but
        # never by one stage in training and another in evaluation: a rank holds it in both.
        stage_of: dict[str, int] = {}
        for mode in _MODES:
            for stage, names in enumerate(used[mode]):
                for name in names:
                    if stage_of.setdefault(name, stage) != stage:
                        raise MisconfigurationException(
                            f"PipelinePlugin(split_points={list(split_points)}): {type(module).__name__}.forward "
                            f"uses {name} in stage {stage_of[name]} in one mode and in stage {stage} in the other "
                            "(training, evaluation), but a rank holds it for both. Use it at the same place in both, "
                            f"or declare the stages yourself ({MANUAL_SPLIT_ATTRIBUTE} = True)."
                        )
        tensors: list[list[str]] = [[] for _ in range(num_stages)]
        for name in _all_state_names(module):
            # What no stage uses (unused parameters, non-tensor state) goes to the first stage.
            tensors[stage_of.get(name, 0)].append(name)
        return cls(module, programs, tensors)

    def part(self, module: LightningModule, stage: int) -> nn.Module:
        """The model part of ``stage``: the module with only the stage's tensors, running the stage's graph.

        It is a shallow copy of the user's module, so ``configure_optimizers`` answers with the
        stage's parameters under their original names; its ``forward`` is the stage's graph.
        """
        programs = {mode: self.programs[mode][stage] for mode in _MODES}
        for program in programs.values():
            _rebind(program.graph, module)
        part = _tensor_part(module, set(self.tensors[stage]))

        def forward(*values: Any) -> Any:
            # The Trainer switches the user's module between train and eval; the part follows it.
            return programs[module.training].run(*values)

        part.forward = forward  # type: ignore[method-assign]
        return part


def _run_tracer(module: nn.Module, split_points: Sequence[str], example: Any) -> Any:
    """``pipeline(module, (example,), split_spec)``, leaving the module as it was; refuse what cannot be traced."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    tensors = [*module.parameters(), *module.buffers()]
    on_meta = {t.is_meta for t in tensors}
    if on_meta == {True, False}:
        raise MisconfigurationException(
            f"PipelinePlugin: {type(module).__name__} has some tensors on the meta device and others not, so its "
            "forward cannot be traced; build the whole module on one device (or all under torch.device('meta'))."
        )
    if on_meta == {True}:
        # A module built on the meta device is traced on meta inputs: shapes are all the tracer needs.
        example = apply_to_collection(example, Tensor, lambda t: t.to("meta"))
    # ``pipeline`` marks the split points by replacing their ``forward``; put back what was there.
    saved = {name: dict(module.get_submodule(name).__dict__) for name in split_points}
    try:
        return pipeline(module, (example,), split_spec={name: SplitPoint.BEGINNING for name in split_points})
    except Exception as exc:
        cause: BaseException = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        first_line = next((line for line in str(cause).splitlines() if line.strip()), "")
        first_line = first_line.rstrip(". ") + _user_code_line(cause, module)
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): the tracer (torch.distributed.pipelining.pipeline, "
            f"on torch.export) could not trace {type(module).__name__}.forward: {type(cause).__name__}: {first_line}. "
            "Without a traced graph the stages cannot be cut out of forward, and running the whole forward on "
            "every stage would train a different function. Make forward traceable (no control flow that depends "
            "on tensor values, such as `if x.sum() > 0`; see https://pytorch.org/docs/stable/export.html), or "
            f"declare the stages yourself: set `{MANUAL_SPLIT_ATTRIBUTE} = True` on {type(module).__name__} if "
            "its forward runs its submodules as a chain (each stage then runs forward with the layers of other "
            "stages replaced by nn.Identity)."
        ) from exc
    finally:
        for name, attributes in saved.items():
            sub = module.get_submodule(name)
            for key in ("forward", "_orig_forward"):
                if key in attributes:
                    sub.__dict__[key] = attributes[key]
                else:
                    sub.__dict__.pop(key, None)


def _user_code_line(exc: BaseException, module: nn.Module) -> str:
    """`` (at file:line: `code`)``: the line of the module's own source where tracing failed, if it is known."""
    try:
        source = inspect.getsourcefile(type(module))
    except TypeError:
        return ""
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__) if frame.filename == source]
    if not frames:
        return ""
    frame = frames[-1]
    return f" (at {frame.filename}:{frame.lineno}: `{(frame.line or '').strip()}`)"


def _refuse_shared_parameters(module: nn.Module, split_points: Sequence[str], pipe: Any) -> None:
    """A tensor two stages use would be copied into each (the tracer's REPLICATE) and trained twice, apart."""
    # The tracer names a stage's copy ``layers@1.weight``; the module's own name has no ``@n``.
    shared = sorted(
        {re.sub(r"@\d+", "", name) for mapping in pipe.replicated_params for name in mapping.values()}
    )
    if shared:
        raise MisconfigurationException(
            f"PipelinePlugin(split_points={list(split_points)}): {type(module).__name__}.forward uses "
            f"{', '.join(shared[:_MAX_LISTED])} in more than one stage (a module called twice, or tied weights); "
            "each stage would train its own copy, unlike one process. Move the split points so that every use of "
            "them falls in one stage."
        )


def _stage_programs(pipe: Any) -> list[_StageProgram]:
    """Each stage's graph, with the values it receives and passes on (see ``_StageProgram``)."""
    graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    stage_of: dict[str, int] = {node.name: -1 for node in graph.nodes if node.op == "placeholder"}
    picks: dict[str, tuple[str, int]] = {}
    for index, node in enumerate(calls):
        stage_of[node.name] = index
    for node in graph.nodes:
        if node.op == "call_function" and node.args and getattr(node.args[0], "name", None) in stage_of:
            source = node.args[0].name
            stage_of[node.name] = stage_of[source]
            picks[node.name] = (source, node.args[1])
    output = next(node for node in graph.nodes if node.op == "output")
    result = torch.fx.node.map_arg(output.args[0], lambda node: node.name)
    result_names: list[str] = []
    torch.fx.node.map_arg(output.args[0], lambda node: result_names.append(node.name))
    needs = [[arg.name for arg in call.args] for call in calls]
    order = list(stage_of)  # definition order: placeholders, then each stage's results
    programs = []
    inputs = [name for name in order if stage_of[name] == -1]
    for index, call in enumerate(calls):
        last = index == len(calls) - 1
        later = {name for names in needs[index + 1 :] for name in names} | set(result_names)
        passed = [name for name in order if stage_of[name] <= index and name in later]
        mine = {name: at for name, (source, at) in picks.items() if source == call.name and name in later}
        programs.append(
            _StageProgram(
                graph=pipe.get_stage_module(index),
                call=call.name,
                inputs=inputs,
                args=needs[index],
                picks=mine,
                outputs=result if last else passed,
            )
        )
        inputs = passed
    return programs


def _state_names(graph: nn.Module, module: nn.Module) -> list[str]:
    """The names of the module's tensors that a stage's graph holds (the tracer keeps their original names)."""
    own = _all_state_names(module)
    held = {name for name, _ in graph.named_parameters()} | {name for name, _ in graph.named_buffers()}
    return [name for name in own if name in held]


def _all_state_names(module: nn.Module) -> list[str]:
    """Every entry of the module's state: its state dict, and non-persistent buffers, in the module's order."""
    names = dict.fromkeys(module.state_dict(keep_vars=True))
    names.update(dict.fromkeys(name for name, _ in module.named_parameters()))
    names.update(dict.fromkeys(name for name, _ in module.named_buffers()))
    return list(names)


def _rebind(graph: nn.Module, module: nn.Module) -> None:
    """Point a stage's graph at the module's current tensors (materialising or moving a layer replaces them)."""
    for name, _ in list(graph.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        graph.get_submodule(owner)._parameters[leaf] = module.get_parameter(name)
    for name, _ in list(graph.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        try:
            graph.get_submodule(owner)._buffers[leaf] = module.get_buffer(name)
        except AttributeError:
            continue  # a constant the tracer lifted, not one of the module's buffers


def _example_microbatch(
    trainer: Trainer, module: LightningModule, split_points: Sequence[str], n: int
) -> Any:
    """One micro-batch to trace with: the first of the first training batch, else ``example_input_array``.

    The training loader is read once before the run, with every random generator put back
    afterwards, so the run draws the same batches as it would have.
    """
    from trainer_core.checkpoint.rng import apply_rng_states, collect_rng_states

    if trainer.state_stage == "fit":
        loader = _training_loader(trainer, module)
        if loader is not None:
            states = collect_rng_states()
            try:
                batch = next(iter(loader))
            finally:
                apply_rng_states(states)
            if isinstance(batch, (list, tuple)) and len(batch) == 2:
                return apply_to_collection(batch[0], Tensor, lambda t: torch.tensor_split(t, n)[0])
    example = getattr(module, "example_input_array", None)
    if example is not None:
        return example
    raise MisconfigurationException(
        f"PipelinePlugin(split_points={list(split_points)}) traces {type(module).__name__}.forward on one "
        f"micro-batch before the run, and `trainer.{trainer.state_stage}` gives it none before it starts; set "
        f"`{type(module).__name__}.example_input_array` to one micro-batch of inputs, run `trainer.fit` first in "
        f"this process, or declare the stages yourself (`{MANUAL_SPLIT_ATTRIBUTE} = True`)."
    )


def _training_loader(trainer: Trainer, module: LightningModule) -> Any:
    """The training dataloader as ``fit`` will resolve it (given, else the datamodule's, else the module's)."""
    from lightning_utilities.core.overrides import is_overridden

    from trainer_core.datamodule import LightningDataModule
    from trainer_core.module import LightningModule as BaseModule

    # Read during fit only (``trainer.state_stage == "fit"``), when ``trainer.fit_loop`` holds this fit's sources.
    source = trainer.fit_loop.train_source
    if source is None:
        datamodule = trainer.datamodule
        if datamodule is not None and is_overridden("train_dataloader", datamodule, LightningDataModule):
            source = datamodule.train_dataloader()
        elif is_overridden("train_dataloader", module, BaseModule):
            source = module.train_dataloader()
    if isinstance(source, (list, tuple)):
        source = source[0] if len(source) == 1 else None
    return source if hasattr(source, "__iter__") else None
