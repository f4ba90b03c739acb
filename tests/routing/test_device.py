"""Arch detection (compute capability -> family, forced arch) and model classification."""

from __future__ import annotations

import pytest
import torch

from nsa_backend import routing
from nsa_backend.models import SHIPPED, load_model_config
from nsa_backend.routing.config import ConfigError
from nsa_backend.routing.device import ARCH_FAMILIES, family_from_capability, model_info


@pytest.mark.parametrize(("cc", "family"), [
    ((8, 0), "sm80"),      # A100
    ((8, 6), "sm86"),      # A10, RTX 30xx
    ((8, 7), "sm86"),      # Jetson Orin
    ((8, 9), "sm89"),      # L4, L40, RTX 40xx
    ((9, 0), "sm90"),      # H100, H200
    ((10, 0), "sm100"),    # B200
    ((10, 3), "sm103"),    # B300
    ((10, 1), "sm100"),    # other 10.x
    ((12, 0), "sm120"),    # RTX 5090, RTX PRO 6000
    ((12, 1), "sm121"),    # DGX Spark GB10
    ((12, 5), "sm120"),    # other 12.x
    ((11, 0), "sm89"),     # Jetson Thor: no native DSA kernels, Triton only
    ((13, 0), "sm89"),     # newer than any native build
    ((7, 5), "sm80"),      # below the supported minimum (doctor reports it)
], ids=lambda v: str(v))
def test_family_from_capability(cc, family):
    assert family_from_capability(*cc) == family
    assert family in ARCH_FAMILIES


def test_cpu_device_is_cpu():
    assert routing.detect_arch(torch.device("cpu")) == "cpu"
    assert routing.detect_arch("cpu") == "cpu"


def test_forced_arch_from_env(monkeypatch):
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm120")
    routing.reset_config()
    # A CUDA device object can be built without a GPU; the forced arch answers before CUDA is queried.
    assert routing.detect_arch(torch.device("cuda", 0)) == "sm120"
    assert routing.detect_arch(0) == "sm120"
    # CPU tensors cannot run anything else; the default device follows the forced arch.
    assert routing.detect_arch(torch.device("cpu")) == "cpu"
    assert routing.detect_arch() == "sm120"


def test_forced_arch_from_config_file(tmp_path, monkeypatch):
    path = tmp_path / "nsa.toml"
    path.write_text('[defaults]\nforce_arch = "sm90"\n')
    monkeypatch.setenv("NSA_BACKEND_CONFIG", str(path))
    routing.reset_config()
    assert routing.detect_arch(torch.device("cuda", 0)) == "sm90"
    # The environment variable wins over the file.
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm121")
    routing.reset_config()
    assert routing.detect_arch(torch.device("cuda", 0)) == "sm121"
    assert routing.get_config().force_arch_source == "env NSA_BACKEND_FORCE_ARCH"


def test_forced_arch_rejects_unknown(monkeypatch):
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm70")
    routing.reset_config()
    with pytest.raises(ConfigError, match=r"NSA_BACKEND_FORCE_ARCH.*'sm70'.*sm120"):
        routing.detect_arch(torch.device("cuda", 0))


@pytest.mark.parametrize(("config", "family"), [
    ({"architectures": ["DeepseekV32ForCausalLM"], "index_topk": 2048}, "deepseek_v32"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "index_topk": 2048}, "deepseek_v32"),   # V3.2-Exp naming
    ({"architectures": ["DeepseekV3ForCausalLM"]}, None),                                 # plain V3: dense MLA
    ({"architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 2048}, "glm_dsa"),
    ({"architectures": ["DeepseekV4ForCausalLM"], "index_topk": 512}, "deepseek_v4"),
    ({"architectures": ["LlamaForCausalLM"]}, None),
    ({"architectures": ["SomeNewGlm"], "model_type": "glm_next", "index_topk": 2048}, "glm_dsa"),
    ({}, None),
], ids=["v32", "v3-with-index", "v3-dense", "glm5", "v4", "llama", "unknown-glm-dsa", "empty"])
def test_model_family(config, family):
    assert routing.model_family(config) == family


def test_shipped_model_shapes():
    assert set(SHIPPED) == {"deepseek-v3.2", "glm-5", "deepseek-v4"}
    v32 = model_info(load_model_config("deepseek-v3.2"))
    assert (v32.family, v32.num_heads, v32.d_qk, v32.d_v) == ("deepseek_v32", 128, 576, 512)
    assert (v32.index_n_heads, v32.index_head_dim, v32.index_topk) == (64, 128, 2048)
    glm = model_info(load_model_config("glm-5"))
    assert (glm.family, glm.num_heads, glm.d_qk, glm.index_n_heads) == ("glm_dsa", 64, 576, 32)
    assert glm.heads_per_rank(4) == 16
    v4 = model_info(load_model_config("deepseek-v4"))
    assert (v4.family, v4.d_qk, v4.index_topk, v4.hc_mult) == ("deepseek_v4", 512, 512, 4)
    with pytest.raises(ValueError, match="--tp 3"):
        glm.heads_per_rank(3)


def test_model_info_rejects_dense_models():
    with pytest.raises(ValueError, match="not a DeepSeek sparse attention model"):
        model_info({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="missing key 'index_n_heads'"):
        model_info({"architectures": ["GlmMoeDsaForCausalLM"], "index_topk": 2048, "kv_lora_rank": 512,
                    "num_attention_heads": 64})


def test_load_model_config_errors(tmp_path):
    with pytest.raises(ValueError, match="not a shipped model"):
        load_model_config(tmp_path / "missing.json")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model_config(tmp_path)   # a directory holding config.json
