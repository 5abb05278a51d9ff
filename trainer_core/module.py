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

from trainer_core.errors import MisconfigurationException
from trainer_core.results import dict_items
from trainer_core.utilities import AttributeDict, move_data_to_device, rank_zero_only

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from trainer_core.optim import LightningOptimizer
    from trainer_core.trainer import Trainer


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
        self._trainer: Optional[Trainer] = None
        self._automatic_optimization = True
        self._hparams: AttributeDict = AttributeDict()
        self._hparams_initial: AttributeDict = AttributeDict()
        self._log_hyperparams = True
        self._example_input_array: Optional[Union[Tensor, tuple, dict]] = None
        self._strict_loading: Optional[bool] = None

    # ------------------------------------------------------------------ trainer-facing attributes
    @property
    def trainer(self) -> Trainer:
        if self._trainer is None and not LightningModule._jit_is_scripting:
            raise RuntimeError(f"{type(self).__qualname__} is not attached to a `Trainer`.")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: Optional[Trainer]) -> None:
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
        from trainer_core.hooks import batch_transfer_hooks

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
        ``strict`` defaults to :attr:`strict_loading`. ``weights_only`` is accepted for Lightning's
        signature only: a checkpoint is always read without running code from it (a class of your
        own in it loads once registered with ``register_safe_globals``).
        """
        from trainer_core.checkpoint.restore import load_module_from_checkpoint

        if hparams_file is not None:
            kwargs = {**_load_hparams_file(hparams_file), **kwargs}
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


#: The largest ``hparams_file`` read: loggers write a few KiB, and a pure-Python YAML parse of much more
#: takes seconds; a file this big is not a file of hyper-parameters.
MAX_HPARAMS_FILE_BYTES = 2**20


def _load_hparams_file(hparams_file: Any) -> dict[str, Any]:
    """The hyper-parameters in ``load_from_checkpoint(hparams_file=...)``: a YAML mapping or a ``.csv``.

    Every way the file can be wrong (too big, not UTF-8 text, not YAML or CSV, not a mapping of names,
    nested too deep or a "billion laughs" of YAML aliases) is one :class:`MisconfigurationException`
    naming it; a missing file is a ``FileNotFoundError``.
    """
    from trainer_core import paths
    from trainer_core.utilities.nesting import nesting_problem

    path = os.fspath(hparams_file)
    where = f"load_from_checkpoint(hparams_file={path!r})"
    extension = path.rsplit(".", 1)[-1].lower()
    if extension not in ("yaml", "yml", "csv"):
        raise MisconfigurationException(f"{where}: use a .yaml, .yml or .csv file of hyper-parameters.")
    fs, fs_path = paths.resolve(path)
    if not fs.exists(fs_path):
        raise FileNotFoundError(f"{where}: there is no such file.")
    if fs.isdir(fs_path):
        raise MisconfigurationException(f"{where} is a folder; pass the hparams.yaml file in it.")
    with fs.open(fs_path, "rb") as f:
        data = f.read(MAX_HPARAMS_FILE_BYTES + 1)
    if len(data) > MAX_HPARAMS_FILE_BYTES:
        raise MisconfigurationException(
            f"{where} is larger than {MAX_HPARAMS_FILE_BYTES // 2**20} MiB, which no file of hyper-parameters "
            "is; pass the hparams.yaml the logger wrote, or the hyper-parameters as keywords."
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise MisconfigurationException(
            f"{where} is not UTF-8 text (byte {err.start} is {data[err.start : err.start + 1]!r}); pass the "
            "hparams.yaml the logger wrote, or the hyper-parameters as keywords."
        ) from None
    hparams = _parse_csv(text, where) if extension == "csv" else _parse_yaml(text, where)
    if not isinstance(hparams, dict):
        raise MisconfigurationException(
            f"{where} holds a {type(hparams).__name__}; it must map hyper-parameter names to values."
        )
    not_names = [key for key in hparams if not isinstance(key, str)]
    if not_names:
        raise MisconfigurationException(
            f"{where} maps {not_names[0]!r} ({type(not_names[0]).__name__}) to a value; hyper-parameter names "
            "are strings."
        )
    problem = nesting_problem(hparams)
    if problem is not None:
        raise MisconfigurationException(f"{where} {problem}; pass a file of plain hyper-parameters.")
    return hparams


def _parse_csv(text: str, where: str) -> dict[str, Any]:
    """Lightning's layout: a ``key,value`` header, then one row per hyper-parameter."""
    import csv
    import io

    hparams: dict[str, Any] = {}
    try:
        for row in list(csv.reader(io.StringIO(text)))[1:]:
            if not row:
                continue
            if len(row) != 2:
                raise MisconfigurationException(
                    f"{where}: the row {row[:3]!r} has {len(row)} cells; each row is `name,value`."
                )
            hparams[row[0]] = _literal(row[1], row[0], where)
    except csv.Error as err:
        raise MisconfigurationException(f"{where} is not a CSV file of `name,value` rows: {err}.") from None
    return hparams


def _parse_yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:
        # CSVLogger and TensorBoardLogger write hparams.yaml as JSON (valid YAML): those need no YAML library.
        import json

        try:
            return json.loads(text)
        except RecursionError:
            raise _too_deep(where) from None
        except ValueError:
            raise MisconfigurationException(
                f"{where} needs PyYAML to read YAML: `pip install pyyaml`, "
                "or pass the hyper-parameters to load_from_checkpoint as keywords."
            ) from None
    try:
        # safe_load: a hyper-parameter file must not be able to build arbitrary Python objects.
        return yaml.safe_load(text)
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise _too_deep(where) from None
    except yaml.YAMLError as err:
        raise MisconfigurationException(f"{where} is not YAML that safe_load reads: {err}") from err


