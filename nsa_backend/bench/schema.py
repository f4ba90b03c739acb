"""JSON schema of ``results.json`` and a validator for it (no ``jsonschema`` dependency).

``SCHEMA`` is a JSON Schema (draft 2020-12 subset) written as a dict; :func:`validate` checks a
result against it and raises ``ValueError`` naming the first offending path. The subset the
validator understands: ``type`` (one name or a list), ``enum``, ``minimum``,
``exclusiveMinimum``, ``minLength``, ``required``, ``properties``, ``additionalProperties``
(bool or schema) and ``items``.
"""

from __future__ import annotations

import math
from typing import Any

SCHEMA_VERSION = 1

_NUM_OR_NULL: dict[str, Any] = {"type": ["number", "null"]}
_POS_OR_NULL: dict[str, Any] = {"type": ["number", "null"], "exclusiveMinimum": 0}
_STR_OR_NULL: dict[str, Any] = {"type": ["string", "null"]}

ROW_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["family", "op", "shape", "impl", "ms", "tflops", "gbps", "ratios"],
    "properties": {
        "family": {"type": "string", "minLength": 1},
        "op": {"type": "string", "minLength": 1},
        "shape": {"type": ["string", "object"]},
        "impl": {"type": "string", "minLength": 1},
        "ms": _POS_OR_NULL,
        "tflops": {"type": ["number", "null"], "minimum": 0},
        "gbps": {"type": ["number", "null"], "minimum": 0},
        "ratios": {"type": "object", "additionalProperties": _NUM_OR_NULL},
        "limit": {"type": ["array", "null"], "items": {"enum": ["copy_gbps", "bf16_tflops", "fp8_tflops"]}},
        "note": _STR_OR_NULL,
    },
    "additionalProperties": True,
}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "nsa-backend bench results",
    "type": "object",
    "required": ["schema_version", "created", "command", "argv", "device", "quick", "environment",
                 "limits", "limit_sizes", "families", "rows"],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "created": {"type": "string", "minLength": 1},
        "command": {"type": "string", "minLength": 1},
        "argv": {"type": "array", "items": {"type": "string"}},
        "device": {"type": "string", "enum": ["cuda", "cpu"]},
        "quick": {"type": "boolean"},
        "environment": {
            "type": "object",
            "required": ["gpu_name", "capability", "driver", "cuda", "python", "platform", "torch",
                         "triton", "nsa_backend", "native", "git_commit", "git_dirty"],
            "properties": {
                "gpu_name": _STR_OR_NULL,
                "capability": _STR_OR_NULL,
                "driver": _STR_OR_NULL,
                "cuda": _STR_OR_NULL,
                "python": {"type": "string"},
                "platform": {"type": "string"},
                "torch": {"type": "string"},
                "triton": _STR_OR_NULL,
                "nsa_backend": {"type": "string"},
                "native": {"type": "object", "additionalProperties": _STR_OR_NULL},
                "git_commit": _STR_OR_NULL,
                "git_dirty": {"type": ["boolean", "null"]},
            },
            "additionalProperties": True,
        },
        "limits": {
            "type": "object",
            "required": ["copy_gbps", "bf16_tflops", "fp8_tflops"],
            "properties": {
                "copy_gbps": _POS_OR_NULL,
                "bf16_tflops": _POS_OR_NULL,
                "fp8_tflops": _POS_OR_NULL,
            },
            "additionalProperties": False,
        },
        "limit_sizes": {"type": "object", "additionalProperties": {"type": "integer"}},
        "families": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["status", "source", "rows", "seconds", "note"],
                "properties": {
                    "status": {"enum": ["ok", "skipped", "error"]},
                    "source": {"enum": ["module", "builtin", "none"]},
                    "rows": {"type": "integer", "minimum": 0},
                    "seconds": {"type": "number", "minimum": 0},
                    "note": _STR_OR_NULL,
                },
                "additionalProperties": False,
            },
        },
        "rows": {"type": "array", "items": ROW_SCHEMA},
        # Only in runs of the mma.sync proxy (nsa_backend.bench.proxy).
        "proxy": {
            "type": "object",
            "required": ["arch", "capability", "shared_memory_limit", "disable_mma_v3", "gluon", "sass"],
            "additionalProperties": True,
        },
    },
    "additionalProperties": False,
}

_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "null": lambda v: v is None,
}


def _check(value: Any, schema: dict[str, Any], path: str) -> None:
    types = schema.get("type")
    if types is not None:
        names = [types] if isinstance(types, str) else list(types)
        if not any(_TYPES[t](value) for t in names):
            raise ValueError(f"{path}: expected {' or '.join(names)}, got {type(value).__name__} {value!r:.80}")
    if "enum" in schema and value not in schema["enum"]:
        raise ValueError(f"{path}: expected one of {schema['enum']}, got {value!r:.80}")
    is_num = _TYPES["number"](value)
    if is_num and "minimum" in schema and value < schema["minimum"]:
        raise ValueError(f"{path}: expected >= {schema['minimum']}, got {value}")
    if is_num and "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        raise ValueError(f"{path}: expected > {schema['exclusiveMinimum']}, got {value}")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        raise ValueError(f"{path}: expected a string of length >= {schema['minLength']}, got {value!r}")
    if isinstance(value, dict):
        for key in schema.get("required", ()):
            if key not in value:
                raise ValueError(f"{path}: missing required key {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path}: expected string keys, got {key!r}")
            if key in props:
                _check(item, props[key], f"{path}.{key}")
            elif extra is False:
                raise ValueError(f"{path}: unexpected key {key!r}; allowed: {sorted(props)}")
            elif isinstance(extra, dict):
                _check(item, extra, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{path}[{i}]")


def validate(result: Any, schema: dict[str, Any] | None = None) -> None:
    """Raise ``ValueError`` if ``result`` does not follow ``schema`` (default: :data:`SCHEMA`)."""
    _check(result, SCHEMA if schema is None else schema, "result")


def validate_row(row: Any) -> None:
    """Raise ``ValueError`` if one benchmark row does not follow :data:`ROW_SCHEMA`."""
    _check(row, ROW_SCHEMA, "row")
