"""The nsa-backend CLI: doctor, plan and demo (exit codes and output)."""

from __future__ import annotations

import json

import pytest

from nsa_backend import cli, routing
from nsa_backend.routing import config


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for var in (config.CONFIG_ENV, config.FORCE_ARCH_ENV, config.LOG_LEVEL_ENV, *config.FAMILY_ENV.values()):
        monkeypatch.delenv(var, raising=False)
    routing.reset_config()
    routing.set_native_status(None)
    yield
    routing.reset_config()
    routing.set_native_status(None)


def test_plan_valid(capsys):
    assert cli.main(["plan", "--model", "glm-5", "--arch", "sm120", "--kv-cache-dtype", "fp8_e4m3", "--tp", "4"]) == 0
    out = capsys.readouterr().out
    assert "GlmMoeDsaForCausalLM on sm120: tp=4 (heads/rank 16)" in out
    for op in ("fp8_mqa_logits", "topk_indices", "flash_mla_sparse_fwd", "sparse_mla_decode", "pack_fp8_ds_mla"):
        assert op in out


def test_plan_with_assumed_natives(capsys):
    args = ["plan", "--model", "deepseek-v3.2", "--arch", "sm90", "--tp", "8", "--kv-cache-dtype", "fp8_e4m3",
            "--assume-natives", "deep_gemm=2.6.1,flash_mla=1.0.0"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "deep_gemm" in out and "flash_mla" in out and "num_heads padded to 64" in out


def test_plan_invalid_choice_exits_1(capsys):
    code = cli.main(["plan", "--model", "glm-5", "--arch", "sm120", "--kv-cache-dtype", "fp8_e4m3",
                     "--decode-impl", "flashmla_kv"])
    assert code == 1
    err = capsys.readouterr().err
    for part in ("GlmMoeDsaForCausalLM", "sm120", "kv_cache_dtype=fp8_e4m3", "'flashmla_kv'", "Valid decode choices",
                 "flashinfer_sparse_mla"):
        assert part in err


def test_plan_model_from_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                                "num_attention_heads": 64, "head_dim": 512, "qk_nope_head_dim": 448,
                                "qk_rope_head_dim": 64, "index_n_heads": 64, "index_head_dim": 128,
                                "index_topk": 512, "hidden_size": 4096, "hc_mult": 4}))
    assert cli.main(["plan", "--model", str(path), "--arch", "sm100", "--kv-cache-dtype", "bf16"]) == 0
    assert "tf32_hc_prenorm_gemm" in capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ["plan", "--model", "no-such-model"],
    ["plan", "--model", "glm-5", "--tp", "3"],
    ["plan", "--model", "glm-5", "--assume-natives", "cutlass"],
])
def test_plan_usage_errors_exit_2(args, capsys):
    assert cli.main(args) == 2
    assert "error" in capsys.readouterr().err


def test_plan_dense_model_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert cli.main(["plan", "--model", str(path)]) == 2
    assert "not a DeepSeek sparse attention model" in capsys.readouterr().err


def test_plan_config_file(tmp_path, capsys):
    good = tmp_path / "good.toml"
    good.write_text('[arch.sm120]\ndecode = "reference"\n')
    assert cli.main(["plan", "--model", "glm-5", "--arch", "sm120", "--kv-cache-dtype", "fp8_e4m3",
                     "--config", str(good)]) == 0
    assert "[arch.sm120]" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[defaults]\nprefill = "flashinfer"\n')
    assert cli.main(["plan", "--model", "glm-5", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "'prefill'" in err and "accepted values" in err


def test_plan_rejects_unknown_arch_choice(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--model", "glm-5", "--arch", "sm70"])
    assert info.value.code == 2


def test_doctor(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for part in ("arch family", "torch", "triton", "native packages", "deep_gemm", "flash_mla", "flashinfer",
                 "fp8_mqa_logits", "sparse_mla_decode"):
        assert part in out
    assert "problems:" in out or "no problems found" in out


def test_doctor_bad_config_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[nonsense]\n")
    assert cli.main(["doctor", "--config", str(bad)]) == 2
    assert "unknown top-level table 'nonsense'" in capsys.readouterr().err


def test_demo_on_cpu(capsys):
    assert cli.main(["demo", "--device", "cpu", "--tokens", "32", "--steps", "1", "--topk", "16"]) == 0
    out = capsys.readouterr().out
    for part in ("fp8_mqa_logits", "topk_indices", "flash_mla_sparse_fwd", "sparse_mla_decode", "reference",
                 "agreement with reference", "decode 1", "total wall time"):
        assert part in out
