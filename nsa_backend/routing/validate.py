"""Startup validation of the sparse-attention prefill / decode implementation choice.

:func:`validate_impl_choice` answers, before a server loads weights, whether a
``(model architecture, device arch, KV-cache dtype, prefill impl, decode impl)`` combination can
run, and raises :class:`ImplChoiceError` naming all five, why, and the valid choices otherwise.

Names: SGLang's ``--dsa-prefill-backend`` / ``--dsa-decode-backend`` values (``flashmla_sparse``,
``flashmla_sparse_q8``, ``flashmla_kv``, ``flashmla_auto``, ``flashinfer_sparse_mla``,
``triton_sparse_mla``, ``fa3``, ``tilelang``, ``aiter``, ``trtllm``) plus this package's
``triton``, ``reference`` and ``auto``. SGLang's own ``triton`` (a ROCm-only DSA backend) shares
the name of this package's Triton kernels, which run on every GPU; ``triton`` here means ours.

The matrix is :data:`RULES` (data). It is wider than SGLang 0.5.23's own checks because this
package adds a Triton path on every GPU and FlashInfer's SM120 kernels for DeepSeek-V3.2 as well
as GLM (SGLang accepts ``flashinfer_sparse_mla`` only for GLM with an FP8 KV cache on SM120/121).
Facts per kernel library: FlashMLA builds sm_90a and sm_100f only (no SM120 code); FlashInfer's
sparse MLA runs on SM120/SM121 (packed FP8 cache; decode-sized batches through its decode kernels,
larger ones through its prefill path since 0.7) and on SM100/SM103 as a decode kernel through
trtllm-gen; TRT-LLM-gen kernels exist for SM100/SM103 only; FA3 reads a bf16 cache and has no
Blackwell build; TileLang's DSA kernels overrun the SM120/SM121 shared-memory budget; aiter is
ROCm only.
"""

from __future__ import annotations

import dataclasses

from nsa_backend.routing.device import (
    _ARCH_TO_FAMILY,
    ARCH_FAMILIES,
    DEEPSEEK_V4,
    DEEPSEEK_V32,
    GLM_DSA,
    GPU_ARCHS,
    MODEL_ARCHS,
)

PHASES: tuple[str, ...] = ("prefill", "decode")
KV_CACHE_DTYPES: tuple[str, ...] = ("bfloat16", "fp8_e4m3")
_KV_ALIASES: dict[str, str] = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8": "fp8_e4m3",
                               "fp8_e4m3": "fp8_e4m3", "fp8_ds_mla": "fp8_e4m3"}
SGLANG_NAMES: tuple[str, ...] = ("flashmla_sparse", "flashmla_sparse_q8", "flashmla_kv", "flashmla_auto",
                                 "flashinfer_sparse_mla", "triton_sparse_mla", "fa3", "tilelang", "aiter", "trtllm")
OUR_NAMES: tuple[str, ...] = ("auto", "triton", "reference")
IMPL_CHOICES: tuple[str, ...] = (*OUR_NAMES, *SGLANG_NAMES)

# Which nsa-backend implementation serves a choice for the prefill / decode ops (None: a kernel of
# the serving framework, outside this package).
CHOICE_TO_IMPL: dict[str, str | None] = {
    "auto": "auto", "triton": "triton", "reference": "reference",
    "flashmla_sparse": "flash_mla", "flashmla_sparse_q8": None, "flashmla_kv": "flash_mla",
    "flashmla_auto": "flash_mla", "flashinfer_sparse_mla": "flashinfer", "fa3": None, "tilelang": None,
    "aiter": None, "trtllm": None, "triton_sparse_mla": None,
}

DSA = frozenset({DEEPSEEK_V32, GLM_DSA})
ALL_MODELS = frozenset({DEEPSEEK_V32, GLM_DSA, DEEPSEEK_V4})
V4 = frozenset({DEEPSEEK_V4})
BOTH = frozenset(PHASES)
ANY_KV = frozenset(KV_CACHE_DTYPES)
BF16 = frozenset({"bfloat16"})
FP8 = frozenset({"fp8_e4m3"})
ALL_ARCHS = frozenset(ARCH_FAMILIES)
FLASHMLA_ARCHS = frozenset({"sm90", "sm100", "sm103"})
SM100_ARCHS = frozenset({"sm100", "sm103"})
SM120_ARCHS = frozenset({"sm120", "sm121"})
PRE_BLACKWELL = frozenset({"sm80", "sm86", "sm89", "sm90"})


