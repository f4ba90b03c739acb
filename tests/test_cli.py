"""The nsa-backend CLI: doctor, plan and demo (exit codes and output); the console script's launcher
(``--help`` / ``--version`` without torch); the ``[vllm]`` table read from ``--config``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nsa_backend_cli
from nsa_backend import cli, routing
from nsa_backend.routing import config
from nsa_backend_integrations.vllm import config as vllm_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# Top-level packages that --help / --version must not import (nsa_backend's __init__ imports torch).
HEAVY = ("torch", "triton", "nsa_backend", "nsa_backend_integrations", "rich")


pytestmark = pytest.mark.usefixtures("routing_isolated")


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


# ----------------------------------------------------------------------------------------------
# The launcher: --help and --version import no torch
# ----------------------------------------------------------------------------------------------

PROBE = """
import sys
from nsa_backend_cli import main
try:
    main({argv!r})
except SystemExit as exc:
    assert exc.code == 0, exc.code
else:
    raise AssertionError("main() returned instead of exiting")
print("IMPORTED", sorted({{m.split(".")[0] for m in sys.modules}} & set({heavy!r})))
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("NSA_BACKEND_")}


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["plan", "--help"], ["bench", "--help"]],
                         ids=["help", "version", "plan-help", "bench-help"])
def test_launcher_help_and_version_import_no_torch(argv):
    result = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv, heavy=HEAVY)], capture_output=True,
                            text=True, env=_clean_env(), cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "IMPORTED []" in result.stdout, result.stdout[-500:]
    assert ("usage: nsa-backend" in result.stdout) != (argv == ["--version"])
    if argv == ["--version"]:
        assert result.stdout.startswith(f"nsa-backend {nsa_backend_cli.version()}\n")


def test_console_script_is_the_launcher(tmp_path):
    """pyproject, the installed distribution's metadata and the installed script all name the launcher,
    and the script's --help imports neither torch nor nsa_backend (``-X importtime`` lists every import)."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"nsa-backend": "nsa_backend_cli:main"}
    # Read the installed metadata from outside the checkout: a build leaves nsa_backend.egg-info in the
    # checkout, which importlib.metadata would find first when the checkout is on sys.path.
    code = ("import importlib.metadata as m\n"
            "eps = [e for e in m.distribution('nsa-backend').entry_points if e.group == 'console_scripts']\n"
            "print([(e.name, e.value) for e in eps])\n"
            "import nsa_backend_cli\n"
            "print(eps[0].load() is nsa_backend_cli.main)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_clean_env(),
                            cwd=tmp_path, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[('nsa-backend', 'nsa_backend_cli:main')]", "True"], (
        result.stdout + "(refresh the install: pip install -e .)")
    assert nsa_backend_cli.main is cli.main
    script = Path(sys.executable).parent / "nsa-backend"
    assert script.is_file(), script
    result = subprocess.run([sys.executable, "-X", "importtime", str(script), "--help"], capture_output=True,
                            text=True, env=_clean_env(), cwd=REPO, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: nsa-backend"), result.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    assert "nsa_backend_cli" in imported and not imported & set(HEAVY), sorted(imported & set(HEAVY))


def test_launcher_constants_match_the_package():
    """The parser's copies of the arch families and bench families equal the package's own."""
    from nsa_backend.bench import FAMILIES
    from nsa_backend.routing.device import ARCH_FAMILIES

    assert nsa_backend_cli.ARCH_FAMILIES == ARCH_FAMILIES
    assert nsa_backend_cli.bench.FAMILIES == FAMILIES


# ----------------------------------------------------------------------------------------------
# The [vllm] table of --config
# ----------------------------------------------------------------------------------------------

def test_vllm_settings_read_the_given_path(tmp_path, monkeypatch):
    given = tmp_path / "given.toml"
    given.write_text('[vllm]\nindexer = "off"\ntakeover = "on"\n')
    other = tmp_path / "other.toml"
    other.write_text('[vllm]\nindexer = "on"\n')
    monkeypatch.setenv(config.CONFIG_ENV, str(other))
    for var in (vllm_config.TAKEOVER_ENV, vllm_config.INDEXER_ENV, vllm_config.HC_PRENORM_ENV):
        monkeypatch.delenv(var, raising=False)
    assert vllm_config.load_settings(given) == vllm_config.VllmSettings(
        takeover=vllm_config.TAKEOVER_NAMES, indexer="off", hc_prenorm="auto")
    assert vllm_config.load_settings(str(given), {"indexer": "auto"}).indexer == "auto"
    # without a path: the file of $NSA_BACKEND_CONFIG
    assert vllm_config.load_settings().indexer == "on"


def test_doctor_checks_the_vllm_table_of_config_not_the_environment(tmp_path, monkeypatch, capsys):
    """``--config`` wins over ``$NSA_BACKEND_CONFIG`` for the [vllm] table too, and the environment is
    left as it was."""
    bad = tmp_path / "bad.toml"
    bad.write_text('[vllm]\nindexer = "sometimes"\n')
    good = tmp_path / "good.toml"
    good.write_text('[vllm]\nindexer = "off"\n')
    monkeypatch.setenv(config.CONFIG_ENV, str(good))
    routing.reset_config()
    assert cli.main(["doctor", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"[vllm] settings ({bad})" in err and "'sometimes'" in err, err
    assert os.environ[config.CONFIG_ENV] == str(good)
    monkeypatch.setenv(config.CONFIG_ENV, str(bad))
    routing.reset_config()
    assert cli.main(["doctor", "--config", str(good)]) == 0, capsys.readouterr().err


def _plan_rows(out: str) -> dict[str, tuple[str, str]]:
    """``op -> (impl, note)`` from a plan table printed without wrapping."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip("│ ").split("│")]
        if len(cells) == 5 and cells[1] in ("indexer", "topk", "prefill", "decode", "hc_prenorm"):
            rows[cells[0]] = (cells[2], cells[4])
    return rows


