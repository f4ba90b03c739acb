"""Server start with nsa-backend's SGLang plugin: SGLang's resolved arguments, and each refused path.

Arguments are parsed (``sglang_layer_support.launch_server``, shared with the layer tests) by SGLang's
``prepare_server_args``, resolved by SGLang's own
``ServerArgs.resolve_once()`` (its whole resolution pipeline, with the plugin's wrapper of the
``handle_model_specific_adjustments`` step) with the GPU capability that pipeline reads set per case,
and checked by ``ServerArgs.check_server_args`` as the plugin wraps it (SGLang's checks, then
nsa-backend's): the order of a real launch (``launch_server`` / ``Engine``). The KV-cache row SGLang
will allocate is read with SGLang's own pool-sizing function (``calculate_mla_kv_cache_dim``) under a
runtime context built from the resolved arguments, as a scheduler sees them.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang")

import torch
from sglang.kernels.ops.attention.flash_mla_sm120 import _validate_flashinfer_sparse_mla_backend
from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view
from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
from sglang.srt.runtime_context import create_context, use_context

from nsa_backend.routing import reset_config
from nsa_backend_integrations.sglang import plugin
from tests.integrations.sglang_layer_support import launch_server

FP8_DS_MLA_ROW = 656  # scaled FP8 MLA row nsa-backend's ops read: 512 e4m3 + 4 fp32 scales + 64 bf16 rope
MLA_ROW = 576  # kv_lora_rank + rope: bf16 rows, or TRT-LLM's raw FP8 rows (no scales)

V32_CONFIG = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "torch_dtype": "bfloat16",
}
GLM5_CONFIG = {
    **V32_CONFIG,
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "index_n_heads": 32,
    "v_head_dim": 256,
    "qk_nope_head_dim": 192,
}


@pytest.fixture
def model_dir(tmp_path_factory):
    def make(config: dict) -> str:
        path = tmp_path_factory.mktemp("model")
        (path / "config.json").write_text(json.dumps(config))
        return str(path)

    return make


@pytest.fixture
def server(monkeypatch):
    """``start(config_dir, major, *flags, takeover=False, backend=..., full=True)``: parse, resolve on
    SM``major``x, check (:func:`sglang_layer_support.launch_server`)."""
    plugin.register()
    monkeypatch.delenv("NSA_BACKEND_CONFIG", raising=False)
    monkeypatch.delenv("NSA_BACKEND_PREFILL", raising=False)
    monkeypatch.delenv("NSA_BACKEND_DECODE", raising=False)

    def start(
        config_dir: str,
        major: int,
        *flags: str,
        takeover: bool = False,
        backend: str = "nsa_backend",
        full: bool = True,
    ):
        monkeypatch.setattr(plugin, "_served", ("nsa_backend", "dsa", "nsa") if takeover else ("nsa_backend",))
        return launch_server(monkeypatch, config_dir, major, *flags, backend=backend, full=full)

    yield start
    reset_config()


# -- SGLang's resolved DSA kernels -------------------------------------------------------------


def resolved_phases(args) -> tuple[str | None, str | None]:
    view = resolved_view(args)
    return view.dsa_prefill_backend, view.dsa_decode_backend


def pool_row(args) -> tuple[int, torch.dtype]:
    """``(elements per token, dtype)`` of the MLA cache SGLang allocates for the resolved ``args``."""
    dtype = torch.float8_e4m3fn if resolved_view(args).kv_cache_dtype == "fp8_e4m3" else torch.bfloat16
    with use_context(create_context(args, role="scheduler")):
        return calculate_mla_kv_cache_dim(model_config=model_config_of(args), kv_cache_dtype=dtype), dtype


# SGLang's own resolution (sglang 0.5.23) per (model, cache, SM major) when the user gives no
# --dsa-*-backend, and what nsa-backend resolves instead where SGLang's pick is TRT-LLM's raw FP8 rows.
SCALED = ("flashmla_sparse", "flashmla_kv")
DEFAULT_LAUNCHES = [
    # model, --kv-cache-dtype, major, resolved (prefill, decode)
    ("v32", "fp8_e4m3", 9, ("flashmla_kv", "flashmla_kv")),
    ("v32", "fp8_e4m3", 10, SCALED),  # SGLang: trtllm / trtllm
    ("v32", "fp8_e4m3", 12, SCALED),  # SGLang: trtllm / trtllm
    ("v32", "bfloat16", 9, ("flashmla_sparse", "fa3")),
    ("v32", "bfloat16", 10, ("flashmla_sparse", "trtllm")),  # bf16 rows either way
    ("v32", "bfloat16", 12, ("flashmla_sparse", "trtllm")),
    ("glm5", "fp8_e4m3", 9, ("flashmla_kv", "flashmla_kv")),
    ("glm5", "fp8_e4m3", 10, SCALED),  # SGLang: trtllm / trtllm
    ("glm5", "fp8_e4m3", 12, ("flashinfer_sparse_mla", "flashinfer_sparse_mla")),
    ("glm5", "bfloat16", 9, ("flashmla_sparse", "fa3")),
    ("glm5", "bfloat16", 10, ("flashmla_sparse", "trtllm")),
    ("glm5", "bfloat16", 12, ("flashmla_sparse", "trtllm")),
]


@pytest.mark.parametrize("takeover", [False, True], ids=["by-name", "takeover-dsa"])
@pytest.mark.parametrize(
    ("model", "kv", "major", "expected"),
    DEFAULT_LAUNCHES,
    ids=[f"{m}-{kv}-sm{major}0" for m, kv, major, _ in DEFAULT_LAUNCHES],
)
def test_default_launch_resolves_a_layout_nsa_backend_reads(server, model_dir, model, kv, major, expected, takeover):
    """No --dsa-*-backend flag: the launch is accepted, SGLang's resolved phase kernels are the expected
    ones (no ``trtllm`` with an FP8 cache), and the pool SGLang sizes is the scaled fp8_ds_mla row
    (FP8) or the bf16 MLA row: the layouts nsa-backend's ops read, run by nsa-backend for both phases."""
    config = V32_CONFIG if model == "v32" else GLM5_CONFIG
    backend = "dsa" if takeover else "nsa_backend"
    args = server(model_dir(config), major, "--kv-cache-dtype", kv, takeover=takeover, backend=backend)
    assert resolved_phases(args) == expected
    assert (args.dsa_prefill_backend, args.dsa_decode_backend) == (None, None)  # the user's raw flags
    assert plugin.validate_server_args(args) == ("auto", "auto")  # nsa-backend's ops, both phases
    if kv == "fp8_e4m3":
        assert pool_row(args) == (FP8_DS_MLA_ROW, torch.float8_e4m3fn)
        # SGLang's fused-RoPE path of the model code (``_fuse_rope_for_trtllm_mla``) keys on trtllm.
        assert "trtllm" not in expected
    else:
        assert pool_row(args) == (MLA_ROW, torch.bfloat16)
    # The base DSA backend nsa-backend's backend builds on validates the resolved pair when a worker
    # builds it (GLM FP8 on SM12x accepts only SGLang's FlashInfer / Triton names).
    _validate_flashinfer_sparse_mla_backend(
        model_arch=config["architectures"][0],
        device_sm_major=major,
        kv_cache_dtype=torch.float8_e4m3fn if kv == "fp8_e4m3" else torch.bfloat16,
        prefill_impl=expected[0],
        decode_impl=expected[1],
    )


