"""The state of a pipeline rank's stages in checkpoints: by the module's own names, at any pipeline degree.

A full checkpoint gathers every stage's tensors (tensor-parallel shards made whole) and optimizer
state to global rank 0, under the original fully-qualified names, so it is the file one process
writes; a sharded folder has every rank write its own parts. Loading gives each rank, by name,
what its stages hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from trainer_core.checkpoint.format import KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.containers import OptimizersContainer
from trainer_core.errors import CheckpointError
from trainer_core.plugins.parallel_dims import DATA, TENSOR
from trainer_core.plugins.pipeline.split import _MAX_LISTED
from trainer_core.plugins.pipeline.stages import _full, _full_state, _like, _merge_parts

if TYPE_CHECKING:
    from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO


class StageState:
    """``PipelinePlugin``'s state members: what its ranks write to checkpoints and load from them.

    A mixin of ``PipelinePlugin`` (it reads the plugin's layout: ``pp_degree``, ``parallel_dims``, the
    stages and groups it built in ``setup``).
    """

    # ------------------------------------------------------------------ state
    @property
    def _writes_sharded_checkpoints(self) -> bool:
        """Folders every rank writes its own parts into when the run's checkpoint IO is ``DistributedCheckpointIO``."""
        from trainer_core.plugins.io.distributed_io import DistributedCheckpointIO

        return isinstance(self.checkpoint_io.unwrapped, DistributedCheckpointIO)

    def _is_held(self, name: str) -> bool:
        return any(
            not prefix or name == prefix or name.startswith(prefix + ".") for prefix in self._held_prefixes
        )

    def _local_state_dict(self) -> dict[str, Any]:
        module = self._lightning_module
        assert module is not None
        return {k: v for k, v in module.state_dict().items() if self._is_held(k)}

    def _gather_to_first(self, local: Any) -> Optional[list[Any]]:
        """``local`` of every pipeline rank of data-parallel replica 0, on global rank 0; ``None`` elsewhere.

        Sharded checkpoints gather nothing: every rank writes its own parts.
        """
        if self.pp_degree == 1:
            return [local]
        if self._writes_sharded_checkpoints:
            return None
        # Data-parallel replica 0's ranks gather; within it, tensor-parallel rank 0 (whole tensors already).
        where = self.parallel_dims.coordinates(self.global_rank)
        if where[DATA] != 0 or where[TENSOR] != 0:
            return None
        gathered: Optional[list[Any]] = [None] * self.pp_degree if self.pp_rank == 0 else None
        dist.gather_object(local, gathered, dst=0, group=self._pp_group)
        return gathered

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The full state dict on global rank 0 (every stage's tensors under their original names); local elsewhere."""
        module = self._lightning_module
        assert module is not None
        local = self._local_state_dict()
        if not self._writes_sharded_checkpoints:
            # Tensor-parallel shards become whole tensors (a collective over the group, in name order).
            local = {k: _full(v).detach().cpu() if isinstance(v, Tensor) else v for k, v in local.items()}
        gathered = self._gather_to_first(local)
        if gathered is None:
            return local
        merged: dict[str, Any] = {}
        for part in gathered:
            merged.update(part)
        return {k: merged[k] for k in module.state_dict() if k in merged}

    def load_model_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> None:
        """Each rank takes, by name, the tensors of the layers it holds."""
        module = self._lightning_module
        assert module is not None
        mine = {k: v for k, v in state_dict.items() if self._is_held(k)}
        own = self._local_state_dict()
        missing = [k for k in own if k not in mine]
        if strict and missing:
            raise CheckpointError(
                f"the checkpoint lacks {missing[:_MAX_LISTED]} of the layers this rank holds."
            )
        # Whole tensors go to tensor-parallel parameters as this rank's shard of them.
        mine = {k: _like(v, own[k]) if k in own else v for k, v in mine.items()}
        module.load_state_dict(mine, strict=False)

    def _param_names(self) -> dict[Tensor, str]:
        from trainer_core.checkpoint import parameter_names

        assert self._lightning_module is not None
        return parameter_names(self._lightning_module)

    def named_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Every part's state keyed by parameter name, gathered to global rank 0, groups merged.

        Merged, the param groups are those of the unsplit module (parts share hyper-parameters), so
        the state is the one a single-device run writes, and loads at any pipeline degree.
        """
        from trainer_core.checkpoint import optimizer_state_to_names

        names = self._param_names()
        parts = list(optimizer.optimizers) if isinstance(optimizer, OptimizersContainer) else [optimizer]
        local = [
            (
                sid,
                optimizer_state_to_names(
                    opt.state_dict() if self._writes_sharded_checkpoints else _full_state(opt.state_dict()),
                    opt,
                    names,
                ),
            )
            for sid, opt in zip(self._stage_ids, parts)
        ]
        gathered = self._gather_to_first(local)
        if gathered is not None:
            return _merge_parts([entry for rank_parts in gathered for entry in rank_parts])
        merged = _merge_parts(local)
        if self._writes_sharded_checkpoints and self.pp_degree > 1:
            # Every rank writes the same param groups, naming every stage's parameters (DCP keeps
            # one copy of what all ranks write under one key); the tensors stay each rank's own.
            groups = [None] * self.pp_degree
            dist.all_gather_object(
                groups,
                [(sid, {"param_groups": g["param_groups"]}) for sid, g in local if g],
                group=self._pp_group,
            )
            every = _merge_parts([entry for rank_groups in groups for entry in rank_groups])  # type: ignore[union-attr]
            merged = {
                **merged,
                "state": merged.get("state", {}),
                "param_groups": every.get("param_groups", []),
            }
        return merged

    def prepare_optimizer_state(self, optimizer: Optimizer, named_state: dict[str, Any], path: str) -> Any:
        """Check the name-keyed state against the whole module, then give each part its own parameters' state."""
        from trainer_core.checkpoint import (
            check_named_state_covers,
            optimizer_state_from_names,
            select_named_state,
        )

        module = self._lightning_module
        assert module is not None
        if not named_state:
            return {}
        check_named_state_covers(named_state, module, type(module).__name__, path)
        names = self._param_names()
        parts = list(optimizer.optimizers) if isinstance(optimizer, OptimizersContainer) else [optimizer]
        prepared = []
        for opt in parts:
            mine = [names[p] for group in opt.param_groups for p in group["params"]]
            prepared.append(
                optimizer_state_from_names(select_named_state(named_state, mine), opt, names, path)
            )
        return {"parts": prepared} if isinstance(optimizer, OptimizersContainer) else prepared[0]

    def load_optimizer_state_dict(self, optimizer: Optimizer, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        optimizer.load_state_dict(state_dict)
        # Whole state tensors of tensor-parallel parameters become this rank's shard of them.
        for opt in optimizer.optimizers if isinstance(optimizer, OptimizersContainer) else [optimizer]:
            for param, state in opt.state.items():
                for key, value in state.items():
                    if isinstance(value, Tensor) and value.dim() and value.shape == param.shape:
                        state[key] = _like(value, param)

    # ------------------------------------------------------------------ checkpoint files
    def _sharded_state_template(self, io: DistributedCheckpointIO, filepath: str) -> dict[str, Any]:
        """The tensors of the layers this rank holds, and its parts' optimizer states, for DCP to fill."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        template: dict[str, Any] = {KEY_STATE_DICT: self._local_state_dict()}
        if self.optimizers:
            options = StateDictOptions(full_state_dict=False)
            state: dict[str, Any] = {}
            for part, opt in zip(self._parts, self.optimizers[0]):  # type: ignore[call-overload]
                # Creates the state tensors (lazily built by most optimizers) for DCP to fill.
                state.update(get_optimizer_state_dict(part, opt, options=options)["state"])
            # The groups' layout (DCP stores each entry under its own key); the values come from the file.
            groups = self.named_optimizer_state(self.optimizers[0]).get("param_groups", [])
            template[KEY_OPTIMIZER_STATES] = [{"state": state, "param_groups": groups}]
        return template

    def _load_sharded(self, filepath: str) -> dict[str, Any]:
        """Each rank reads only the tensors of the layers it holds; the others stand in for the checks."""
        checkpoint = super()._load_sharded(filepath)  # type: ignore[misc]
        module = self._lightning_module
        assert module is not None
        # The layers of other ranks stand in with their names, shapes and dtypes for the checks, and
        # no memory (a zero expanded); loading takes only this rank's own.
        others = {
            k: torch.zeros((), dtype=v.dtype).expand(v.shape) if isinstance(v, Tensor) else v
            for k, v in module.state_dict().items()
            if not self._is_held(k)
        }
        checkpoint[KEY_STATE_DICT] = {**others, **checkpoint[KEY_STATE_DICT]}
        return checkpoint
