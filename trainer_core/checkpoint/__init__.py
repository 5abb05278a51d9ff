"""The checkpoint format (keys, version, validation) and name-keyed optimizer state."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainer_core.checkpoint.format import (
    FORMAT_VERSION,
    KEY_CALLBACKS,
    KEY_EPOCH,
    KEY_FORMAT_VERSION,
    KEY_GLOBAL_STEP,
    KEY_HPARAMS,
    KEY_LOOPS,
    KEY_LR_SCHEDULERS,
    KEY_OPTIMIZER_STATES,
    KEY_PLUGIN,
    KEY_PRECISION,
    KEY_RNG,
    KEY_STATE_DICT,
    KEY_VERSION,
    REQUIRED_KEYS,
    RESUME_KEYS,
    check_state_dict_matches,
    decode_byte_payloads,
    encode_byte_payloads,
    register_safe_globals,
    safe_globals,
    validate_checkpoint,
)
from trainer_core.checkpoint.lightning import from_lightning, is_lightning_checkpoint
from trainer_core.checkpoint.optimizer import (
    check_named_state_covers,
    extra_fields,
    merge_named_states,
    optimizer_state_from_names,
    optimizer_state_to_names,
    parameter_names,
    refuse_fields_of_sharded_states,
    select_named_state,
)

if TYPE_CHECKING:
    from trainer_core.checkpoint.safetensors import LoadResult, load_safetensors, save_safetensors

__all__ = [
    "FORMAT_VERSION",
    "KEY_CALLBACKS",
    "KEY_EPOCH",
    "KEY_FORMAT_VERSION",
    "KEY_GLOBAL_STEP",
    "KEY_HPARAMS",
    "KEY_LOOPS",
    "KEY_LR_SCHEDULERS",
    "KEY_OPTIMIZER_STATES",
    "KEY_PLUGIN",
    "KEY_PRECISION",
    "KEY_RNG",
    "KEY_STATE_DICT",
    "KEY_VERSION",
    "REQUIRED_KEYS",
    "RESUME_KEYS",
    "LoadResult",
    "check_named_state_covers",
    "check_state_dict_matches",
    "decode_byte_payloads",
    "encode_byte_payloads",
    "extra_fields",
    "from_lightning",
    "is_lightning_checkpoint",
    "load_safetensors",
    "merge_named_states",
    "optimizer_state_from_names",
    "optimizer_state_to_names",
    "parameter_names",
    "refuse_fields_of_sharded_states",
    "register_safe_globals",
    "safe_globals",
    "save_safetensors",
    "select_named_state",
    "validate_checkpoint",
]


def __getattr__(name: str) -> Any:
    # The safetensors reader and writer (and fsspec under them) load on first use, not with the Trainer.
    if name in ("LoadResult", "load_safetensors", "save_safetensors"):
        from trainer_core.checkpoint import safetensors

        return getattr(safetensors, name)
    raise AttributeError(f"module 'trainer_core.checkpoint' has no attribute {name!r}")
