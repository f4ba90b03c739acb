"""The prefill/decode implementation-choice matrix: every combination, and the messages."""

from __future__ import annotations

import itertools

import pytest

from nsa_backend.routing import ImplChoiceError, valid_impl_choices, validate_impl_choice
from nsa_backend.routing.device import ARCH_FAMILIES
from nsa_backend.routing.validate import IMPL_CHOICES

MODELS = {"DeepseekV32ForCausalLM": "v32", "GlmMoeDsaForCausalLM": "glm", "DeepseekV4ForCausalLM": "v4"}
KVS = ("bfloat16", "fp8_e4m3")
FLASHMLA = {"sm90", "sm100", "sm103"}
SM100 = {"sm100", "sm103"}
SM120 = {"sm120", "sm121"}


def expected(name: str, phase: str, model: str, arch: str, kv: str) -> bool:
    """The matrix restated as plain conditions (independent of the RULES data it checks)."""
    gpu = arch != "cpu"
    fp8 = kv == "fp8_e4m3"
    if name in ("auto", "reference"):
        return True
    if name == "triton":
        return gpu
    if model == "v4":
        if name == "flashmla_sparse":
            return arch in FLASHMLA
        if name == "flashmla_sparse_q8":
            return phase == "prefill" and arch == "sm90"
        if name == "trtllm":
            return arch in SM100 and fp8
        if name == "flashinfer_sparse_mla":
            return fp8 and (arch in SM120 or (arch in SM100 and phase == "decode"))
        return False
    if name == "flashmla_sparse":
        return arch in FLASHMLA and (phase == "prefill" or not fp8)
    if name == "flashmla_sparse_q8":
        return phase == "prefill" and arch == "sm90"
    if name == "flashmla_kv":
        return arch in FLASHMLA and fp8
    if name == "flashmla_auto":
        return phase == "prefill" and arch in FLASHMLA
    if name == "flashinfer_sparse_mla":
        return (arch in SM120 and fp8) or (arch in SM100 and phase == "decode")
    if name == "triton_sparse_mla":
        return phase == "prefill" and arch in FLASHMLA | SM120
    if name == "fa3":
        return arch in {"sm80", "sm86", "sm89", "sm90"} and not fp8
    if name == "tilelang":
        if fp8:
            return arch in {"sm89", "sm90", "sm100", "sm103", "rocm"}
        return arch in {"sm80", "sm86", "sm89", "sm90", "sm100", "sm103", "rocm"}
    if name == "aiter":
        return arch == "rocm"
    if name == "trtllm":
        return arch in SM100
    raise AssertionError(name)


def _other(phase: str, name: str, kv: str, arch: str) -> str:
    # TileLang with FP8 on CUDA must be used for both phases.
    return name if (name == "tilelang" and kv == "fp8_e4m3" and arch != "rocm") else "auto"


@pytest.mark.parametrize(("model_arch", "device_arch"), list(itertools.product(MODELS, ARCH_FAMILIES)))
def test_matrix(model_arch, device_arch):
    model = MODELS[model_arch]
    for kv, phase, name in itertools.product(KVS, ("prefill", "decode"), IMPL_CHOICES):
        ok = expected(name, phase, model, device_arch, kv)
        other = _other(phase, name, kv, device_arch) if ok else "auto"
        prefill, decode = (name, other) if phase == "prefill" else (other, name)
        case = (model_arch, device_arch, kv, phase, name)
        assert (name in valid_impl_choices(model_arch, device_arch, kv, phase)) == ok, case
        if ok:
            validate_impl_choice(model_arch, device_arch, kv, prefill, decode)
            continue
        with pytest.raises(ImplChoiceError) as info:
            validate_impl_choice(model_arch, device_arch, kv, prefill, decode)
        msg = str(info.value)
        for part in (model_arch, f"on {device_arch}", f"kv_cache_dtype={kv}", f"{phase} implementation {name!r}",
                     "rejected:", f"Valid {phase} choices: "):
            assert part in msg, (case, part, msg)
        assert str(valid_impl_choices(model_arch, device_arch, kv, phase)) in msg, (case, msg)


