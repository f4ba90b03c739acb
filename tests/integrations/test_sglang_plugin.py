"""nsa-backend's SGLang plugin, loaded the way SGLang 0.5.23 loads it.

Fresh interpreters run SGLang's own ``load_plugins()`` (the launcher and every worker call it);
the assertions read SGLang's registries afterwards. Startup validation is checked through
``ServerArgs.check_server_args`` with the nsa-backend validator's exact message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from nsa_backend.routing import ImplChoiceError, reset_config, validate_impl_choice
from nsa_backend_integrations.sglang import plugin

GLM5_CONFIG = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "hidden_size": 6144,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "num_hidden_layers": 78,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "num_nextn_predict_layers": 1,
    "vocab_size": 154880,
    "max_position_embeddings": 202752,
    "torch_dtype": "bfloat16",
}


@pytest.fixture
def glm5_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM5_CONFIG))
    return str(tmp_path)


def run_sglang(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned as a dict."""
    full_env = {**os.environ, **(env or {})}
    if "NSA_BACKEND_CONFIG" not in (env or {}):
        full_env.pop("NSA_BACKEND_CONFIG", None)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=240,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1])


def test_entry_point_is_installed():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "nsa_backend"]
    assert len(eps) == 1
    assert eps[0].value == "nsa_backend_integrations.sglang.plugin:register"
    assert eps[0].dist is not None and eps[0].dist.name == "nsa-backend"
    assert eps[0].load() is plugin.register


LOADER = """
    import json
    from sglang.srt.plugins import load_plugins
    load_plugins()  # SGLang's loader: discovers the entry point and calls it
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.models.deepseek_common.utils import FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common import attention_backend_handler as h
    from sglang.srt.speculative.draft_utils import DraftBackendFactory
    from sglang.srt.server_args import ServerArgs, prepare_server_args
    from sglang.srt.arg_groups import resolution_hooks
    from nsa_backend_integrations.sglang import plugin
    absorb = FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    sizes = (len(ATTENTION_BACKENDS), len(ATTENTION_BACKEND_CHOICES), len(absorb))
    plugin._registered = False   # as if a second process-level call came
    plugin.register(); plugin.register()
    args = prepare_server_args(["--model-path", MODEL, "--attention-backend", "nsa_backend",
                                "--kv-cache-dtype", "fp8_e4m3", "--speculative-algorithm", "EAGLE",
                                "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                "--speculative-num-draft-tokens", "4"])
    print(json.dumps({
        "registered": plugin.is_registered(),
        "factory": ATTENTION_BACKENDS.get("nsa_backend") is plugin.create_backend,
        "dsa_is_ours": ATTENTION_BACKENDS.get("dsa") is plugin.create_backend,
        "nsa_is_ours": ATTENTION_BACKENDS.get("nsa") is plugin.create_backend,
        "choice": "nsa_backend" in ATTENTION_BACKEND_CHOICES,
        "mla": "nsa_backend" in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS,
        "dsa_dispatch": h.AttentionBackendRegistry.get_handler("nsa_backend") is h.handle_attention_dsa,
        "draft_hooked": hasattr(DraftBackendFactory._create_backend, "__wrapped__"),
        "check_hooked": hasattr(ServerArgs.check_server_args, "__wrapped__"),
        # SGLang's resolution step that picks the DSA kernels, wrapped once (by SGLang's plugin API)
        "resolution_hooks": [getattr(fn, "__nsa_backend_hook__", False)
                             for fn in resolution_hooks._HOOKS.get(plugin.RESOLUTION_STEP, ())],
        "idempotent": sizes == (len(ATTENTION_BACKENDS), len(ATTENTION_BACKEND_CHOICES),
                                len(FORWARD_ABSORB_CORE_ATTENTION_BACKENDS)),
        "parsed": [args.attention_backend, args.kv_cache_dtype, args.speculative_algorithm],
        "served": list(plugin.served_names()),
    }))
"""


def test_sglang_loader_registers_backend(glm5_dir):
    got = run_sglang(f"MODEL = {glm5_dir!r}\n" + textwrap.dedent(LOADER))
    assert got["registered"] and got["factory"] and got["choice"] and got["mla"] and got["dsa_dispatch"]
    assert got["draft_hooked"] and got["check_hooked"] and got["idempotent"]
    assert got["resolution_hooks"] == [True]
    assert got["parsed"] == ["nsa_backend", "fp8_e4m3", "EAGLE"]
    assert got["served"] == ["nsa_backend"]
    assert not got["dsa_is_ours"] and not got["nsa_is_ours"]  # built-in names untouched by default


def test_plugin_module_imports_without_sglang():
    code = """
        import json, sys
        sys.modules["sglang"] = None  # as if SGLang were not installed
        from nsa_backend_integrations.sglang import plugin, BACKEND_NAME
        try:
            plugin.register()
            print(json.dumps({"raised": None}))
        except RuntimeError as exc:
            print(json.dumps({"raised": str(exc), "name": BACKEND_NAME}))
    """
    got = run_sglang(code)
    assert got["name"] == "nsa_backend" and "SGLang cannot be imported" in got["raised"]