@dataclasses.dataclass(frozen=True)
class Rule:
    """One accepted region of the matrix: ``name`` runs ``phases`` of ``models`` on ``archs`` with
    ``kv`` cache dtypes."""

    name: str
    phases: frozenset[str]
    models: frozenset[str]
    archs: frozenset[str]
    kv: frozenset[str]
    note: str = ""


# What each choice is, used in rejection messages.
KERNEL_FACTS: dict[str, str] = {
    "auto": "nsa-backend picks per op",
    "reference": "plain PyTorch, runs anywhere (slow)",
    "triton": "nsa-backend's Triton kernels run on every NVIDIA and AMD GPU but not on the CPU",
    "flashmla_sparse": "FlashMLA has kernels for sm90 and sm100/sm103 only (none for SM120/SM121 or "
                       "older GPUs); its sparse kernel reads bf16 KV, so decoding needs a bfloat16 cache",
    "flashmla_sparse_q8": "the FlashMLA Q8KV8 path is an SM90-only prefill kernel",
    "flashmla_kv": "FlashMLA's FP8 sparse decode kernel reads the packed fp8_e4m3 (fp8_ds_mla) cache, "
                   "on sm90 and sm100/sm103 only (no SM120/SM121 kernels)",
    "flashmla_auto": "flashmla_auto picks between FlashMLA prefill kernels (sm90, sm100/sm103) and has no "
                     "decode path",
    "flashinfer_sparse_mla": "FlashInfer's sparse MLA kernels exist for SM120/SM121 with an FP8 KV cache "
                             "(prefill and decode) and for SM100/SM103 as a trtllm-gen decode kernel",
    "fa3": "FA3 reads a bfloat16 cache and has no Blackwell build",
    "tilelang": "TileLang's DSA kernels need CUDA sm80-sm103 or ROCm (they overrun SM120/SM121 shared "
                "memory) and an FP8 cache only on sm89+ with both phases on tilelang",
    "triton_sparse_mla": "SGLang's Triton sparse MLA kernel is a prefill kernel for CUDA sm90 and newer",
    "aiter": "aiter is AMD ROCm only",
    "trtllm": "TRT-LLM-gen kernels exist for SM100/SM103 only",
}