def test_glm_fp8_sm120_is_wider_than_sglang():
    for arch in ("sm120", "sm121"):
        assert valid_impl_choices("GlmMoeDsaForCausalLM", arch, "fp8_e4m3", "decode") == [
            "auto", "triton", "reference", "flashinfer_sparse_mla"]
        validate_impl_choice("GlmMoeDsaForCausalLM", arch, "fp8_e4m3", "triton", "flashinfer_sparse_mla")
    # SGLang accepts flashinfer_sparse_mla for GLM only; DeepSeek-V3.2 shares the same kernel family.
    validate_impl_choice("DeepseekV32ForCausalLM", "sm120", "fp8_e4m3", "flashinfer_sparse_mla",
                         "flashinfer_sparse_mla")


@pytest.mark.parametrize("name", ["flashmla_sparse", "flashmla_kv", "flashmla_auto", "flashmla_sparse_q8"])
def test_flashmla_rejected_on_sm120(name):
    with pytest.raises(ImplChoiceError, match=r"no prefill kernel on sm120.*sm90") as info:
        validate_impl_choice("GlmMoeDsaForCausalLM", "sm120", "fp8_e4m3", name, "triton")
    assert "GlmMoeDsaForCausalLM (GLM DSA) on sm120 with kv_cache_dtype=fp8_e4m3" in str(info.value)


GLM, V32, V4 = "GlmMoeDsaForCausalLM", "DeepseekV32ForCausalLM", "DeepseekV4ForCausalLM"

# (model, device arch, kv_cache_dtype, prefill, decode, message pattern) of rejected choices.
REJECTIONS = [
    pytest.param(GLM, "sm90", "fp8_e4m3", "auto", "flashinfer_sparse_mla",
                 r"flashinfer_sparse_mla has no decode kernel on sm90; it runs on sm100, sm103, sm120, sm121",
                 id="flashinfer-says-where-it-runs"),
    pytest.param(GLM, "sm100", "fp8_e4m3", "flashinfer_sparse_mla", "auto",
                 r"flashinfer_sparse_mla has no prefill kernel on sm100", id="flashinfer-no-prefill-sm100"),
    pytest.param(GLM, "sm120", "bfloat16", "auto", "flashinfer_sparse_mla",
                 r"on sm120 needs a fp8_e4m3 KV cache", id="flashinfer-sm120-needs-fp8"),
    pytest.param(V32, "sm90", "bfloat16", "auto", "flashmla_sparse_q8",
                 r"flashmla_sparse_q8 is prefill-only", id="q8-prefill-only"),
    pytest.param(V4, "sm90", "bfloat16", "fa3", "auto",
                 r"DeepSeek-V4 attention has no fa3 path", id="v4-no-fa3"),
    pytest.param(V32, "sm90", "bfloat16", "auto", "aiter",
                 r"aiter has no decode kernel on sm90; it runs on rocm", id="aiter-rocm-only"),
    pytest.param(V32, "cpu", "bfloat16", "triton", "reference",
                 r"triton has no prefill kernel on the CPU", id="triton-not-on-cpu"),
    pytest.param("LlamaForCausalLM", "sm90", "bfloat16", "auto", "auto",
                 r"'LlamaForCausalLM' has no DeepSeek sparse attention; accepted", id="bad-model"),
    pytest.param(GLM, "sm70", "bfloat16", "auto", "auto",
                 r"device arch 'sm70': accepted values", id="bad-arch"),
    pytest.param(GLM, "sm90", "bfloat16", "auto", "flashmla",
                 r"unknown decode implementation 'flashmla'; valid decode choices", id="unknown-impl"),
]


@pytest.mark.parametrize(("model", "arch", "kv", "prefill", "decode", "match"), REJECTIONS)
def test_rejection_messages(model, arch, kv, prefill, decode, match):
    with pytest.raises(ImplChoiceError, match=match):
        validate_impl_choice(model, arch, kv, prefill, decode)


def test_tilelang_fp8_needs_both_phases():
    validate_impl_choice("GlmMoeDsaForCausalLM", "sm90", "fp8_e4m3", "tilelang", "tilelang")
    with pytest.raises(ImplChoiceError, match=r"decode implementation 'flashmla_kv' rejected: TileLang"):
        validate_impl_choice("GlmMoeDsaForCausalLM", "sm90", "fp8_e4m3", "tilelang", "flashmla_kv")
    validate_impl_choice("GlmMoeDsaForCausalLM", "rocm", "fp8_e4m3", "tilelang", "aiter")


