"""``ModelPruning``: prune weights during training with ``torch.nn.utils.prune``, as Lightning's callback does.

Pruning re-parametrises each pruned tensor: ``weight`` becomes the product of the trained
``weight_orig`` (still the parameter the optimizer holds) and a ``weight_mask`` buffer, applied by a
forward pre-hook. The callback decides once per epoch (at the end of the training epoch, or of
validation with ``prune_on_train_epoch_end=False``) whether and how much to prune; the lottery
ticket hypothesis then resets the surviving weights to their values at ``setup``. The masks stay
while the run trains, so pruning can go on; a checkpoint holds the pruned weights under their
plain names (``weight = weight_orig * weight_mask``) and ``on_train_end`` folds the masks into the
weights for good, unless ``make_pruning_permanent=False``.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch.nn.utils.prune as torch_prune
from torch import Tensor, nn

from trainer_core.callbacks.base import Callback
from trainer_core.checkpoint.format import KEY_FROZEN_PARAMETERS, KEY_OPTIMIZER_STATES, KEY_STATE_DICT
from trainer_core.errors import MisconfigurationException
from trainer_core.module import LightningModule
from trainer_core.utilities import rank_zero_only

if TYPE_CHECKING:
    from trainer_core.trainer import Trainer

log = logging.getLogger(__name__)

ParameterList = Sequence[tuple[nn.Module, str]]

#: ``pruning_fn`` by name: the function that prunes one tensor, and the method class ``global_unstructured`` takes.
BUILT_IN_PRUNING = {
    "ln_structured": (torch_prune.ln_structured, torch_prune.LnStructured),
    "l1_unstructured": (torch_prune.l1_unstructured, torch_prune.L1Unstructured),
    "random_structured": (torch_prune.random_structured, torch_prune.RandomStructured),
    "random_unstructured": (torch_prune.random_unstructured, torch_prune.RandomUnstructured),
}

# Modules that only hold others: their children's tensors are pruned, never through them.
_CONTAINERS = (LightningModule, nn.Sequential, nn.ModuleList, nn.ModuleDict)

EpochValue = Callable[[int], Any]


class ModelPruning(Callback):
    """Prune ``parameters_to_prune`` (default: every ``weight`` and ``bias`` of the model's layers) each epoch.

    Args (Lightning's):
        pruning_fn: a name in :data:`BUILT_IN_PRUNING`, or a ``torch.nn.utils.prune.BasePruningMethod``
            subclass (with ``use_global_unstructured=True``).
        parameters_to_prune: ``[(module, "weight"), ...]``; empty or ``None``: every tensor of
            ``parameter_names`` in every layer of the model.
        parameter_names: ``"weight"`` and/or ``"bias"``.
        use_global_unstructured: rank all tensors' values together (one threshold for the model),
            rather than each tensor alone.
        amount: the share (float) or number (int) of values to prune, or a function of the epoch
            returning one; ``0``: no pruning that epoch.
        apply_pruning: whether to prune, or a function of the epoch saying whether.
        make_pruning_permanent: fold the masks into the weights at the end of training; checkpoints
            hold the pruned weights under plain names.
        use_lottery_ticket_hypothesis: after pruning, reset the remaining weights to their values at
            ``setup`` (or a function of the epoch saying whether to).
        resample_parameters: with the lottery ticket, re-initialise them (``reset_parameters``) instead.
        pruning_dim: the dimension of a ``*_structured`` method.
        pruning_norm: the norm ``n`` of ``ln_structured``.
        verbose: 1 logs the whole model's sparsity after each pruning, 2 also each tensor's.
        prune_on_train_epoch_end: prune at the end of the training epoch; ``False``: of validation.
    """

    PARAMETER_NAMES = ("weight", "bias")

    def __init__(
        self,
        pruning_fn: Union[Callable, str],
        parameters_to_prune: Optional[ParameterList] = (),
        parameter_names: Optional[list[str]] = None,
        use_global_unstructured: bool = True,
        amount: Union[int, float, EpochValue] = 0.5,
        apply_pruning: Union[bool, EpochValue] = True,
        make_pruning_permanent: bool = True,
        use_lottery_ticket_hypothesis: Union[bool, EpochValue] = True,
        resample_parameters: bool = False,
        pruning_dim: Optional[int] = None,
        pruning_norm: Optional[int] = None,
        verbose: int = 0,
        prune_on_train_epoch_end: bool = True,
    ) -> None:
        self._use_global_unstructured = use_global_unstructured
        self._parameters_to_prune = parameters_to_prune
        self._parameter_names = parameter_names or self.PARAMETER_NAMES
        self._use_lottery_ticket_hypothesis = use_lottery_ticket_hypothesis
        self._resample_parameters = resample_parameters
        self._apply_pruning = apply_pruning
        self._make_pruning_permanent = make_pruning_permanent
        self._prune_on_train_epoch_end = prune_on_train_epoch_end
        # ``global_unstructured``'s extra arguments (``dim``, ``n``), kept for each call.
        self._global_kwargs: dict[str, Any] = {}
        self._pruning_method_name: Optional[str] = None
        # Per pruned module (by id): a copy as it was at ``setup``, and its (index, name) pairs to reset.
        self._original_layers: Optional[dict[int, tuple[nn.Module, list[tuple[int, str]]]]] = None
        for name in self._parameter_names:
            if name not in self.PARAMETER_NAMES:
                raise MisconfigurationException(
                    f"ModelPruning(parameter_names=[..., {name!r}]): use names among {self.PARAMETER_NAMES}."
                )
        self.pruning_fn = self._resolve_pruning_fn(pruning_fn, pruning_dim, pruning_norm)
        if not (isinstance(amount, (int, float)) or callable(amount)):
            raise MisconfigurationException(
                f"ModelPruning(amount={amount!r}): use a share (float), a number of values (int), or a function "
                "of the epoch returning one."
            )
        self.amount = amount
        if verbose not in (0, 1, 2):
            raise MisconfigurationException(f"ModelPruning(verbose={verbose!r}): use 0, 1 or 2.")
        self._verbose = verbose

    def _resolve_pruning_fn(self, pruning_fn: Any, dim: Optional[int], norm: Optional[int]) -> Any:
        """The callable each pruning calls: a function of ``torch.nn.utils.prune``, or a method class for global pruning."""
        if isinstance(pruning_fn, str):
            method = self._built_in(pruning_fn.lower(), dim, norm)
        elif inspect.isclass(pruning_fn) and issubclass(pruning_fn, torch_prune.BasePruningMethod):
            if not self._use_global_unstructured:
                raise MisconfigurationException(
                    f"ModelPruning(pruning_fn={pruning_fn.__name__}) with use_global_unstructured=False: a "
                    "BasePruningMethod class prunes through global_unstructured only; pass "
                    "use_global_unstructured=True, or the name of a built-in function."
                )
            method = pruning_fn
        else:
            raise MisconfigurationException(
                f"ModelPruning(pruning_fn={pruning_fn!r}): use one of {list(BUILT_IN_PRUNING)}, or a subclass of "
                "torch.nn.utils.prune.BasePruningMethod (the class itself, not an instance)."
            )
        if self._use_global_unstructured and method.PRUNING_TYPE != "unstructured":
            raise MisconfigurationException(
                f"ModelPruning(pruning_fn={pruning_fn!r}, use_global_unstructured=True): global pruning ranks "
                f"single values, and this method prunes {method.PRUNING_TYPE!r}. Pass "
                "use_global_unstructured=False, or an unstructured method."
            )
        return method

    def _built_in(self, name: str, dim: Optional[int], norm: Optional[int]) -> Any:
        if name not in BUILT_IN_PRUNING:
            raise MisconfigurationException(
                f"ModelPruning(pruning_fn={name!r}): not a pruning function of torch.nn.utils.prune; use one of "
                f"{list(BUILT_IN_PRUNING)}, or pass a BasePruningMethod subclass."
            )
        kwargs: dict[str, Any] = {}
        if name.endswith("_structured"):
            if dim is None:
                raise MisconfigurationException(
                    f"ModelPruning(pruning_fn={name!r}) needs `pruning_dim`: the dimension whose slices it prunes."
                )
            if name == "ln_structured":
                if norm is None:
                    raise MisconfigurationException(
                        "ModelPruning(pruning_fn='ln_structured') needs `pruning_norm`: the norm n slices are ranked by."
                    )
                kwargs["n"] = norm
            kwargs["dim"] = dim
        function, method = BUILT_IN_PRUNING[name]
        if self._use_global_unstructured:
            self._global_kwargs = kwargs
            self._pruning_method_name = method.__name__
            return method
        self._pruning_method_name = function.__name__
        return partial(function, **kwargs)

    # ------------------------------------------------------------------ what users may override or call
    def filter_parameters_to_prune(self, parameters_to_prune: ParameterList = ()) -> ParameterList:
        """Override to choose, among the tensors found at ``setup``, those to prune."""
        return parameters_to_prune

    @staticmethod
    def sanitize_parameters_to_prune(
        pl_module: nn.Module,
        parameters_to_prune: Optional[ParameterList] = (),
        parameter_names: Sequence[str] = (),
    ) -> ParameterList:
        """``parameters_to_prune`` checked against ``pl_module``; when empty, every tensor of ``parameter_names``."""
        names = parameter_names or ModelPruning.PARAMETER_NAMES
        layers = [m for m in pl_module.modules() if not isinstance(m, _CONTAINERS)]
        if not parameters_to_prune:
            # Name by name, then layer by layer: the order global pruning ranks values in.
            return [
                (layer, name)
                for name in names
                for layer in layers
                if isinstance(getattr(layer, name, None), nn.Parameter)
            ]
        if not isinstance(parameters_to_prune, (list, tuple)) or not all(
            isinstance(pair, (list, tuple))
            and len(pair) == 2
            and isinstance(pair[0], nn.Module)
            and isinstance(pair[1], str)
            for pair in parameters_to_prune
        ):
            raise MisconfigurationException(
                "ModelPruning(parameters_to_prune=...): pass a list of (module, parameter_name) pairs, or None "
                "for every layer's parameters."
            )
        missing_layers = [m for m, _ in parameters_to_prune if not any(m is layer for layer in layers)]
        missing_names = [n for m, n in parameters_to_prune if m not in missing_layers and not hasattr(m, n)]
        if missing_layers or missing_names:
            raise MisconfigurationException(
                "ModelPruning(parameters_to_prune=...) names what the model lacks: modules "
                f"{missing_layers}, parameters {missing_names}. Pass the model's own modules and names."
            )
        return parameters_to_prune

    def make_pruning_permanent(self, module: nn.Module) -> None:
        """Fold every mask into its weight and drop the re-parametrisation (``weight`` a plain parameter again)."""
        for layer in module.modules():
            for key, hook in list(layer._forward_pre_hooks.items()):
                if isinstance(hook, torch_prune.BasePruningMethod):
                    hook.remove(layer)
                    del layer._forward_pre_hooks[key]

    def apply_lottery_ticket_hypothesis(self) -> None:
        """Reset the pruned tensors' trainable values to those at ``setup`` (re-initialised with ``resample_parameters``).

        The masks stay: the pruned network restarts from its initial weights (Frankle & Carbin, step 4).
        """
        assert self._original_layers is not None
        for original, names in self._original_layers.values():
            source = original
            if self._resample_parameters and callable(getattr(original, "reset_parameters", None)):
                source = copy.deepcopy(original)
                source.reset_parameters()
            for index, name in names:
                target_layer, _ = self._parameters_to_prune[index]
                _copy_values(target_layer, source, name)

    def apply_pruning(self, amount: Union[int, float]) -> None:
        """Prune ``amount`` more of ``parameters_to_prune`` now (and log the sparsity when ``verbose``)."""
        before = self._sparsity() if self._verbose else None
        if self._use_global_unstructured:
            torch_prune.global_unstructured(
                self._parameters_to_prune, pruning_method=self.pruning_fn, **self._global_arguments(amount)
            )
        else:
            for layer, name in self._parameters_to_prune:
                self.pruning_fn(layer, name=name, amount=amount)
        if before is not None:
            self._log_sparsity(before, self._sparsity(), amount)

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        found = self.sanitize_parameters_to_prune(pl_module, self._parameters_to_prune, self._parameter_names)
        self._parameters_to_prune = self.filter_parameters_to_prune(found)
        if self._use_lottery_ticket_hypothesis:
            self._original_layers = {}
            for index, (layer, name) in enumerate(self._parameters_to_prune):
                entry = self._original_layers.setdefault(id(layer), (copy.deepcopy(layer), []))
                entry[1].append((index, name))

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._prune_on_train_epoch_end:
            self._run_pruning(pl_module.current_epoch)

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self._prune_on_train_epoch_end and not trainer.sanity_checking:
            self._run_pruning(pl_module.current_epoch)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._make_pruning_permanent:
            self.make_pruning_permanent(pl_module)

    def on_save_checkpoint(
        self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # The file gets the pruned weights under plain names; the run keeps its masks and goes on pruning.
        if not self._make_pruning_permanent:
            return
        state_dict, pruned = _pruned_state_dict(dict(checkpoint[KEY_STATE_DICT]))
        checkpoint[KEY_STATE_DICT] = state_dict
        # The optimizer state names each parameter as the state dict does (trainer-core keys it by name), so a
        # run resumed from this file, whose model is not pruned yet, finds ``weight`` where ``weight_orig`` trained.
        renamed = {f"{name}_orig": name for name in pruned}
        for state in checkpoint.get(KEY_OPTIMIZER_STATES) or ():
            _rename_parameters(state, renamed)
        if checkpoint.get(KEY_FROZEN_PARAMETERS):
            checkpoint[KEY_FROZEN_PARAMETERS] = [renamed.get(n, n) for n in checkpoint[KEY_FROZEN_PARAMETERS]]

    # ------------------------------------------------------------------ steps
    def _run_pruning(self, epoch: int) -> None:
        prune = self._apply_pruning(epoch) if callable(self._apply_pruning) else self._apply_pruning
        amount = self.amount(epoch) if callable(self.amount) else self.amount
        if not prune or not amount:
            return
        self.apply_pruning(amount)
        lottery = self._use_lottery_ticket_hypothesis
        if lottery(epoch) if callable(lottery) else lottery:
            self.apply_lottery_ticket_hypothesis()

    def _global_arguments(self, amount: Union[int, float]) -> dict[str, Any]:
        """``amount`` and the method's own arguments, those its ``__init__`` takes (a user's class may take fewer)."""
        self._global_kwargs["amount"] = amount
        accepted = set(inspect.signature(self.pruning_fn).parameters) - {"self"}
        return {k: v for k, v in self._global_kwargs.items() if k in accepted}

    def _sparsity(self) -> list[tuple[int, int]]:
        """(pruned values, values) per tensor of ``parameters_to_prune``; (0, 1) for a tensor not pruned yet."""
        stats = []
        for layer, name in self._parameters_to_prune:
            mask = getattr(layer, f"{name}_mask", None)
            stats.append((0, 1) if mask is None else (int((mask == 0).sum().item()), mask.numel()))
        return stats

    @rank_zero_only
    def _log_sparsity(
        self, before: list[tuple[int, int]], after: list[tuple[int, int]], amount: Union[int, float]
    ) -> None:
        total = sum(size for _, size in after)
        pruned_before = sum(zeros for zeros, _ in before)
        pruned_after = sum(zeros for zeros, _ in after)
        log.info(
            f"ModelPruning `{self._pruning_method_name}`: {pruned_before}/{total} values pruned "
            f"({pruned_before / total:.2%}) -> {pruned_after}/{total} ({pruned_after / total:.2%})"
        )
        if self._verbose == 2:
            for (layer, name), (zeros_before, size_before), (zeros_after, size_after) in zip(
                self._parameters_to_prune, before, after
            ):
                log.info(
                    f"ModelPruning `{self._pruning_method_name}` on `{layer!r}.{name}`, amount={amount}: "
                    f"{zeros_before} pruned ({zeros_before / size_before:.2%}) -> {zeros_after} "
                    f"({zeros_after / size_after:.2%})"
                )


def _copy_values(target: nn.Module, source: nn.Module, name: str) -> None:
    """``source``'s ``name`` into ``target``'s trainable tensor (``name_orig`` once pruned), in place."""
    destination = getattr(target, f"{name}_orig", None)
    if destination is None:
        destination = getattr(target, name, None)
    values = getattr(source, name, None)
    if isinstance(destination, Tensor) and isinstance(values, Tensor):
        destination.data = values.data.to(destination.device)


def _pruned_state_dict(state_dict: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``state_dict`` with each ``x_orig``/``x_mask`` pair replaced by ``x = x_orig * x_mask`` (on the CPU), and those ``x``."""
    pruned = [
        key[: -len("_mask")]
        for key in state_dict
        if key.endswith("_mask") and f"{key[:-5]}_orig" in state_dict
    ]
    for name in pruned:
        original = state_dict.pop(f"{name}_orig")
        mask = state_dict.pop(f"{name}_mask")
        state_dict[name] = mask.to(dtype=original.dtype) * original
    cpu = {key: value.cpu() if isinstance(value, Tensor) else value for key, value in state_dict.items()}
    return cpu, pruned


def _rename_parameters(named_state: dict[str, Any], renamed: dict[str, str]) -> None:
    """Rename parameters in one name-keyed optimizer state (``trainer_core.checkpoint.optimizer``'s stored form)."""
    if not named_state:
        return
    named_state["state"] = {renamed.get(name, name): value for name, value in named_state["state"].items()}
    for group in named_state["param_groups"]:
        group["params"] = [renamed.get(name, name) for name in group["params"]]
