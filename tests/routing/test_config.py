"""Config file and environment overrides: precedence and error messages."""

from __future__ import annotations

import logging

import pytest
import torch

from nsa_backend import routing
from nsa_backend.routing.config import ConfigError, load_config

FULL = """
[defaults]
indexer = "triton"
decode = "triton"
log_level = "info"

[arch.sm90]
decode = "flash_mla"
prefill = "reference"

[model.GlmMoeDsaForCausalLM]
decode = "reference"
"""


@pytest.fixture
def cfg_file(tmp_path):
    def write(text: str):
        path = tmp_path / "nsa.toml"
        path.write_text(text)
        return path
    return write


def test_precedence_file_sections(cfg_file):
    cfg = load_config(cfg_file(FULL))
    assert cfg.choice("decode", "sm120", None) == ("triton", f"{cfg.path} [defaults]")
    assert cfg.choice("decode", "sm90", None) == ("flash_mla", f"{cfg.path} [arch.sm90]")
    assert cfg.choice("decode", "sm90", "GlmMoeDsaForCausalLM") == ("reference",
                                                                    f"{cfg.path} [model.GlmMoeDsaForCausalLM]")
    assert cfg.choice("decode", "sm90", "DeepseekV32ForCausalLM")[0] == "flash_mla"
    assert cfg.choice("topk", "sm90", None) == ("auto", "built-in")
    assert cfg.log_level == "info"


def test_env_beats_file(cfg_file, monkeypatch):
    monkeypatch.setenv("NSA_BACKEND_DECODE", "flashinfer")
    cfg = load_config(cfg_file(FULL))
    assert cfg.choice("decode", "sm90", "GlmMoeDsaForCausalLM") == ("flashinfer", "env NSA_BACKEND_DECODE")
    assert cfg.choice("indexer", "sm90", None)[0] == "triton"


def test_config_path_from_env(cfg_file, monkeypatch):
    path = cfg_file(FULL)
    monkeypatch.setenv("NSA_BACKEND_CONFIG", str(path))
    routing.reset_config()
    assert routing.get_config().path == str(path)
    assert logging.getLogger("nsa_backend").level == logging.INFO


def test_explicit_argument_beats_env_and_file(cfg_file, monkeypatch, all_kernels_present, natives):
    monkeypatch.setenv("NSA_BACKEND_CONFIG", str(cfg_file(FULL)))
    monkeypatch.setenv("NSA_BACKEND_TOPK", "reference")
    routing.reset_config()
    feats = {"device": torch.device("cuda", 0), "arch": "sm90", "topk": 2048}
    assert routing.select_impl("topk_indices", "auto", feats) == "reference"       # env
    assert routing.select_impl("topk_indices", "triton", feats) == "triton"        # argument
    dec = {"device": torch.device("cuda", 0), "arch": "sm90", "num_heads": 64, "d_qk": 576, "topk": 2048,
           "s_q": 1, "kv_format": "fp8_ds_mla", "page_size": 64}
    assert routing.select_impl("sparse_mla_decode", "auto", dec) == "flash_mla"      # [arch.sm90]
    assert routing.select_impl("sparse_mla_decode", "auto", {**dec, "arch": "sm86"}) == "triton"  # [defaults]
    routing.set_active_model("GlmMoeDsaForCausalLM")
    assert routing.select_impl("sparse_mla_decode", "auto", dec) == "reference"      # [model.*]
    assert routing.select_impl("sparse_mla_decode", "flash_mla", dec) == "flash_mla"


def test_use_config_switches_file_and_clears_cache(cfg_file, all_kernels_present, natives):
    feats = {"device": torch.device("cuda", 0), "arch": "sm86", "topk": 64}
    assert routing.select_impl("topk_indices", "auto", feats) == "triton"
    routing.use_config(cfg_file('[defaults]\ntopk = "reference"\n'))
    assert routing.select_impl("topk_indices", "auto", feats) == "reference"


@pytest.mark.parametrize(("text", "pattern"), [
    ('[defaults]\nindexer = "flash_mla"\n',
     r"\[defaults\]: key 'indexer' has unknown value 'flash_mla'; accepted values: \['auto', 'reference', "
     r"'triton', 'deep_gemm'\]"),
    ('[defaults]\ndecoder = "triton"\n', r"\[defaults\]: unknown key 'decoder'; accepted keys: \['indexer'"),
    ('[arch.sm70]\ndecode = "triton"\n', r"\[arch.sm70\]: unknown arch family 'sm70'; accepted values: \['sm80'"),
    ('[arch.sm90]\nforce_arch = "sm90"\n', r"\[arch.sm90\]: key 'force_arch' is only accepted in \[defaults\]"),
    ('[defaults]\nforce_arch = "hopper"\n', r"key 'force_arch' has unknown value 'hopper'"),
    ('[defaults]\nlog_level = "loud"\n', r"key 'log_level' has unknown value 'loud'; accepted values: \['debug'"),
    ('[routing]\ndecode = "triton"\n', r"unknown top-level table 'routing'; accepted sections"),
    ('decode = "triton"\n', r"unknown top-level key 'decode'"),
    ('[model.GlmMoeDsaForCausalLM]\ntopk = 3\n', r"\[model.GlmMoeDsaForCausalLM\]: key 'topk' has unknown value 3"),
    ("[defaults\n", r"not valid TOML"),
], ids=["value", "key", "arch", "defaults-only", "force-arch", "log-level", "section", "top-key", "model", "toml"])
def test_file_errors_name_path_key_and_accepted(cfg_file, text, pattern):
    path = cfg_file(text)
    with pytest.raises(ConfigError, match=pattern) as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


@pytest.mark.parametrize(("var", "value"), [("NSA_BACKEND_DECODE", "deep_gemm"), ("NSA_BACKEND_INDEXER", "x"),
                                            ("NSA_BACKEND_LOG_LEVEL", "chatty")])
def test_env_errors_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=rf"environment variable {var}: .*{value!r}.*accepted values"):
        load_config()


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_integration_tables_are_left_to_the_integrations(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[defaults]\ndecode = "triton"\n[sglang]\ntakeover = true\n[vllm]\ntakeover = "auto"\n')
    assert load_config(str(path)).defaults == {"decode": "triton"}
    path.write_text('sglang = 1\n')
    with pytest.raises(ConfigError, match=r"\[sglang\] must be a table"):
        load_config(str(path))
