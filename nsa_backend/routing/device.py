"""Device and model classification used by routing.

A GPU is reduced to an *arch family*: the set of GPUs that the same native kernels and the same
routing decisions apply to. Families: ``sm80`` (A100), ``sm86`` (A10, RTX 30xx, Jetson Orin),
``sm89`` (L4, L40, RTX 40xx), ``sm90`` (H100, H200, H20), ``sm100`` (B200, GB200), ``sm103``
(B300, GB300), ``sm120`` (RTX 50xx, RTX PRO 6000), ``sm121`` (DGX Spark GB10), ``rocm`` (AMD) and
``cpu``.

A model is reduced to a *model family* from its Hugging Face ``config.json``: DeepSeek-V3.2,
GLM-5 (GLM DSA) or DeepSeek-V4.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from nsa_backend import _settings

ARCH_FAMILIES: tuple[str, ...] = (
    "sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "sm120", "sm121", "rocm", "cpu",
)
CUDA_ARCHS: frozenset[str] = frozenset(ARCH_FAMILIES) - {"rocm", "cpu"}
GPU_ARCHS: frozenset[str] = frozenset(ARCH_FAMILIES) - {"cpu"}

# Exact compute capabilities with a family of their own or a close sibling.
_CC_TO_FAMILY: dict[tuple[int, int], str] = {
    (8, 0): "sm80",
    (8, 6): "sm86",
    (8, 7): "sm86",   # Jetson Orin: Ampere with sm86's shared-memory budget
    (8, 8): "sm86",
    (8, 9): "sm89",
    (9, 0): "sm90",
    (10, 0): "sm100",
    (10, 3): "sm103",
    (12, 0): "sm120",
    (12, 1): "sm121",
}


def family_from_capability(major: int, minor: int) -> str:
    """Arch family of a CUDA compute capability.

    Capabilities without a family of their own map to the closest family whose routing is safe:
    other 9.x -> ``sm90``; other 10.x -> ``sm100``; other 12.x -> ``sm120``; 11.x (Jetson Thor)
    and anything newer than 12.x -> ``sm89`` (Triton only: the native DSA kernels are built for
    sm_90a / sm_100f / sm_120a and do not load there); below 8.0 -> ``sm80`` (unsupported,
    reported by ``nsa-backend doctor``).
    """
    family = _CC_TO_FAMILY.get((major, minor))
    if family is not None:
        return family
    if major < 8:
        return "sm80"
    if major == 8:
        return "sm86" if minor < 9 else "sm89"
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"
    if major == 12:
        return "sm120"
    return "sm89"


def check_arch(name: str, source: str) -> str:
    """Return ``name`` if it is an arch family, else raise ``ValueError`` naming ``source``."""
    if name not in ARCH_FAMILIES:
        raise ValueError(f"{source}: unknown arch family {name!r}; accepted values: {list(ARCH_FAMILIES)}")
    return name


def forced_arch() -> str | None:
    """The arch family forced by ``NSA_BACKEND_FORCE_ARCH`` or the config file's ``force_arch``."""
    return _settings.forced_arch()


@functools.cache
def _device_family(device_type: str, index: int) -> str:
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        return "cpu"
    if torch.version.hip is not None:
        return "rocm"
    major, minor = torch.cuda.get_device_capability(index)
    return family_from_capability(major, minor)


def detect_arch(device: torch.device | str | int | None = None) -> str:
    """Arch family of ``device`` (default: the current CUDA device, or ``"cpu"`` without CUDA).

    A forced arch (``NSA_BACKEND_FORCE_ARCH`` or ``force_arch`` in the config file) replaces the
    answer for CUDA devices and for the default device, so routes meant for other hardware can be
    exercised (``nsa-backend doctor`` on a laptop shows them too); an explicit CPU device always
    gives ``"cpu"`` because nothing else can run on CPU tensors.
    """
    if device is None:
        forced = forced_arch()
        if forced is not None:
            return forced
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    elif isinstance(device, int):
        device = torch.device("cuda", device)
    elif isinstance(device, str):
        device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    forced = forced_arch()
    if forced is not None:
        return forced
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_family("cuda", index)