# ---------------------------------------------------------------------------------------------
# In this process: draft backend factory and startup validation
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def registered():
    plugin.register()
    return plugin


def test_takeover_serves_builtin_names(registered, monkeypatch):
    from sglang.srt.layers.attention import attention_registry

    from nsa_backend_integrations.sglang import dsv4, kernels

    monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS", dict(attention_registry.ATTENTION_BACKENDS))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_served", ())
    routed = []
    monkeypatch.setattr(kernels, "activate_deep_gemm", lambda: routed.append("deep_gemm") or [])
    monkeypatch.setattr(dsv4, "activate", lambda: routed.append("dsv4") or [])
    monkeypatch.setenv("NSA_BACKEND_SGLANG_TAKEOVER", "1")
    plugin.register()
    backends = attention_registry.ATTENTION_BACKENDS
    assert backends["dsa"] is backends["nsa"] is backends["nsa_backend"] is plugin.create_backend
    assert plugin.served_names() == ("nsa_backend", "dsa", "nsa")
    # DeepSeek-V4's dsv4 backend calls DeepGEMM and FlashMLA's module functions directly: both routed
    assert routed == ["deep_gemm", "dsv4"]


def test_name_unknown_without_plugin(registered, glm5_dir):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES

    ATTENTION_BACKEND_CHOICES.remove("nsa_backend")
    try:
        with pytest.raises(SystemExit):
            _parse(glm5_dir)
    finally:
        ATTENTION_BACKEND_CHOICES.append("nsa_backend")
    assert _parse(glm5_dir).attention_backend == "nsa_backend"


def test_draft_backend_factory_resolves(registered, monkeypatch):
    from sglang.srt.speculative import draft_utils

    made = []

    def fake_decode(runner, topk, steps, seed_dsa_topk_from_draft_extend=False):
        made.append(("decode", topk, steps))
        return SimpleNamespace(attn_backends=[SimpleNamespace(), SimpleNamespace()])

    def fake_extend(runner, seed_dsa_topk_from_draft_extend=False):
        made.append(("extend",))
        return SimpleNamespace()

    monkeypatch.setattr(plugin, "create_draft_decode_backend", fake_decode)
    monkeypatch.setattr(plugin, "create_draft_extend_backend", fake_extend)
    monkeypatch.setattr(draft_utils, "attention_backends", lambda: ("nsa_backend", "nsa_backend"))
    monkeypatch.setattr(
        draft_utils, "get_spec", lambda: SimpleNamespace(speculative_attention_mode="prefill")
    )
    hf = SimpleNamespace(architectures=["GlmMoeDsaForCausalLM"])
    runner = SimpleNamespace(
        draft_attention_backend=None, model_config=SimpleNamespace(hf_config=hf, hf_text_config=hf)
    )
    factory = draft_utils.DraftBackendFactory(runner, topk=1, speculative_num_steps=3)

    decode = factory.create_decode_backend()
    extend = factory.create_draft_extend_backend()
    assert made == [("decode", 1, 3), ("extend",)]
    assert decode.prefill_attention_backend_str == decode.decode_attention_backend_str == "nsa_backend"
    assert all(c.decode_attention_backend_str == "nsa_backend" for c in decode.attn_backends)
    assert extend.prefill_attention_backend_str == "nsa_backend"
    # Other names still reach SGLang's own map.
    monkeypatch.setattr(draft_utils, "attention_backends", lambda: ("no_such", "no_such"))
    with pytest.raises(ValueError, match="EAGLE is not supported"):
        factory.create_draft_extend_backend()


@pytest.fixture
def sm120(monkeypatch):
    monkeypatch.delenv("NSA_BACKEND_CONFIG", raising=False)
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm120")
    reset_config()
    yield monkeypatch
    reset_config()


def _parse(glm5_dir, *extra):
    from sglang.srt.server_args import prepare_server_args

    return prepare_server_args(
        [
            "--model-path",
            glm5_dir,
            "--attention-backend",
            "nsa_backend",
            "--kv-cache-dtype",
            "fp8_e4m3",
            *extra,
        ]
    )


def test_invalid_choice_fails_at_startup(registered, sm120, glm5_dir):
    from sglang.srt.server_args import ServerArgs

    sm120.setenv("NSA_BACKEND_PREFILL", "flash_mla")  # FlashMLA has no SM120 kernels
    reset_config()
    args = _parse(glm5_dir)
    # SGLang's own checks need a fully resolved launch (a GPU); keep only the nsa-backend step.
    sm120.setattr(ServerArgs.check_server_args, "__wrapped__", lambda self: None)
    with pytest.raises(ImplChoiceError) as got:
        args.check_server_args()
    with pytest.raises(ImplChoiceError) as expect:
        validate_impl_choice("GlmMoeDsaForCausalLM", "sm120", "fp8_e4m3", "flashmla_sparse", "auto")
    assert str(got.value) == str(expect.value)
    assert "flashmla_sparse" in str(got.value) and "sm120" in str(got.value)