@pytest.mark.parametrize(("model", "index_heads"), [("deepseek-v3.2", 64), ("glm-5", 32)])
def test_plan_sm120_keeps_deep_gemm_indexer_where_it_serves(model, index_heads, monkeypatch, capsys):
    """On SM120 with a DeepGEMM that has SM120 kernels, the indexer stays native at 32 / 64 index
    heads (both models, every TP: the indexer is replicated), with the kernel named as the reason."""
    monkeypatch.setenv("COLUMNS", "300")
    assert cli.main(["plan", "--model", model, "--arch", "sm120", "--kv-cache-dtype", "fp8_e4m3", "--tp", "2",
                     "--assume-natives", "deep_gemm=2.8.1"]) == 0
    rows = _plan_rows(capsys.readouterr().out)
    for op, kernel in (("fp8_mqa_logits", "sm120_fp8_mqa_logits"),
                       ("get_paged_mqa_logits_metadata", "sm120_paged_mqa_logits_metadata"),
                       ("fp8_paged_mqa_logits", "sm120_fp8_paged_mqa_logits")):
        impl, note = rows[op]
        assert impl == "deep_gemm" and kernel in note, (op, impl, note)
    assert rows["sparse_mla_decode"][0] == "triton"


@pytest.mark.parametrize(("arch", "index_heads", "reason"), [
    ("sm120", 128, "num_heads"),   # DeepGEMM's SM120 indexer takes 32 or 64 heads (fewer are padded)
    ("sm89", 64, "sm89"),          # no DeepGEMM kernels below SM90
])
def test_plan_indexer_falls_back_to_triton_with_the_reason(arch, index_heads, reason, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "300")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"architectures": ["DeepseekV32ForCausalLM"], "num_attention_heads": 64,
                                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                                "v_head_dim": 128, "index_n_heads": index_heads, "index_head_dim": 128,
                                "index_topk": 2048}))
    assert cli.main(["plan", "--model", str(path), "--arch", arch, "--kv-cache-dtype", "fp8_e4m3",
                     "--assume-natives", "deep_gemm=2.8.1"]) == 0
    impl, note = _plan_rows(capsys.readouterr().out)["fp8_mqa_logits"]
    assert impl == "triton" and "deep_gemm" in note and reason in note, (impl, note)


# DeepSeek-V4: every op one attention layer calls (the FP8 indexer as SGLang calls it, the MXFP4 one as
# vLLM does, the 584-byte cache ops), routed per arch.
V4_OPS = {
    "fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "pack_indexer_k_cache",
    "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits", "pack_indexer_k_cache_fp4", "topk_indices",
    "logical_to_global_indices", "flash_mla_sparse_fwd", "sparse_mla_decode", "pack_fp8_ds_mla_v4",
    "write_fp8_ds_mla_v4_cache", "unpack_fp8_ds_mla_v4", "tf32_hc_prenorm_gemm",
}
V4_TENSOR_OPS = {"pack_indexer_k_cache", "pack_indexer_k_cache_fp4"}
V4_NATIVES = "deep_gemm=2.8.1,flash_mla,flashinfer=0.7.2"