def hardware_arch(device: torch.device | str | None) -> str:
    """Arch family of the GPU that actually runs ``device``'s kernels (ignores a forced arch)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _device_family("cuda", index)


def device_summary(device: torch.device | None = None) -> dict[str, Any]:
    """Name, compute capability, SM count and arch family of a CUDA device (empty without one)."""
    if not torch.cuda.is_available():
        return {}
    device = device or torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "family": _device_family("cuda", device.index or 0),
    }


# ----------------------------------------------------------------------------------------------
# Model families
# ----------------------------------------------------------------------------------------------

DEEPSEEK_V32 = "deepseek_v32"
GLM_DSA = "glm_dsa"
DEEPSEEK_V4 = "deepseek_v4"
MODEL_FAMILIES: tuple[str, ...] = (DEEPSEEK_V32, GLM_DSA, DEEPSEEK_V4)

_ARCH_TO_FAMILY: dict[str, str] = {
    "DeepseekV32ForCausalLM": DEEPSEEK_V32,
    "DeepseekV3ForCausalLM": DEEPSEEK_V32,      # only with index_topk (checked below)
    "GlmMoeDsaForCausalLM": GLM_DSA,
    "GlmMoeDsaForCausalLMNextN": GLM_DSA,
    "DeepseekV4ForCausalLM": DEEPSEEK_V4,
    "DeepseekV4ForCausalLMNextN": DEEPSEEK_V4,
}
# Architecture names accepted by validate_impl_choice (HF ``architectures[0]``).
MODEL_ARCHS: tuple[str, ...] = tuple(_ARCH_TO_FAMILY)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Attention-relevant facts of a DSA model, read from its HF ``config.json``."""

    architecture: str
    family: str
    num_heads: int
    d_qk: int
    d_v: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int = 0
    hidden_size: int = 0
    hc_mult: int = 0

    def heads_per_rank(self, tp: int) -> int:
        """Attention heads one GPU holds under tensor parallelism ``tp``."""
        if tp < 1 or self.num_heads % tp:
            raise ValueError(f"--tp {tp}: must be a positive divisor of num_attention_heads={self.num_heads}")
        return self.num_heads // tp


def model_family(hf_config: Mapping[str, Any]) -> str | None:
    """Model family of an HF ``config.json`` dict: ``"deepseek_v32"``, ``"glm_dsa"``,
    ``"deepseek_v4"``, or ``None`` for a model without DeepSeek sparse attention.

    ``DeepseekV3ForCausalLM`` counts as DeepSeek-V3.2 only when the config has ``index_topk``
    (V3.2-Exp checkpoints kept the V3 architecture name).
    """
    archs = hf_config.get("architectures") or []
    arch = archs[0] if archs else None
    family = _ARCH_TO_FAMILY.get(arch) if arch else None
    if arch == "DeepseekV3ForCausalLM" and "index_topk" not in hf_config:
        return None
    if family is None and "index_topk" in hf_config:
        model_type = str(hf_config.get("model_type", ""))
        if model_type.startswith("glm"):
            return GLM_DSA
        if model_type == "deepseek_v4":
            return DEEPSEEK_V4
        return DEEPSEEK_V32
    return family


def model_info(hf_config: Mapping[str, Any]) -> ModelInfo:
    """Read the attention shape of a DSA model; ``ValueError`` for other models."""
    family = model_family(hf_config)
    archs = hf_config.get("architectures") or ["?"]
    if family is None:
        raise ValueError(f"model {archs[0]!r} is not a DeepSeek sparse attention model (no index_topk, "
                         f"architecture not one of {list(MODEL_ARCHS)})")

    def need(key: str) -> int:
        if key not in hf_config:
            raise ValueError(f"model config ({archs[0]}): missing key {key!r}")
        return int(hf_config[key])

    rope = int(hf_config.get("qk_rope_head_dim", 64))
    if family == DEEPSEEK_V4:
        d_qk = int(hf_config.get("head_dim", need("qk_nope_head_dim") + rope))
        d_v = d_qk
    else:
        d_qk = need("kv_lora_rank") + rope
        d_v = need("kv_lora_rank")
    return ModelInfo(
        architecture=archs[0],
        family=family,
        num_heads=need("num_attention_heads"),
        d_qk=d_qk,
        d_v=d_v,
        index_n_heads=need("index_n_heads"),
        index_head_dim=need("index_head_dim"),
        index_topk=need("index_topk"),
        num_nextn_predict_layers=int(hf_config.get("num_nextn_predict_layers", 0) or 0),
        hidden_size=int(hf_config.get("hidden_size", 0) or 0),
        hc_mult=int(hf_config.get("hc_mult", 0) or 0),
    )
