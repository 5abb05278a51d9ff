"""``BaseFinetuning`` and ``BackboneFinetuning``: freeze layers before training, unfreeze them later.

Lightning's callbacks of the same names and arguments. ``freeze_before_training`` runs in ``setup``
(before ``configure_optimizers``, so the optimizer can leave frozen parameters out), and
``finetune_function`` at every epoch start, where ``unfreeze_and_add_param_group`` gives the
unfrozen parameters to the optimizer as a new parameter group.

The optimizer's parameter-group layout is the callback's checkpoint state
(``internal_optimizer_metadata``: per optimizer, each group's settings and its parameters by name),
so a resumed run rebuilds the groups before the optimizer state, saved with them, loads into it.
Three things go further than Lightning, so that a resumed run continues exactly:

* the parameters of the rebuilt groups are made trainable again (``setup`` froze them: Lightning
  leaves them frozen after a resume, and the backbone silently stops training);
* ``finetune_function`` runs once per epoch: a run resumed in the middle of an epoch does not run it
  again for that epoch (``BackboneFinetuning`` would otherwise raise the backbone's rate twice);
* parameters already in the optimizer are recognised by identity, not by equal values (Lightning's
  ``torch.equal`` drops a new parameter whose values happen to equal one the optimizer holds).
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer

from trainer_core.callbacks.base import Callback
from trainer_core.errors import MisconfigurationException
from trainer_core.utilities import rank_zero_warn

if TYPE_CHECKING:
    from trainer_core.module import LightningModule
    from trainer_core.trainer import Trainer

log = logging.getLogger(__name__)

Modules = Union[Module, Iterable[Union[Module, Iterable]]]


def multiplicative(epoch: int) -> float:
    return 2.0


class BaseFinetuning(Callback):
    """Override ``freeze_before_training(pl_module)`` and ``finetune_function(pl_module, epoch, optimizer)``.

    Example::

        class FeatureExtractorFreezeUnfreeze(BaseFinetuning):
            def __init__(self, unfreeze_at_epoch=10):
                super().__init__()
                self._unfreeze_at_epoch = unfreeze_at_epoch

            def freeze_before_training(self, pl_module):
                self.freeze(pl_module.feature_extractor)

            def finetune_function(self, pl_module, current_epoch, optimizer):
                if current_epoch == self._unfreeze_at_epoch:
                    self.unfreeze_and_add_param_group(pl_module.feature_extractor, optimizer, train_bn=True)

    The module's ``configure_optimizers`` should pass only trainable parameters
    (``filter(lambda p: p.requires_grad, self.parameters())``).
    """

    def __init__(self) -> None:
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False
        self._last_finetuned_epoch = -1
        self._trainer: Optional[Trainer] = None

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {
            "internal_optimizer_metadata": self._internal_optimizer_metadata,
            "last_finetuned_epoch": self._last_finetuned_epoch,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        # Lightning before 1.6 saved the metadata as the whole state.
        metadata = state_dict.get("internal_optimizer_metadata", state_dict)
        self._internal_optimizer_metadata = {int(k): v for k, v in metadata.items() if str(k).isdigit()}
        self._last_finetuned_epoch = state_dict.get("last_finetuned_epoch", -1)
        trainer = self._trainer
        if trainer is not None and getattr(trainer.strategy, "restore_checkpoint_after_setup", False):
            # Restored once the optimizers exist (plugins that restore after setup, such as FSDP):
            # the groups must stand before the optimizer state loads, which is next.
            self._restore_param_groups(trainer, trainer.lightning_module)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._restarting:
            self._restore_param_groups(trainer, pl_module)

    def _restore_param_groups(self, trainer: Trainer, pl_module: Any) -> None:
        """The saved groups, with their parameters by name, in place of the optimizers' own; those parameters trainable."""
        self._restarting = False
        if not self._internal_optimizer_metadata:
            return
        named = dict(pl_module.named_parameters())
        restored = set()
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            saved = self._internal_optimizer_metadata.get(opt_idx)
            if saved is None:
                continue
            unknown = sorted({n for g in saved for n in g["params"]} - set(named))
            if unknown:
                raise MisconfigurationException(
                    f"{type(self).__name__}: the checkpoint's parameter groups name parameters the model does not "
                    f"have: {unknown[:10]}. Resume with the model that wrote the checkpoint."
                )
            groups = self._apply_mapping_to_param_groups(saved, named)
            added = groups[len(optimizer.param_groups) :]
            # Added through add_param_group, so that optimizers that keep their own view of the
            # groups (OSS, ZeRO) take them in; the groups the optimizer had get the saved settings.
            for group, saved_group in zip(optimizer.param_groups, groups):
                group.update({k: v for k, v in saved_group.items() if k != "params"})
            for group in added:
                optimizer.add_param_group(group)
            restored.update(id(p) for g in added for p in g["params"])
        if restored:
            self._make_restored_trainable(pl_module, restored)

    @staticmethod
    def _make_restored_trainable(pl_module: Any, restored: set[int]) -> None:
        for module in BaseFinetuning.flatten_modules(pl_module):
            own = list(module.parameters(recurse=False))
            if own and all(id(p) in restored for p in own):
                BaseFinetuning.make_trainable(module)
            else:
                for p in own:
                    if id(p) in restored:
                        p.requires_grad = True

    # ------------------------------------------------------------------ Lightning's helpers
    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules, and the parents that hold parameters of their own, of a module or an iterable of them."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            flat: list[Module] = []
            for m in modules:
                flat.extend(BaseFinetuning.flatten_modules(m))
            found: Iterable[Module] = flat
        else:
            found = modules.modules()
        return [m for m in found if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(modules: Modules, train_bn: bool = True, requires_grad: bool = True) -> Generator:
        """The parameters of ``modules`` whose ``requires_grad`` equals ``requires_grad`` (BatchNorm's only with ``train_bn``)."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and not train_bn:
                continue
            for param in mod.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freeze ``modules``; with ``train_bn`` their BatchNorm layers stay trainable."""
        for mod in BaseFinetuning.flatten_modules(modules):
            if isinstance(mod, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(mod)
            else:
                BaseFinetuning.freeze_module(mod)

    @staticmethod
    def filter_on_optimizer(optimizer: Optimizer, params: Iterable) -> list:
        """``params`` without those ``optimizer`` holds already (by identity), with a warning when some were."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        out, removed = [], []
        for param in params:
            (removed if id(param) in held else out).append(param)
        if removed:
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this optimizer. Those "
                "parameters will be skipped.\nHINT: Did you init your optimizer in `configure_optimizer` as such:\n"
                f" {type(optimizer)}(filter(lambda p: p.requires_grad, self.parameters()), ...) "
            )
        return out

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Optimizer,
        lr: Optional[float] = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreeze ``modules`` and give their parameters to ``optimizer`` as a new group.

        The group's rate is ``lr``, or the first group's rate divided by ``initial_denom_lr``.
        """
        BaseFinetuning.make_trainable(modules)
        params_lr = optimizer.param_groups[0]["lr"] if lr is None else float(lr)
        denom_lr = initial_denom_lr if lr is None else 1.0
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": params_lr / denom_lr})

    @staticmethod
    def _apply_mapping_to_param_groups(
        param_groups: list[dict[str, Any]], mapping: dict
    ) -> list[dict[str, Any]]:
        output = []
        for g in param_groups:
            group_state = {k: v for k, v in g.items() if k != "params"}
            group_state["params"] = [mapping[p] for p in g["params"]]
            output.append(group_state)
        return output

    def _store(
        self,
        pl_module: LightningModule,
        opt_idx: int,
        num_param_groups: int,
        current_param_groups: list[dict[str, Any]],
    ) -> None:
        mapping = {p: n for n, p in pl_module.named_parameters()}
        if opt_idx not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[opt_idx] = self._apply_mapping_to_param_groups(
                current_param_groups, mapping
            )
        elif num_param_groups != len(current_param_groups):
            # New groups the finetune function added.
            self._internal_optimizer_metadata[opt_idx].extend(
                self._apply_mapping_to_param_groups(current_param_groups[num_param_groups:], mapping)
            )

    # ------------------------------------------------------------------ the run
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._trainer = trainer
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch = trainer.current_epoch
        if epoch <= self._last_finetuned_epoch:
            return  # resumed in the middle of an epoch whose finetuning step the saved run took
        for opt_idx, optimizer in enumerate(trainer.optimizers):
            num_param_groups = len(optimizer.param_groups)
            self.finetune_function(pl_module, epoch, optimizer)
            self._store(pl_module, opt_idx, num_param_groups, optimizer.param_groups)
        self._last_finetuned_epoch = epoch

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer) -> None:
        """Override: unfreeze what should train from ``epoch`` on (``unfreeze_and_add_param_group``)."""
        raise NotImplementedError

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        """Override: freeze what should not train at first (``freeze``)."""
        raise NotImplementedError


class BackboneFinetuning(BaseFinetuning):
    """Train ``pl_module.backbone`` from ``unfreeze_backbone_at_epoch`` on, its rate rising by ``lambda_func``.

    Args:
        unfreeze_backbone_at_epoch: the epoch at which the backbone joins the optimizer.
        lambda_func: ``epoch -> factor``: each later epoch the backbone's rate is multiplied by it.
        backbone_initial_ratio_lr: the backbone's first rate as a fraction of the first group's rate.
        backbone_initial_lr: the backbone's first rate (instead of the ratio).
        should_align: once the backbone's rate would exceed the first group's, use the first group's.
        initial_denom_lr: passed to ``unfreeze_and_add_param_group``.
        train_bn: train the backbone's BatchNorm layers (while frozen too).
        verbose: log both rates at every epoch; ``rounding``: digits shown.
    """

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: Optional[float] = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: Optional[float] = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), Module):
            raise MisconfigurationException(
                f"BackboneFinetuning needs the module to have an nn.Module `backbone` attribute; "
                f"{type(pl_module).__name__} has none."
            )
        super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: LightningModule) -> None:
        self.freeze(pl_module.backbone)  # type: ignore[arg-type]

    def finetune_function(self, pl_module: LightningModule, epoch: int, optimizer: Optimizer) -> None:
        if epoch == self.unfreeze_backbone_at_epoch:
            current_lr = optimizer.param_groups[0]["lr"]
            initial_backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.previous_backbone_lr = initial_backbone_lr
            self.unfreeze_and_add_param_group(
                pl_module.backbone,  # type: ignore[arg-type]
                optimizer,
                initial_backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
            if self.verbose:
                log.info(
                    f"Current lr: {round(current_lr, self.rounding)}, "
                    f"Backbone lr: {round(initial_backbone_lr, self.rounding)}"
                )
        elif epoch > self.unfreeze_backbone_at_epoch:
            assert self.previous_backbone_lr is not None
            current_lr = optimizer.param_groups[0]["lr"]
            next_lr = self.lambda_func(epoch + 1) * self.previous_backbone_lr
            if self.should_align and next_lr > current_lr:
                next_lr = current_lr
            optimizer.param_groups[-1]["lr"] = next_lr
            self.previous_backbone_lr = next_lr
            if self.verbose:
                log.info(
                    f"Current lr: {round(current_lr, self.rounding)}, Backbone lr: {round(next_lr, self.rounding)}"
                )