def test_sglang_flag_is_validated_too(registered, sm120, glm5_dir):
    from sglang.srt.server_args import ServerArgs

    sm120.setattr(ServerArgs.check_server_args, "__wrapped__", lambda self: None)
    with pytest.raises(ImplChoiceError, match="'trtllm'"):
        _parse(glm5_dir, "--dsa-decode-backend", "trtllm").check_server_args()
    assert plugin.validate_server_args(_parse(glm5_dir, "--dsa-decode-backend", "flashinfer_sparse_mla")) == (
        "auto",
        "flashinfer_sparse_mla",
    )


def test_valid_choice_passes_and_other_backends_are_ignored(registered, sm120, glm5_dir):
    from sglang.srt.server_args import prepare_server_args

    sm120.setenv("NSA_BACKEND_PREFILL", "triton")
    sm120.setenv("NSA_BACKEND_DECODE", "triton")
    reset_config()
    assert plugin.validate_server_args(_parse(glm5_dir)) == ("triton", "triton")
    other = prepare_server_args(["--model-path", glm5_dir, "--attention-backend", "triton"])
    assert plugin.validate_server_args(other) is None


def test_worker_backend_validates_too(sm120):
    from nsa_backend_integrations.sglang.backend import NsaSparseAttnBackend

    sm120.setenv("NSA_BACKEND_DECODE", "flash_mla")  # FP8 FlashMLA decode: SM90/SM100 only
    reset_config()
    b = object.__new__(NsaSparseAttnBackend)
    b.dsa_kv_cache_store_fp8 = True
    with pytest.raises(ImplChoiceError, match="flashmla_kv"):
        b.configure(model_arch="GlmMoeDsaForCausalLM", kv_cache_dtype="fp8_e4m3")


def test_deep_gemm_calls_routed_for_dsv4(monkeypatch):
    """Takeover points DeepGEMM's indexer functions (called directly by SGLang's dsv4 backend) at
    nsa-backend; a call nsa-backend itself sends to DeepGEMM reaches the original kernel."""
    import types

    import torch

    import nsa_backend
    from nsa_backend_integrations.sglang import kernels

    fake = types.ModuleType("deep_gemm")
    fake.fp8_mqa_logits = lambda *args, **kwargs: "native"
    fake.get_num_sms = lambda: 8
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    monkeypatch.setattr(kernels, "_deep_gemm_active", False)
    assert kernels.activate_deep_gemm() == ["deep_gemm.fp8_mqa_logits"]
    assert kernels.activate_deep_gemm() == []  # idempotent

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 8, 64, generator=gen).to(torch.float8_e4m3fn)
    k = torch.randn(9, 64, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(9, generator=gen) + 0.5
    w = torch.rand(5, 8, generator=gen)
    ks = torch.zeros(5, dtype=torch.int32)
    ke = torch.tensor([3, 5, 9, 9, 1], dtype=torch.int32)
    from deep_gemm import fp8_mqa_logits  # how SGLang's dsv4 indexer imports it

    got = fp8_mqa_logits(q, (k, scale), w, ks, ke, clean_logits=True)
    expect = nsa_backend.fp8_mqa_logits(q, (k, scale), w, ks, ke, clean_logits=True, impl="reference")
    assert torch.equal(torch.isinf(got), torch.isinf(expect))
    assert torch.allclose(got[~torch.isinf(got)], expect[~torch.isinf(expect)], rtol=1e-5, atol=1e-5)
    kernels._guard.depth = 1  # inside an nsa-backend op that chose DeepGEMM
    try:
        assert fake.fp8_mqa_logits(q, (k, scale), w, ks, ke) == "native"
    finally:
        kernels._guard.depth = 0


def test_settings_file_and_environment(tmp_path, monkeypatch):
    from nsa_backend_integrations.sglang.settings import family_to_choice, load_settings

    monkeypatch.delenv("NSA_BACKEND_SGLANG_TAKEOVER", raising=False)
    path = tmp_path / "nsa.toml"
    path.write_text("[sglang]\ntakeover = true\n")
    assert load_settings(str(path)).takeover is True
    monkeypatch.setenv("NSA_BACKEND_SGLANG_TAKEOVER", "off")
    assert load_settings(str(path)).takeover is False
    monkeypatch.delenv("NSA_BACKEND_SGLANG_TAKEOVER")
    path.write_text("[sglang]\ntake_over = true\n")
    with pytest.raises(ValueError, match="unknown keys \\['take_over'\\]"):
        load_settings(str(path))
    path.write_text('[sglang]\ntakeover = "maybe"\n')
    with pytest.raises(ValueError, match="expected true or false"):
        load_settings(str(path))
    # nsa-backend op-family names -> the validator's names
    assert family_to_choice("flash_mla", "prefill", "fp8_e4m3") == "flashmla_sparse"
    assert family_to_choice("flash_mla", "decode", "fp8_e4m3") == "flashmla_kv"
    assert family_to_choice("flash_mla", "decode", "bfloat16") == "flashmla_sparse"
    assert family_to_choice("flashinfer", "decode", "fp8_e4m3") == "flashinfer_sparse_mla"
    assert family_to_choice("triton", "prefill", "bfloat16") == "triton"