def test_kv_dtype_aliases_and_auto():
    validate_impl_choice("GlmMoeDsaForCausalLM", "sm120", "fp8", "auto", "flashinfer_sparse_mla")
    validate_impl_choice("GlmMoeDsaForCausalLM", "sm120", "auto", "auto", "flashinfer_sparse_mla")  # FP8 there
    with pytest.raises(ImplChoiceError, match="kv_cache_dtype=bfloat16"):
        validate_impl_choice("GlmMoeDsaForCausalLM", "sm90", "auto", "auto", "flashinfer_sparse_mla")
    with pytest.raises(ImplChoiceError, match=r"kv_cache_dtype 'int8': accepted values"):
        validate_impl_choice("GlmMoeDsaForCausalLM", "sm90", "int8", "auto", "auto")


def test_bad_phase():
    with pytest.raises(ImplChoiceError, match=r"phase 'extend'"):
        valid_impl_choices("GlmMoeDsaForCausalLM", "sm90", "bfloat16", "extend")
    assert issubclass(ImplChoiceError, ValueError)


# ----------------------------------------------------------------------------------------------
# Against SGLang's own checks (runs where sglang is installed, e.g. scripts/sglang-env.sh)
# ----------------------------------------------------------------------------------------------

SGL_ARCH_MAJOR = {"sm90": 9, "sm100": 10, "sm103": 10, "sm120": 12, "sm121": 12}
# Where this matrix is deliberately wider than SGLang 0.5.23's flashinfer_sparse_mla rule.
WIDER = {
    ("DeepseekV32ForCausalLM", "sm120", "fp8_e4m3"), ("DeepseekV32ForCausalLM", "sm121", "fp8_e4m3"),
}


def test_flashinfer_rule_matches_sglang_except_documented_widening():
    sm120 = pytest.importorskip("sglang.kernels.ops.attention.flash_mla_sm120")
    torch = pytest.importorskip("torch")
    sgl_dtype = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}
    for model, arch, kv in itertools.product(("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"), SGL_ARCH_MAJOR, KVS):
        try:
            sm120._validate_flashinfer_sparse_mla_backend(
                model_arch=model, device_sm_major=SGL_ARCH_MAJOR[arch], kv_cache_dtype=sgl_dtype[kv],
                prefill_impl="flashinfer_sparse_mla", decode_impl="flashinfer_sparse_mla")
            sglang_ok = True
        except ValueError:
            sglang_ok = False
        for phase in ("prefill", "decode"):
            ours = "flashinfer_sparse_mla" in valid_impl_choices(model, arch, kv, phase)
            if sglang_ok:
                assert ours, (model, arch, kv, phase)
            elif ours:
                assert (model, arch, kv) in WIDER or (arch in SM100 and phase == "decode"), (model, arch, kv, phase)
        # SGLang lets GLM on SM120/SM121 with FP8 pair flashinfer_sparse_mla with triton_sparse_mla prefill.
        if model == "GlmMoeDsaForCausalLM" and arch in SM120 and kv == "fp8_e4m3":
            sm120._validate_flashinfer_sparse_mla_backend(
                model_arch=model, device_sm_major=12, kv_cache_dtype=sgl_dtype[kv],
                prefill_impl="triton_sparse_mla", decode_impl="flashinfer_sparse_mla")
            validate_impl_choice(model, arch, kv, "triton_sparse_mla", "flashinfer_sparse_mla")


def test_tilelang_fp8_rule_matches_sglang():
    overrides = pytest.importorskip("sglang.srt.arg_groups.overrides")
    for prefill, decode in itertools.product(("tilelang", "flashmla_kv"), repeat=2):
        try:
            overrides._check_dsa_backend_constraints("fp8_e4m3", prefill, decode, hip=True)
            overrides._check_dsa_backend_constraints("bfloat16", prefill, decode, hip=False)
            if "tilelang" in (prefill, decode) and prefill != decode:
                overrides._check_dsa_backend_constraints("fp8_e4m3", prefill, decode, hip=False)
            sglang_ok = True
        except ValueError:
            sglang_ok = False
        try:
            validate_impl_choice("GlmMoeDsaForCausalLM", "sm90", "fp8_e4m3", prefill, decode)
            ours = True
        except ImplChoiceError:
            ours = False
        if prefill != decode and "tilelang" in (prefill, decode):
            assert not sglang_ok and not ours