def _too_deep(where: str, key: Optional[str] = None) -> MisconfigurationException:
    what = f"the value of {key!r}" if key is not None else "it"
    return MisconfigurationException(
        f"{where}: {what} nests too deeply to be a hyper-parameter; pass a file of plain hyper-parameters."
    )


def _literal(text: str, key: str, where: str) -> Any:
    """A ``.csv`` cell as the Python value it spells (``0.1``, ``True``, ``[1, 2]``), else the text itself."""
    import ast

    try:
        return ast.literal_eval(text)
    except (RecursionError, MemoryError):  # what Python's parser raises on a literal nested very deep
        raise _too_deep(where, key) from None
    except SyntaxError as err:
        if "too many nested" in str(err):
            raise _too_deep(where, key) from None
        return text
    except (ValueError, TypeError):
        return text


def select_hyperparameters(
    owner: object,
    args: Sequence[Any],
    ignore: Optional[Union[Sequence[str], str]],
    frame: Any,
    owner_type: type,
) -> dict[str, Any]:
    """What ``owner.save_hyperparameters(*args, ignore=...)`` keeps (a module's or a data module's).

    With no ``args`` every argument of the ``__init__`` frames from ``frame`` outward; with names,
    only those (a name that is not an argument is an error: it would be silently missing on load);
    with one dict or ``argparse.Namespace``, that object's items.
    """
    if len(args) == 1 and not isinstance(args[0], str):
        source = args[0]
        hparams = (
            dict(vars(source))
            if hasattr(source, "__dict__") and not isinstance(source, Mapping)
            else dict(source)
        )
    else:
        init_args = _collect_init_args(frame, owner_type)
        if args:
            missing = [name for name in args if name not in init_args]
            if missing:
                raise ValueError(
                    f"save_hyperparameters: {missing} are not arguments of {type(owner).__name__}.__init__."
                )
            hparams = {name: init_args[name] for name in args}
        else:
            hparams = init_args
    for name in [ignore] if isinstance(ignore, str) else list(ignore or []):
        hparams.pop(name, None)
    return hparams


def store_hyperparameters(
    owner: Any,
    args: Sequence[Any],
    ignore: Optional[Union[Sequence[str], str]],
    frame: Any,
    owner_type: type,
) -> None:
    """``owner.save_hyperparameters(...)`` for a module or a data module, with Lightning's rules.

    What is selected is added to ``owner.hparams`` (a later call extends an earlier one); names in
    ``ignore`` are also removed from what was stored before, so a subclass can drop its parent's.
    ``hparams_initial`` becomes a deep copy, so later edits of ``hparams`` do not change it.
    """
    if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
        return  # an empty dict or Namespace: nothing to store (Lightning's rule)
    selected = select_hyperparameters(owner, args, ignore, frame, owner_type)
    owner._hparams_name = _hparams_name(args, frame, owner_type)
    stored = owner.hparams
    stored.update(selected)
    for name in [ignore] if isinstance(ignore, str) else list(ignore or []):
        stored.pop(name, None)
    modules = [name for name, value in stored.items() if isinstance(value, nn.Module)]
    if modules:
        from trainer_core.utilities import rank_zero_warn

        rank_zero_warn(
            f"save_hyperparameters: {modules} are nn.Module objects, which the checkpoint keeps as weights already "
            f"and not as hyper-parameters; leave them out with `self.save_hyperparameters(ignore={modules})`."
        )
    try:
        owner._hparams_initial = copy.deepcopy(stored)
    except Exception:  # an object that cannot be copied (a lock, a generator): share it instead
        owner._hparams_initial = AttributeDict(stored)


def _hparams_name(args: Sequence[Any], frame: Any, owner_type: type) -> Optional[str]:
    """The ``__init__`` argument that held the one dict given to ``save_hyperparameters`` (Lightning's ``hparams_name``).

    Loading passes the stored hyper-parameters back under that name (``cls(hparams={...})``)
    instead of spreading them, so ``__init__(self, hparams)`` modules load from their checkpoints.
    """
    if not (len(args) == 1 and not isinstance(args[0], str)):
        return None
    for name, value in _collect_init_args(frame, owner_type).items():
        if value is args[0]:
            return name
    return None


def hparams_argument(cls: type, name: Optional[str]) -> Optional[str]:
    """``name`` if it is a named ``__init__`` argument of ``cls`` (where a checkpoint's ``hparams_name`` goes), else ``None``.

    Lightning writes ``"kwargs"`` when ``save_hyperparameters()`` took every argument: that names
    no single argument, so ``*args``/``**kwargs`` never count.
    """
    if not name:
        return None
    parameter = inspect.signature(cls.__init__).parameters.get(name)
    named = parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    return name if named and name != "self" else None


def _collect_init_args(frame: Any, owner_type: type = nn.Module) -> dict[str, Any]:
    """The named arguments (and ``**kwargs``) of the ``__init__`` frames from ``frame`` outward.

    Walking outward collects a subclass's and its parents' init arguments, as Lightning does;
    the innermost frame wins on a name both define.
    """
    collected: dict[str, Any] = {}
    while frame is not None and frame.f_code.co_name == "__init__":
        info = inspect.getargvalues(frame)
        local_vars = info.locals
        if "self" not in local_vars or not isinstance(local_vars["self"], owner_type):
            break
        found: dict[str, Any] = {
            name: local_vars[name] for name in info.args if name != "self" and name in local_vars
        }
        if info.keywords and isinstance(local_vars.get(info.keywords), dict):
            found.update(local_vars[info.keywords])
        for key, value in found.items():
            collected.setdefault(key, value)
        frame = frame.f_back
    return collected