def test_plain_launch_on_sm120(server, model_dir):
    """``--attention-backend nsa_backend`` and nothing else: SGLang's FP8 default cache on SM120."""
    args = server(model_dir(V32_CONFIG), 12)
    assert resolved_view(args).kv_cache_dtype == "fp8_e4m3"
    assert resolved_phases(args) == SCALED
    assert pool_row(args) == (FP8_DS_MLA_ROW, torch.float8_e4m3fn)
    sources = [source for source, fields in args._resolved_overrides if "dsa_decode_backend" in fields]
    assert sources[-1] == "nsa_backend_scaled_fp8_layout"  # declared by the plugin, after SGLang's pick


def test_sglang_own_dsa_backend_keeps_trtllm(server, model_dir):
    """Without takeover, ``dsa`` is SGLang's backend: its TRT-LLM kernels and raw rows stay, unchecked."""
    args = server(model_dir(V32_CONFIG), 10, backend="dsa")
    assert resolved_phases(args) == ("trtllm", "trtllm")
    assert pool_row(args) == (MLA_ROW, torch.float8_e4m3fn)
    assert plugin.validate_server_args(args) is None


def test_explicit_trtllm_for_both_phases_is_kept(server, model_dir):
    """The user's TRT-LLM for both phases: SGLang's kernels on their raw rows, indexer on nsa-backend."""
    args = server(model_dir(V32_CONFIG), 10, "--dsa-prefill-backend", "trtllm", "--dsa-decode-backend", "trtllm")
    assert resolved_phases(args) == ("trtllm", "trtllm")
    assert pool_row(args) == (MLA_ROW, torch.float8_e4m3fn)
    assert plugin.validate_server_args(args) == ("trtllm", "trtllm")


def test_explicit_flashmla_pair_is_kept(server, model_dir):
    args = server(
        model_dir(V32_CONFIG), 10, "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "flashmla_kv"
    )
    assert resolved_phases(args) == SCALED
    assert pool_row(args) == (FP8_DS_MLA_ROW, torch.float8_e4m3fn)
    assert plugin.validate_server_args(args) == ("flashmla_sparse", "flashmla_kv")


