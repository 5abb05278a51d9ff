"""The checkpoint format (keys, version, validation) and name-keyed optimizer state."""

from __future__ import annotations

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
from trainer_core.checkpoint.optimizer import (
    optimizer_state_from_names,
    optimizer_state_to_names,
    parameter_names,
)

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
    "KEY_PRECISION",
    "KEY_RNG",
    "KEY_STATE_DICT",
    "KEY_VERSION",
    "REQUIRED_KEYS",
    "RESUME_KEYS",
    "check_state_dict_matches",
    "decode_byte_payloads",
    "encode_byte_payloads",
    "optimizer_state_from_names",
    "optimizer_state_to_names",
    "parameter_names",
    "register_safe_globals",
    "safe_globals",
    "validate_checkpoint",
]