RULES: tuple[Rule, ...] = (
    Rule("auto", BOTH, ALL_MODELS, ALL_ARCHS, ANY_KV),
    Rule("reference", BOTH, ALL_MODELS, ALL_ARCHS, ANY_KV),
    Rule("triton", BOTH, ALL_MODELS, GPU_ARCHS, ANY_KV),
    # DeepSeek-V3.2 / GLM-5 (DSA backend)
    Rule("flashmla_sparse", frozenset({"prefill"}), DSA, FLASHMLA_ARCHS, ANY_KV,
         "FP8 caches are dequantised to bf16 for the prefill kernel"),
    Rule("flashmla_sparse", frozenset({"decode"}), DSA, FLASHMLA_ARCHS, BF16),
    Rule("flashmla_sparse_q8", frozenset({"prefill"}), DSA, frozenset({"sm90"}), ANY_KV),
    Rule("flashmla_kv", BOTH, DSA, FLASHMLA_ARCHS, FP8),
    Rule("flashmla_auto", frozenset({"prefill"}), DSA, FLASHMLA_ARCHS, ANY_KV),
    Rule("flashinfer_sparse_mla", BOTH, DSA, SM120_ARCHS, FP8),
    Rule("flashinfer_sparse_mla", frozenset({"decode"}), DSA, SM100_ARCHS, ANY_KV, "trtllm-gen sparse MLA"),
    Rule("triton_sparse_mla", frozenset({"prefill"}), DSA,
         frozenset({"sm90", "sm100", "sm103", "sm120", "sm121"}), ANY_KV, "at most 32 heads per GPU"),
    Rule("fa3", BOTH, DSA, PRE_BLACKWELL, BF16),
    Rule("tilelang", BOTH, DSA, frozenset({"sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "rocm"}), BF16),
    Rule("tilelang", BOTH, DSA, frozenset({"sm89", "sm90", "sm100", "sm103", "rocm"}), FP8,
         "FP8 needs tilelang for both phases on CUDA"),
    Rule("aiter", BOTH, DSA, frozenset({"rocm"}), ANY_KV),
    Rule("trtllm", BOTH, DSA, SM100_ARCHS, ANY_KV),
    # DeepSeek-V4 (SGLang's dsv4 backend)
    Rule("flashmla_sparse", BOTH, V4, FLASHMLA_ARCHS, ANY_KV),
    Rule("flashmla_sparse_q8", frozenset({"prefill"}), V4, frozenset({"sm90"}), ANY_KV),
    Rule("trtllm", BOTH, V4, SM100_ARCHS, FP8, "opt-in uniform FP8 layout"),
    Rule("flashinfer_sparse_mla", BOTH, V4, SM120_ARCHS, FP8),
    Rule("flashinfer_sparse_mla", frozenset({"decode"}), V4, SM100_ARCHS, FP8),
)


# Most attention heads one GPU may hold for a choice (after tensor parallelism). SGLang's Triton
# sparse MLA prefill kernel is written for up to 32 heads; FlashMLA pads to 64 or 128 heads and
# FlashInfer's sparse MLA takes head buckets up to 128, so neither runs more than 128. Choices not
# listed have no limit of their own (nsa-backend's kernels check their own bound per call).
MAX_HEADS_PER_GPU: dict[str, int] = {
    "triton_sparse_mla": 32,
    "flashmla_sparse": 128,
    "flashmla_sparse_q8": 128,
    "flashmla_kv": 128,
    "flashmla_auto": 128,
    "flashinfer_sparse_mla": 128,
}


class ImplChoiceError(ValueError):
    """An implementation choice that cannot run for this model, device arch and KV-cache dtype."""


_MODEL_NAMES = {DEEPSEEK_V32: "DeepSeek-V3.2", GLM_DSA: "GLM DSA", DEEPSEEK_V4: "DeepSeek-V4"}


def _model(model_arch: str) -> str:
    family = _ARCH_TO_FAMILY.get(model_arch)
    if family is None:
        raise ImplChoiceError(f"model architecture {model_arch!r} has no DeepSeek sparse attention; "
                              f"accepted architectures: {list(MODEL_ARCHS)}")
    return family


def normalize_kv_dtype(kv_cache_dtype: str, device_arch: str) -> str:
    """``bfloat16`` or ``fp8_e4m3``; ``auto`` resolves as SGLang does (FP8 on Blackwell, else bf16)."""
    if kv_cache_dtype == "auto":
        return "fp8_e4m3" if device_arch in SM100_ARCHS | SM120_ARCHS else "bfloat16"
    kv = _KV_ALIASES.get(kv_cache_dtype)
    if kv is None:
        raise ImplChoiceError(f"kv_cache_dtype {kv_cache_dtype!r}: accepted values: "
                              f"{['auto', *sorted(_KV_ALIASES)]}")
    return kv


def _check_arch(device_arch: str) -> None:
    if device_arch not in ARCH_FAMILIES:
        raise ImplChoiceError(f"device arch {device_arch!r}: accepted values: {list(ARCH_FAMILIES)}")


def _accepts(name: str, phase: str, family: str, arch: str, kv: str) -> bool:
    return any(r.name == name and phase in r.phases and family in r.models and arch in r.archs and kv in r.kv
               for r in RULES)


def _why_not(name: str, phase: str, family: str, arch: str, kv: str) -> str:
    rules = [r for r in RULES if r.name == name]
    fact = KERNEL_FACTS[name]
    if not any(family in r.models for r in rules):
        if family == DEEPSEEK_V4:
            return f"DeepSeek-V4 attention has no {name} path ({fact})"
        return f"{_MODEL_NAMES[family]} has no {name} path ({fact})"
    rules = [r for r in rules if family in r.models]
    if not any(phase in r.phases for r in rules):
        other = sorted({p for r in rules for p in r.phases})
        return f"{name} is {'/'.join(other)}-only ({fact})"
    rules = [r for r in rules if phase in r.phases]
    if not any(arch in r.archs for r in rules):
        archs = sorted({a for r in rules for a in r.archs})
        where = "on the CPU" if arch == "cpu" else f"on {arch}"
        return f"{name} has no {phase} kernel {where}; it runs on {', '.join(archs)} ({fact})"
    rules = [r for r in rules if arch in r.archs]
    kvs = sorted({k for r in rules for k in r.kv})
    return f"{name} {phase} on {arch} needs a {' or '.join(kvs)} KV cache ({fact})"


def valid_impl_choices(model_arch: str, device_arch: str, kv_cache_dtype: str, phase: str) -> list[str]:
    """Implementation names accepted for ``phase`` (``"prefill"`` or ``"decode"``)."""
    if phase not in PHASES:
        raise ImplChoiceError(f"phase {phase!r}: accepted values: {list(PHASES)}")
    family = _model(model_arch)
    _check_arch(device_arch)
    kv = normalize_kv_dtype(kv_cache_dtype, device_arch)
    return [name for name in IMPL_CHOICES if _accepts(name, phase, family, device_arch, kv)]


def _within_heads(choices: list[str], heads_per_gpu: int) -> list[str]:
    return [c for c in choices if heads_per_gpu <= MAX_HEADS_PER_GPU.get(c, heads_per_gpu)]


def validate_impl_choice(model_arch: str, device_arch: str, kv_cache_dtype: str, prefill_impl: str,
                         decode_impl: str, *, heads_per_gpu: int | None = None) -> None:
    """Raise :class:`ImplChoiceError` unless the prefill and decode choices can run together.

    The message names the model architecture, the device arch, the KV-cache dtype, the rejected
    choice, why, and the valid choices for that phase. With ``heads_per_gpu`` (attention heads per
    GPU after tensor parallelism) a choice's head limit (:data:`MAX_HEADS_PER_GPU`) is checked too.
    """
    family = _model(model_arch)
    _check_arch(device_arch)
    kv = normalize_kv_dtype(kv_cache_dtype, device_arch)
    context = f"{model_arch} ({_MODEL_NAMES[family]}) on {device_arch} with kv_cache_dtype={kv}"
    for phase, name in (("prefill", prefill_impl), ("decode", decode_impl)):
        if name not in IMPL_CHOICES:
            raise ImplChoiceError(f"{context}: unknown {phase} implementation {name!r}; valid {phase} choices: "
                                  f"{valid_impl_choices(model_arch, device_arch, kv, phase)}")
        if not _accepts(name, phase, family, device_arch, kv):
            raise ImplChoiceError(f"{context}: {phase} implementation {name!r} rejected: "
                                  f"{_why_not(name, phase, family, device_arch, kv)}. Valid {phase} choices: "
                                  f"{valid_impl_choices(model_arch, device_arch, kv, phase)}")
    if heads_per_gpu is not None:
        for phase, name in (("prefill", prefill_impl), ("decode", decode_impl)):
            limit = MAX_HEADS_PER_GPU.get(name)
            if limit is not None and heads_per_gpu > limit:
                valid = _within_heads(valid_impl_choices(model_arch, device_arch, kv, phase), heads_per_gpu)
                raise ImplChoiceError(f"{context}: {phase} implementation {name!r} rejected: it runs at most {limit} "
                                      f"attention heads per GPU, this model has {heads_per_gpu} per GPU (raise the "
                                      f"tensor-parallel degree). Valid {phase} choices: {valid}")
    # Cross-phase rule: TileLang reads raw FP8 rows without the per-block scales other kernels
    # write, so on CUDA an FP8 cache with tilelang in one phase needs it in both.
    if kv == "fp8_e4m3" and device_arch != "rocm" and "tilelang" in (prefill_impl, decode_impl) \
            and prefill_impl != decode_impl:
        other_phase = "decode" if prefill_impl == "tilelang" else "prefill"
        other = decode_impl if prefill_impl == "tilelang" else prefill_impl
        raise ImplChoiceError(f"{context}: {other_phase} implementation {other!r} rejected: TileLang keeps raw "
                              f"FP8 KV rows that {other} cannot read, so both phases must be tilelang. "
                              f"Valid {other_phase} choices: ['tilelang']")