def test_one_explicit_phase_resolves_the_other(server, model_dir):
    """Only --dsa-decode-backend given: SGLang's trtllm prefill default is replaced, the user's decode kept."""
    args = server(model_dir(V32_CONFIG), 10, "--kv-cache-dtype", "fp8_e4m3", "--dsa-decode-backend", "flashmla_kv")
    assert resolved_phases(args) == SCALED
    assert pool_row(args) == (FP8_DS_MLA_ROW, torch.float8_e4m3fn)
    assert plugin.validate_server_args(args) == ("auto", "flashmla_kv")


def test_one_trtllm_phase_with_ours_refused(server, model_dir):
    with pytest.raises(ValueError, match="nsa-backend's kernels for the prefill phase cannot read"):
        server(
            model_dir(V32_CONFIG), 10, "--dsa-prefill-backend", "flashmla_sparse", "--dsa-decode-backend", "trtllm"
        )


def test_explicit_trtllm_prefill_alone_refused(server, model_dir):
    """The user's trtllm prefill makes the pool raw whatever the decode kernel: nothing is replaced, and
    nsa-backend's decode (no decode flag) is refused with SGLang's resolved names in the message."""
    with pytest.raises(ValueError) as err:
        server(model_dir(V32_CONFIG), 10, "--kv-cache-dtype", "fp8_e4m3", "--dsa-prefill-backend", "trtllm")
    msg = str(err.value)
    assert "resolved --dsa-prefill-backend 'trtllm' / --dsa-decode-backend 'trtllm'" in msg
    assert "raw FP8 KV-cache layout" in msg and "for the decode phase cannot read" in msg
    assert "Leave both --dsa-prefill-backend and --dsa-decode-backend unset" in msg


# -- SGLang features keyed on the dsa / nsa names ------------------------------------------------


def test_prefill_context_parallelism_refused(server, model_dir):
    with pytest.raises(ValueError) as err:
        cp = ["--enable-prefill-cp", "--cp-strategy", "interleave"]
        server(model_dir(GLM5_CONFIG), 12, *cp, takeover=True, backend="dsa")
    msg = str(err.value)
    assert "prefill context parallelism (--enable-prefill-cp / --attn-cp-size 1) is not supported" in msg
    assert "Drop --enable-prefill-cp and use --attn-cp-size 1" in msg and "--attention-backend dsa" in msg


def test_kv_cache_sharding_refused(server, model_dir):
    """A full launch is refused by SGLang's own resolution (sharding needs PD prefill with prefill
    context parallelism, which nsa-backend refuses above); nsa-backend's check refuses it too."""
    with pytest.raises(ValueError, match="--enable-kv-cache-sharding is only supported on PD prefill workers"):
        server(model_dir(GLM5_CONFIG), 12, "--enable-kv-cache-sharding", takeover=True, backend="dsa")
    with pytest.raises(ValueError) as err:
        server(model_dir(GLM5_CONFIG), 12, "--enable-kv-cache-sharding", takeover=True, backend="dsa", full=False)
    msg = str(err.value)
    assert "--enable-kv-cache-sharding is not supported" in msg
    assert "Drop --enable-kv-cache-sharding" in msg and "NSA_BACKEND_SGLANG_TAKEOVER" in msg


def test_cutedsl_paged_logits_refused(server, model_dir):
    with pytest.raises(ValueError) as err:
        server(model_dir(GLM5_CONFIG), 12, "--dsa-paged-mqa-logits-backend", "cutedsl")
    msg = str(err.value)
    assert "--dsa-paged-mqa-logits-backend cutedsl is not supported" in msg
    assert "Use --dsa-paged-mqa-logits-backend auto" in msg


def test_speculative_topk_above_one_refused(server, model_dir):
    """A full launch is refused by SGLang's own resolution (tree drafts need page size 1); nsa-backend's
    check refuses it too."""
    spec = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"]
    with pytest.raises(ValueError, match="speculative_eagle_topk > 1 with page_size > 1 is only supported"):
        server(model_dir(GLM5_CONFIG), 12, *spec, "--speculative-eagle-topk", "2")
    with pytest.raises(ValueError) as err:
        server(model_dir(GLM5_CONFIG), 12, *spec, "--speculative-eagle-topk", "2", full=False)
    assert "--speculative-eagle-topk 2 is not supported" in str(err.value)
    assert "Use --speculative-eagle-topk 1" in str(err.value)
    args = server(model_dir(GLM5_CONFIG), 12, *spec, "--speculative-eagle-topk", "1")
    assert plugin.validate_server_args(args) == ("auto", "auto")


def test_sglang_own_backend_is_not_checked(server, model_dir):
    """Without takeover, ``dsa`` is SGLang's backend: nothing of the above is refused by nsa-backend."""
    args = server(model_dir(V32_CONFIG), 10, "--enable-kv-cache-sharding", backend="dsa", full=False)
    assert plugin.validate_server_args(args) is None
    assert resolved_phases(args) == ("trtllm", "trtllm")
