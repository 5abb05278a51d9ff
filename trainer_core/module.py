"""``LightningModule``: the user's model, its steps and its hooks, with Lightning 2.x names.

Every hook here has the default behaviour Lightning gives it. The Trainer calls a hook only when
the user (or a subclass of ours) overrides it, unless the default does real work (for example
``optimizer_step`` and ``backward``), so an empty hook costs nothing on the training step.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from trainer_core.datamodule import LightningDataModule
from trainer_core.errors import MisconfigurationException

# ``hparams_argument`` is imported from here by users of the older path.
from trainer_core.hparams import _load_hparams_file, store_hyperparameters
from trainer_core.hparams import hparams_argument as hparams_argument
from trainer_core.results import dict_items
from trainer_core.utilities import AttributeDict, move_data_to_device, rank_zero_only, rank_zero_warn
from trainer_core.utilities.overrides import is_overridden

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer_core.optim import LightningOptimizer
    from trainer_core.run_state import RunState


class LightningModule(nn.Module):
    """A ``torch.nn.Module`` that knows how to train, validate, test and predict itself."""

    # Properties TorchScript must not compile (``to_torchscript``): they reach the Trainer or hold
    # Python objects. Every property of this class is listed; a subclass adds its own.
    __jit_unused_properties__: list[str] = [
        "trainer",
        "device_mesh",
        "automatic_optimization",
        "device",
        "dtype",
        "current_epoch",
        "global_step",
        "global_rank",
        "local_rank",
        "on_gpu",
        "logger",
        "loggers",
        "hparams",
        "hparams_initial",
        "example_input_array",
        "strict_loading",
    ]
    # True while ``to_torchscript`` compiles: TorchScript reads every attribute, ``trainer`` included.
    _jit_is_scripting = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trainer: Optional[RunState] = None
        self._automatic_optimization = True
        self._hparams: AttributeDict = AttributeDict()
        self._hparams_initial: AttributeDict = AttributeDict()
        self._log_hyperparams = True
        self._example_input_array: Optional[Union[Tensor, tuple, dict]] = None
        self._strict_loading: Optional[bool] = None

    # ------------------------------------------------------------------ trainer-facing attributes
    @property
    def trainer(self) -> RunState:
        if self._trainer is None and not LightningModule._jit_is_scripting:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a `Trainer`.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Optional[RunState]) -> None:
        self._trainer = trainer

    @property
    def device_mesh(self) -> Optional[DeviceMesh]:
        """The run's device mesh, for ``configure_model``; ``None`` under plugins that build none.

        Under ``ModelParallelPlugin`` it has the dimensions ``"data_parallel"``, ``"tensor_parallel"`` and
        ``"pipeline_parallel"``: ``parallelize_module(self.block, self.device_mesh["tensor_parallel"], plan)``.
        Under ``FSDPPlugin`` it is the mesh the plugin shards over.
        """
        return getattr(self, "_device_mesh", None)

    @property
    def automatic_optimization(self) -> bool:
        return self._automatic_optimization

    @automatic_optimization.setter
    def automatic_optimization(self, value: bool) -> None:
        self._automatic_optimization = bool(value)

    @property
    def device(self) -> torch.device:
        for tensor in self.parameters():
            return tensor.device
        for tensor in self.buffers():
            return tensor.device
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        for tensor in self.parameters():
            return tensor.dtype
        return torch.get_default_dtype()

    @property
    def current_epoch(self) -> int:
        return self._trainer.current_epoch if self._trainer is not None else 0

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def local_rank(self) -> int:
        return self._trainer.local_rank if self._trainer is not None else 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def logger(self) -> Any:
        return self._trainer.logger if self._trainer is not None else None

    @property
    def loggers(self) -> list[Any]:
        return self._trainer.loggers if self._trainer is not None else []

    # ------------------------------------------------------------------ hyper-parameters
    @property
    def hparams(self) -> AttributeDict:
        return self._hparams

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyper-parameters as ``save_hyperparameters`` stored them: a copy, unchanged by edits of ``hparams``."""
        return copy.deepcopy(self._hparams_initial)

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: Optional[Union[Sequence[str], str]] = None,
        frame: Optional[Any] = None,
        logger: bool = True,
    ) -> None:
        """Store the arguments of the calling ``__init__`` in ``self.hparams``.

        With no arguments every init argument is kept; with names, only those; with one dict or
        ``argparse.Namespace``, that object's items. A second call adds to what the first stored
        (a subclass's call after its parent's), and ``ignore`` also drops names stored before.
        """
        self._log_hyperparams = logger
        if frame is None:
            frame = inspect.currentframe().f_back  # type: ignore[union-attr]
        store_hyperparameters(self, args, ignore, frame, nn.Module)

    # ------------------------------------------------------------------ export
    @property
    def example_input_array(self) -> Optional[Union[Tensor, tuple, dict]]:
        """An input for ``forward``: a tensor (``self(x)``), a tuple (``self(*x)``) or a dict (``self(**x)``).

        ``ModelSummary`` reports the layers' input and output sizes for it, and ``to_onnx`` and
        ``to_torchscript(method="trace")`` trace with it when given no input of their own.
        """
        return self._example_input_array

    @example_input_array.setter
    def example_input_array(self, example: Optional[Union[Tensor, tuple, dict]]) -> None:
        self._example_input_array = example

    @property
    def strict_loading(self) -> bool:
        """Whether loading a checkpoint requires its weights to name exactly this module's (default ``True``).

        Set it to ``False`` in ``__init__`` for a module whose checkpoints leave parts out on purpose (a
        frozen pretrained backbone that ``state_dict`` skips); ``Trainer.fit(ckpt_path=...)`` and
        ``load_from_checkpoint`` then load the names both have. Shapes must still agree.
        """
        return self._strict_loading in (None, True)

    @strict_loading.setter
    def strict_loading(self, strict_loading: bool) -> None:
        self._strict_loading = strict_loading

    def _batch_transfer_hooks(self) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
        """The three batch-transfer hooks the Trainer would use: the data module's where it overrides one."""
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        chosen = batch_transfer_hooks(self, datamodule, warn=False)
        return chosen or (
            self.on_before_batch_transfer,
            self.transfer_batch_to_device,
            self.on_after_batch_transfer,
        )

    def _on_before_batch_transfer(self, batch: Any, dataloader_idx: int = 0) -> Any:
        """``on_before_batch_transfer`` of whoever the Trainer would ask (Lightning's name, for summaries and export)."""
        return self._batch_transfer_hooks()[0](batch, dataloader_idx)

    def _apply_batch_transfer_handler(
        self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0
    ) -> Any:
        """``transfer_batch_to_device`` (to ``device``, by default this module's) then ``on_after_batch_transfer``."""
        _, transfer, after = self._batch_transfer_hooks()
        batch = transfer(batch, device or self.device, dataloader_idx)
        return after(batch, dataloader_idx)

    def _example_on_device(self, example: Any) -> Any:
        return self._apply_batch_transfer_handler(self._on_before_batch_transfer(example))

    @torch.no_grad()
    def to_torchscript(
        self,
        file_path: Optional[Union[str, os.PathLike]] = None,
        method: Optional[str] = "script",
        example_inputs: Optional[Any] = None,
        **kwargs: Any,
    ) -> Union[torch.jit.ScriptModule, dict[str, torch.jit.ScriptModule]]:
        """This module compiled by ``torch.jit.script`` (default) or ``torch.jit.trace`` (``method="trace"``), in eval mode.

        Tracing runs ``forward`` on ``example_inputs`` (default: :attr:`example_input_array`), moved
        by the batch-transfer hooks as a batch would be. ``kwargs`` go to ``torch.jit.script`` /
        ``torch.jit.trace``. With ``file_path`` the result is also saved there (``torch.jit.save``;
        any fsspec URL). The module's own train/eval mode is left as it was.
        """
        mode = self.training
        LightningModule._jit_is_scripting = True
        try:
            if method == "script":
                scripted = torch.jit.script(self.eval(), **kwargs)
            elif method == "trace":
                if example_inputs is None:
                    if self.example_input_array is None:
                        raise ValueError(
                            f"{type(self).__name__}.to_torchscript(method='trace') needs an input to trace with: "
                            "pass `example_inputs=` or set `self.example_input_array`."
                        )
                    example_inputs = self.example_input_array
                if kwargs.get("check_inputs") is not None:
                    kwargs["check_inputs"] = self._example_on_device(kwargs["check_inputs"])
                example_inputs = self._example_on_device(example_inputs)
                scripted = torch.jit.trace(func=self.eval(), example_inputs=example_inputs, **kwargs)
            else:
                raise ValueError(
                    f"{type(self).__name__}.to_torchscript(method={method!r}): use 'script' or 'trace'."
                )
        finally:
            LightningModule._jit_is_scripting = False
            self.train(mode)
        if file_path is not None:
            from trainer_core import paths

            fs, path = paths.resolve(os.fspath(file_path))
            with fs.open(path, "wb") as f:
                torch.jit.save(scripted, f)
        return scripted

    @torch.no_grad()
    def to_onnx(
        self,
        file_path: Union[str, os.PathLike, Any, None] = None,
        input_sample: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        """Export this module to ONNX with ``torch.onnx.export`` (``kwargs`` go to it); returns what it returns.

        ``input_sample`` (default: :attr:`example_input_array`) is moved by the batch-transfer hooks
        as a batch would be. The module is exported in eval mode (Lightning exports it in the mode
        it is in, which bakes training-mode dropout into the graph) and its mode is restored after.
        The exporter of this torch needs the packages ``onnx`` and ``onnxscript``, an optional
        extra: one clear error names them when they are missing.
        """
        _require_onnx_exporter(type(self).__name__)
        if input_sample is None:
            if self.example_input_array is None:
                raise ValueError(
                    f"{type(self).__name__}.to_onnx() needs an input to trace with: pass `input_sample=` or set "
                    "`self.example_input_array`."
                )
            input_sample = self.example_input_array
        input_sample = self._example_on_device(input_sample)
        if isinstance(file_path, os.PathLike):
            file_path = os.fspath(file_path)
        mode = self.training
        try:
            # In eval mode, as ``to_torchscript`` does: an exported graph serves inference (dropout off).
            return torch.onnx.export(self.eval(), input_sample, file_path, **kwargs)
        finally:
            self.train(mode)

    # ------------------------------------------------------------------ logging
    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: Optional[bool] = None,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        reduce_fx: Union[str, Callable] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Optional[Any] = None,
        add_dataloader_idx: bool = True,
        batch_size: Optional[int] = None,
        metric_attribute: Optional[str] = None,
        rank_zero_only: bool = False,
    ) -> None:
        """Record a metric for the progress bar, the loggers and callbacks (``callback_metrics``).

        Defaults follow Lightning: in ``training_step`` and the train batch hooks a value is
        logged per step; everywhere else it is reduced over the epoch with ``reduce_fx``.
        ``sync_dist=True`` reduces it across processes, over ``sync_dist_group`` when given (a
        ``torch.distributed`` group). With several evaluation dataloaders ``/dataloader_idx_N`` is
        appended to ``name`` unless ``add_dataloader_idx=False``; then each dataloader needs a name
        of its own. ``rank_zero_only=True`` (logged on rank 0 alone) is never reduced.

        ``value`` may be a ``torchmetrics.Metric``: its step value is what its last ``forward``
        returned, its epoch value its ``compute()`` (synced across processes by the metric itself,
        so ``sync_dist`` does not apply), and it is ``reset()`` after each epoch, as in Lightning.
        ``metric_attribute`` is accepted and not needed: Lightning uses it to find the metric again
        when restoring its logging state, which trainer-core does not keep in checkpoints, so a
        metric need not be an attribute of the module either.
        """
        trainer = self._trainer
        if trainer is None:
            return
        if trainer.barebones:
            rank_zero_warn(
                f"self.log({name!r}, ...) under Trainer(barebones=True) records nothing: barebones mode turns "
                "logging off. Drop barebones=True to log."
            )
            return
        fx = trainer.hook_runner.current_fx
        if fx is None:
            raise MisconfigurationException(
                f"self.log({name!r}, ...) was called outside a hook the Trainer runs; log from a step or an on_* hook."
            )
        results = trainer.metrics.results
        if results is None:
            return
        # Positional on purpose: this runs on every step that logs.
        results.log(
            fx,
            name,
            value,
            prog_bar,
            True if logger is None else logger,
            on_step,
            on_epoch,
            reduce_fx,
            enable_graph,
            sync_dist,
            sync_dist_group,
            add_dataloader_idx,
            batch_size,
            rank_zero_only,
        )

    def log_dict(
        self,
        dictionary: Mapping[str, Any],
        prog_bar: bool = False,
        logger: Optional[bool] = None,
        on_step: Optional[bool] = None,
        on_epoch: Optional[bool] = None,
        reduce_fx: Union[str, Callable] = "mean",
        enable_graph: bool = False,
        sync_dist: bool = False,
        sync_dist_group: Optional[Any] = None,
        add_dataloader_idx: bool = True,
        batch_size: Optional[int] = None,
        rank_zero_only: bool = False,
    ) -> None:
        """``self.log`` for every item of ``dictionary`` (a mapping or a ``torchmetrics.MetricCollection``), with the same options."""
        for name, value in dict_items(dictionary):
            self.log(
                name,
                value,
                prog_bar=prog_bar,
                logger=logger,
                on_step=on_step,
                on_epoch=on_epoch,
                reduce_fx=reduce_fx,
                enable_graph=enable_graph,
                sync_dist=sync_dist,
                sync_dist_group=sync_dist_group,
                add_dataloader_idx=add_dataloader_idx,
                batch_size=batch_size,
                rank_zero_only=rank_zero_only,
            )

    def all_gather(self, data: Any, group: Optional[Any] = None, sync_grads: bool = False) -> Any:
        """Every tensor in ``data`` gathered from all processes (those of ``group`` if given), stacked on a new dim 0."""
        from lightning_utilities.core.apply_func import apply_to_collection

        plugin = self.trainer.plugin

        def gather(t: Tensor) -> Tensor:
            # The group goes down only when given, as for self.log(sync_dist_group=...).
            if group is None:
                return plugin.all_gather(t, sync_grads=sync_grads)
            return plugin.all_gather(t, sync_grads=sync_grads, group=group)

        return apply_to_collection(data, Tensor, gather)

    @rank_zero_only
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on global rank 0 only."""
        print(*args, **kwargs)

    # ------------------------------------------------------------------ steps
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return super().forward(*args, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        raise MisconfigurationException(
            f"{type(self).__name__} does not define `training_step`; `Trainer.fit` needs it to compute the loss."
        )

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """Optional: compute and ``self.log`` validation metrics."""

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """Optional: compute and ``self.log`` test metrics."""

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """Default: the module's forward on the batch (the first element of a tuple/list batch)."""
        batch = args[0] if args else kwargs.get("batch")
        if isinstance(batch, (list, tuple)) and batch:
            batch = batch[0]
        return self(batch)

    # ------------------------------------------------------------------ optimization
    def configure_optimizers(self) -> Any:
        raise MisconfigurationException(
            f"{type(self).__name__} does not define `configure_optimizers`; return an optimizer (or the forms "
            "Lightning accepts) from it."
        )

    def configure_callbacks(self) -> Union[Sequence[Any], Any]:
        return []

    def configure_model(self) -> None:
        """Create layers here to build them directly under the plugin (sharded or on device)."""

    def optimizers(
        self, use_pl_optimizer: bool = True
    ) -> Union[LightningOptimizer, list[LightningOptimizer], Optimizer, list[Optimizer]]:
        """The optimizers of this run: one, or a list when there are several."""
        trainer = self.trainer
        opts: list[Any] = trainer.lightning_optimizers if use_pl_optimizer else trainer.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        """The schedulers of this run: ``None``, one, or a list."""
        configs = self.trainer.lr_scheduler_configs
        if not configs:
            return None
        schedulers = [config.scheduler for config in configs]
        return schedulers[0] if len(schedulers) == 1 else schedulers

    def manual_backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        """Backward with the hooks, precision scaling and plugin handling of the automatic path."""
        if self._automatic_optimization:
            raise MisconfigurationException(
                "manual_backward is for manual optimization; set `self.automatic_optimization = False` in __init__."
            )
        self.trainer.plugin.backward(loss, None, *args, **kwargs)

    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        loss.backward(*args, **kwargs)

    def toggle_optimizer(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """Freeze every parameter that ``optimizer`` does not own (for GAN-style alternation)."""
        optimizer = getattr(optimizer, "optimizer", optimizer)
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self._param_requires_grad_state = {}
        for param in self.parameters():
            self._param_requires_grad_state[param] = param.requires_grad
            if id(param) not in owned:
                param.requires_grad = False

    def untoggle_optimizer(self, optimizer: Union[Optimizer, LightningOptimizer]) -> None:
        """Undo ``toggle_optimizer``."""
        for param, requires_grad in getattr(self, "_param_requires_grad_state", {}).items():
            param.requires_grad = requires_grad
        self._param_requires_grad_state = {}

    @contextlib.contextmanager
    def toggled_optimizer(self, optimizer: Union[Optimizer, LightningOptimizer]) -> Iterator[None]:
        """``toggle_optimizer`` for the ``with`` block, ``untoggle_optimizer`` after it (even if it raised)."""
        self.toggle_optimizer(optimizer)
        try:
            yield
        finally:
            self.untoggle_optimizer(optimizer)

    def clip_gradients(
        self,
        optimizer: Union[Optimizer, LightningOptimizer],
        gradient_clip_val: Optional[Union[int, float]] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        """Clip this module's gradients by norm (default) or by value, through the plugin."""
        if gradient_clip_val is None or gradient_clip_val == 0:
            return
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise MisconfigurationException(
                f"gradient_clip_algorithm={algorithm!r} is not known; use 'norm' or 'value'."
            )
        optimizer = getattr(optimizer, "optimizer", optimizer)
        self.trainer.plugin.clip_gradients(optimizer, float(gradient_clip_val), algorithm)

    def configure_gradient_clipping(
        self,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(
        self,
        epoch: int,
        batch_idx: int,
        optimizer: Union[Optimizer, LightningOptimizer],
        optimizer_closure: Optional[Callable[[], Any]] = None,
    ) -> None:
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Optimizer) -> None:
        optimizer.zero_grad()

    def lr_scheduler_step(self, scheduler: Any, metric: Optional[Any]) -> None:
        if metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # ------------------------------------------------------------------ data
    def prepare_data(self) -> None:
        """Download or prepare data once per node (rank 0 of each node)."""

    def setup(self, stage: str) -> None:
        """Called on every process at the start of fit/validate/test/predict."""

    def teardown(self, stage: str) -> None:
        """Called on every process at the end of fit/validate/test/predict."""

    def train_dataloader(self) -> Any:
        raise MisconfigurationException(
            f"No training data: pass `train_dataloaders=` or a datamodule to `fit`, or define "
            f"`{type(self).__name__}.train_dataloader`."
        )

    def val_dataloader(self) -> Any:
        return []

    def test_dataloader(self) -> Any:
        raise MisconfigurationException(
            f"No test data: pass `dataloaders=` or a datamodule to `test`, or define `{type(self).__name__}.test_dataloader`."
        )

    def predict_dataloader(self) -> Any:
        raise MisconfigurationException(
            "No predict data: pass `dataloaders=` or a datamodule to `predict`, or define "
            f"`{type(self).__name__}.predict_dataloader`."
        )

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return move_data_to_device(batch, device)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    # ------------------------------------------------------------------ checkpoint hooks
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Add to (or edit) the checkpoint dict before it is written."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Read what ``on_save_checkpoint`` added, before the state is restored."""

    @classmethod
    def load_from_checkpoint(
        cls,
        checkpoint_path: Any,
        map_location: Any = None,
        hparams_file: Any = None,
        strict: Optional[bool] = None,
        weights_only: Optional[bool] = None,
        **kwargs: Any,
    ) -> LightningModule:
        """Build the module from the checkpoint's hyper-parameters and load its weights.

        ``hparams_file`` (``.yaml``/``.yml``, or Lightning's ``.csv`` of ``key,value`` rows) replaces
        the checkpoint's value of every hyper-parameter it names; ``kwargs`` override both.
        ``strict`` defaults to :attr:`strict_loading`. ``weights_only`` is Lightning's: by default the
        checkpoint is read without running code from it (a class of your own in it loads once
        registered with ``register_safe_globals``); ``False`` unpickles the whole file, for one you trust.
        """
        from trainer_core.checkpoint.format import trusted_unpickling
        from trainer_core.checkpoint.restore import load_module_from_checkpoint

        if hparams_file is not None:
            kwargs = {**_load_hparams_file(hparams_file), **kwargs}
        with trusted_unpickling(weights_only is False):
            return load_module_from_checkpoint(
                cls, checkpoint_path, map_location=map_location, strict=strict, **kwargs
            )

    # ------------------------------------------------------------------ lifecycle hooks (no-ops)
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> Optional[int]: ...
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_validation_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_before_backward(self, loss: Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: Optimizer) -> None: ...
    def on_before_zero_grad(self, optimizer: Optimizer) -> None: ...

    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_zero_grad(self) -> None:
        """Release the gradients before validation in ``fit`` (they are rebuilt by the next step)."""
        self.zero_grad(set_to_none=True)

    def on_validation_model_train(self) -> None:
        self.train()

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    # ------------------------------------------------------------------ conveniences
    def freeze(self) -> None:
        for param in self.parameters():
            param.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        for param in self.parameters():
            param.requires_grad = True
        self.train()


ONNX_INSTALL_HINT = "pip install onnx onnxscript"


def _require_onnx_exporter(owner: str) -> None:
    """Fail once, naming what to install, where ``torch.onnx.export`` would fail deep inside the exporter."""
    import importlib

    missing = []
    for package in ("onnx", "onnxscript"):
        try:
            importlib.import_module(package)
        except ImportError:
            missing.append(package)
    if missing:
        raise ModuleNotFoundError(
            f"{owner}.to_onnx() needs the ONNX exporter's packages {missing}, which are not installed: "
            f"`{ONNX_INSTALL_HINT}`."
        )


Hook = Callable[..., Any]
BATCH_TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def batch_transfer_hooks(
    module: LightningModule, datamodule: Optional[LightningDataModule], warn: bool = True
) -> Optional[tuple[Hook, Hook, Hook]]:
    """The three batch-transfer hooks of a run, or ``None`` when neither the module nor the data module overrides one.

    Each is the data module's where it overrides it, else the module's (Lightning's rule, hook by
    hook). Defining one in both is allowed; the data module's wins, with a warning. Here, beside the
    module's own defaults, so the module asks it without importing the hook runner.
    """
    chosen: list[Hook] = []
    overridden = False
    for name in BATCH_TRANSFER_HOOKS:
        in_module = is_overridden(name, module, LightningModule)
        in_data = datamodule is not None and is_overridden(name, datamodule, LightningDataModule)
        if in_module and in_data and warn:
            rank_zero_warn(
                f"`{name}` is defined by both {type(module).__name__} and {type(datamodule).__name__}; the data "
                "module's is used. Delete one of them to silence this."
            )
        overridden = overridden or in_module or in_data
        chosen.append(getattr(datamodule if in_data else module, name))
    return (chosen[0], chosen[1], chosen[2]) if overridden else None
