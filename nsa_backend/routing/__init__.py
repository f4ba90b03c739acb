"""Routing: which implementation runs each op on this GPU, model and configuration.

- :func:`select_impl` resolves ``impl="auto"`` (and checks explicit names) for every public op.
- :func:`detect_arch` / :func:`model_family` classify the GPU and the model.
- :func:`validate_impl_choice` / :func:`valid_impl_choices` check a framework's prefill / decode
  implementation choice at startup.
- :mod:`~nsa_backend.routing.config` reads the TOML / environment overrides (``docs/config.md``).
- :mod:`~nsa_backend.routing.capabilities` is the declarative capability table.
"""

from nsa_backend.routing.capabilities import (
    TABLE,
    NativeStatus,
    Support,
    evaluate,
    probe_natives,
    set_native_status,
)
from nsa_backend.routing.config import (
    Config,
    ConfigError,
    get_config,
    load_config,
    reset_config,
    use_config,
)
from nsa_backend.routing.device import (
    ARCH_FAMILIES,
    MODEL_ARCHS,
    ModelInfo,
    detect_arch,
    family_from_capability,
    hardware_arch,
    model_family,
    model_info,
)
from nsa_backend.routing.router import (
    OP_FAMILY,
    Decision,
    active_model,
    clear_cache,
    decide,
    get_padded_heads,
    model_op_features,
    plan_routes,
    select_impl,
    set_active_model,
    stats,
    valid_impls,
)
from nsa_backend.routing.validate import (
    IMPL_CHOICES,
    ImplChoiceError,
    valid_impl_choices,
    validate_impl_choice,
)

__all__ = [
    "ARCH_FAMILIES",
    "IMPL_CHOICES",
    "MODEL_ARCHS",
    "OP_FAMILY",
    "TABLE",
    "Config",
    "ConfigError",
    "Decision",
    "ImplChoiceError",
    "ModelInfo",
    "NativeStatus",
    "Support",
    "active_model",
    "clear_cache",
    "decide",
    "detect_arch",
    "evaluate",
    "family_from_capability",
    "get_config",
    "get_padded_heads",
    "hardware_arch",
    "load_config",
    "model_family",
    "model_info",
    "model_op_features",
    "plan_routes",
    "probe_natives",
    "reset_config",
    "select_impl",
    "set_active_model",
    "set_native_status",
    "stats",
    "use_config",
    "valid_impl_choices",
    "valid_impls",
    "validate_impl_choice",
]