def _plan_rows_wrapped(out: str) -> dict[str, tuple[str, str]]:
    """``op -> (impl, whole note)`` from a plan table whose notes wrap onto continuation lines."""
    rows: dict[str, tuple[str, str]] = {}
    last = None
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if len(cells) != 5:
            continue
        if cells[1] in ("indexer", "topk", "prefill", "decode", "hc_prenorm"):
            last = cells[0]
            rows[last] = (cells[2], cells[4])
        elif last is not None and not cells[0] and cells[4]:
            impl, note = rows[last]
            rows[last] = (impl, f"{note} {cells[4]}")
    return rows


def _v4_plan(arch: str, tp: int, capsys, *extra: str) -> tuple[str, dict[str, tuple[str, str]]]:
    assert cli.main(["plan", "--model", "deepseek-v4", "--arch", arch, "--tp", str(tp),
                     "--assume-natives", V4_NATIVES, *extra]) == 0
    out = capsys.readouterr().out
    return out, _plan_rows_wrapped(out)


def test_plan_deepseek_v4_features_are_those_of_a_real_call():
    """The features the plan routes are those the public ops report for a DeepSeek-V4 layer: the 584-byte
    FP8 format at d_qk 512 with the per-GPU heads, 64 index heads for both indexers, MXFP4 queries."""
    from nsa_backend.models import load_model_config
    from nsa_backend.routing.device import model_info
    from nsa_backend.routing.router import model_op_features

    info = model_info(load_model_config("deepseek-v4"))
    for tp in (1, 2, 4, 8):
        ops = model_op_features(info, tp=tp, kv_cache_dtype="fp8_e4m3")
        assert set(ops) == V4_OPS
        assert ops["sparse_mla_decode"] == {"num_heads": 64 // tp, "d_qk": 512, "topk": 512, "s_q": 1,
                                            "kv_format": "fp8_ds_mla_v4", "page_size": 64}
        assert ops["flash_mla_sparse_fwd"] == {"num_heads": 64 // tp, "d_qk": 512, "topk": 512}
        assert ops["fp8_fp4_paged_mqa_logits"]["num_heads"] == 64 and ops["fp8_fp4_paged_mqa_logits"]["q_fp4"]
        assert ops["fp8_fp4_mqa_logits"]["num_heads"] == 64
        assert ops["fp8_paged_mqa_logits"]["num_heads"] == 64 and ops["fp8_paged_mqa_logits"]["head_dim"] == 128
        assert ops["tf32_hc_prenorm_gemm"] == {"n": 24, "k": 4 * 4096}
    # a bf16 cache is the bf16 format, without the 584-byte cache ops
    bf16 = model_op_features(info, kv_cache_dtype="bfloat16")
    assert bf16["sparse_mla_decode"]["kv_format"] == "bf16"
    assert not {"pack_fp8_ds_mla_v4", "write_fp8_ds_mla_v4_cache", "unpack_fp8_ds_mla_v4"} & set(bf16)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_plan_deepseek_v4_sm89_runs_every_op_on_ours_with_reasons(tp, monkeypatch, capsys):
    """On SM89 no native kernel serves DeepSeek-V4: every op is ours (Triton, or the tensor-op reference
    for the two packings), and the note of each op a native package has says why it does not serve."""
    monkeypatch.setenv("COLUMNS", "300")
    out, rows = _v4_plan("sm89", tp, capsys)
    assert f"heads/rank {64 // tp}" in out and "kv_cache_dtype=fp8_e4m3" in out
    assert set(rows) == V4_OPS
    for op, (impl, note) in rows.items():
        assert impl == ("reference" if op in V4_TENSOR_OPS else "triton"), (op, impl, note)
    for op in ("fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "tf32_hc_prenorm_gemm"):
        assert f"deep_gemm has no {op} kernel for sm89" in rows[op][1], rows[op]
    for op in ("flash_mla_sparse_fwd", "sparse_mla_decode"):
        assert f"flash_mla has no {op} kernel for sm89" in rows[op][1], rows[op]
    assert "flashinfer has no sparse_mla_decode kernel for sm89" in rows["sparse_mla_decode"][1]
    for op in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"):
        assert f"deep_gemm has no {op} kernel for sm89" in rows[op][1], rows[op]


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_plan_deepseek_v4_sm120_keeps_deep_gemm_where_it_serves(tp, monkeypatch, capsys):
    """On SM120 DeepGEMM's SM120 kernels keep the FP8 and FP4 indexers (64 index heads) and the mHC GEMM;
    V4 sparse MLA is ours: FlashMLA has no SM120 kernel and FlashInfer's decode takes d_qk 576 only."""
    monkeypatch.setenv("COLUMNS", "300")
    _, rows = _v4_plan("sm120", tp, capsys)
    assert set(rows) == V4_OPS
    for op, kernel in (("fp8_mqa_logits", "sm120_fp8_mqa_logits"),
                       ("get_paged_mqa_logits_metadata", "sm120_paged_mqa_logits_metadata"),
                       ("fp8_paged_mqa_logits", "sm120_fp8_paged_mqa_logits"),
                       ("tf32_hc_prenorm_gemm", "sm120_tf32_hc_prenorm_gemm"),
                       ("fp8_fp4_mqa_logits", "sm120_fp4_mqa_logits"),
                       ("fp8_fp4_paged_mqa_logits", "sm120_fp4_paged_mqa_logits")):
        assert rows[op][0] == "deep_gemm" and kernel in rows[op][1], (op, rows[op])
    impl, note = rows["sparse_mla_decode"]
    assert impl == "triton" and "flashinfer sparse_mla_decode on sm120: d_qk=512 is not in {576}" in note, note
    impl, note = rows["flash_mla_sparse_fwd"]
    assert impl == "triton" and "flash_mla has no flash_mla_sparse_fwd kernel for sm120" in note, note
    for op in ("pack_fp8_ds_mla_v4", "write_fp8_ds_mla_v4_cache", "unpack_fp8_ds_mla_v4", "topk_indices",
               "logical_to_global_indices"):
        assert rows[op][0] == "triton", (op, rows[op])


@pytest.mark.parametrize(("arch", "tp", "padded"), [("sm90", 1, None), ("sm90", 2, 64), ("sm90", 8, 64),
                                                  ("sm100", 1, None), ("sm100", 8, 64)])
def test_plan_deepseek_v4_flash_mla_and_deep_gemm_on_sm90_sm100(arch, tp, padded, monkeypatch, capsys):
    """On SM90 / SM100 FlashMLA serves the d_qk 512 sparse prefill and the 584-byte V4 decode (fewer than 64
    heads padded to 64) and DeepGEMM the FP8 indexer and mHC GEMM; DeepGEMM's MXFP4 indexer runs on SM100
    only (SM90 has no FP4 path), so on SM90 the FP4 indexer is ours with that reason."""
    monkeypatch.setenv("COLUMNS", "300")
    _, rows = _v4_plan(arch, tp, capsys)
    for op in ("flash_mla_sparse_fwd", "sparse_mla_decode"):
        impl, note = rows[op]
        assert impl == "flash_mla", (op, impl, note)
        assert ("num_heads padded to 64" in note) == (padded is not None), note
    for op in ("fp8_mqa_logits", "get_paged_mqa_logits_metadata", "fp8_paged_mqa_logits", "tf32_hc_prenorm_gemm"):
        assert rows[op][0] == "deep_gemm", (op, rows[op])
    for op in ("fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits"):
        if arch == "sm100":
            assert rows[op][0] == "deep_gemm", (op, rows[op])
        else:
            assert rows[op][0] == "triton" and f"deep_gemm has no {op} kernel for sm90" in rows[op][1], rows[op]


def test_plan_deepseek_v4_bf16_cache_is_the_bf16_format(monkeypatch, capsys):
    """An explicit bf16 cache routes the bf16 decode and lists none of the 584-byte cache ops."""
    monkeypatch.setenv("COLUMNS", "300")
    out, rows = _v4_plan("sm89", 1, capsys, "--kv-cache-dtype", "bf16")
    assert "kv_cache_dtype=bfloat16" in out
    assert rows["sparse_mla_decode"][0] == "triton"
    assert "pack_fp8_ds_mla_v4" not in rows and "write_fp8_ds_mla_v4_cache" not in rows
