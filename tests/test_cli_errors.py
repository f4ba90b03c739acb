"""Every bad input of every ``nsa-backend`` subcommand: one line ``error: <what>: <why>``, status 2.

The table runs in-process through ``cli.main`` (stderr captured); a few rows run again as a real
subprocess to show the installed entry point prints no traceback either.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nsa_backend import cli, routing
from nsa_backend._cli_demo import run_demo
from nsa_backend.routing.device import ARCH_FAMILIES

pytestmark = pytest.mark.usefixtures("routing_isolated")


@pytest.fixture
def files(tmp_path):
    """Config files with one fault each, by name."""
    (tmp_path / "a_directory.toml").mkdir()
    out = {"dir": tmp_path / "a_directory.toml"}
    bodies = {
        "latin1": '[defaults]\ntopk = "triton"  # caf\xe9\n'.encode("latin-1"),
        "badtoml": b"[defaults\n",
        "sglang": b'[sglang]\ntakeover = "maybe"\n',
        "sglang_key": b"[sglang]\nspeed = 1\n",
        "vllm": b'[vllm]\nindexer = "sometimes"\n',
        "vllm_key": b"[vllm]\nbogus = 1\n",
        "family": b'[defaults]\nprefill = "flashinfer"\n',
    }
    for name, body in bodies.items():
        path = tmp_path / f"{name}.toml"
        path.write_bytes(body)
        out[name] = path
    return out


PLAN = ["plan", "--model", "glm-5"]
# (id, argv with {file} placeholders, environment, status, text the error line must hold)
CASES = [
    ("config-is-directory-doctor", ["doctor", "--config", "{dir}"], {}, 2, "is a directory"),
    ("config-is-directory-plan", [*PLAN, "--config", "{dir}"], {}, 2, "is a directory"),
    ("config-not-utf8-doctor", ["doctor", "--config", "{latin1}"], {}, 2, "latin1.toml: not UTF-8"),
    ("config-not-utf8-plan", [*PLAN, "--config", "{latin1}"], {}, 2, "latin1.toml: not UTF-8"),
    ("config-not-utf8-env", ["doctor"], {"NSA_BACKEND_CONFIG": "{latin1}"}, 2, "latin1.toml: not UTF-8"),
    ("config-missing", ["doctor", "--config", "/no/such/file.toml"], {}, 2, "config file not found"),
    ("config-bad-toml", [*PLAN, "--config", "{badtoml}"], {}, 2, "not valid TOML"),
    ("config-bad-value", [*PLAN, "--config", "{family}"], {}, 2, "accepted values"),
    ("sglang-takeover-maybe-doctor", ["doctor", "--config", "{sglang}"], {}, 2, "[sglang] takeover: expected true"),
    ("sglang-takeover-maybe-plan", [*PLAN, "--config", "{sglang}"], {}, 2, "[sglang] takeover: expected true"),
    ("sglang-unknown-key", ["doctor", "--config", "{sglang_key}"], {}, 2, "accepted keys: ['takeover']"),
    ("vllm-indexer-sometimes", [*PLAN, "--config", "{vllm}"], {}, 2, "expected one of ['auto', 'on', 'off']"),
    ("vllm-unknown-key", ["doctor", "--config", "{vllm_key}"], {}, 2, "unknown keys ['bogus']"),
    ("env-family", ["doctor"], {"NSA_BACKEND_TOPK": "cuda"}, 2, "NSA_BACKEND_TOPK"),
    ("env-force-arch", [*PLAN], {"NSA_BACKEND_FORCE_ARCH": "sm70"}, 2, "NSA_BACKEND_FORCE_ARCH"),
    ("env-log-level", ["demo"], {"NSA_BACKEND_LOG_LEVEL": "loud"}, 2, "NSA_BACKEND_LOG_LEVEL"),
    ("env-sglang-takeover", ["doctor"], {"NSA_BACKEND_SGLANG_TAKEOVER": "maybe"}, 2,
     "NSA_BACKEND_SGLANG_TAKEOVER: expected true or false"),
    ("env-vllm-takeover", [*PLAN], {"NSA_BACKEND_VLLM_TAKEOVER": "ALL_OF_THEM"}, 2, "NSA_BACKEND_VLLM_TAKEOVER"),
    ("doctor-model-bogus", ["doctor", "--model", "bogus"], {}, 2, "--model bogus: model config 'bogus'"),
    ("doctor-tp-3", ["doctor", "--tp", "3"], {}, 2, "--tp 3: must divide the 128 attention heads"),
    ("doctor-tp-0", ["doctor", "--tp", "0"], {}, 2, "accepted values: 1, 2, 4"),
    ("doctor-tp-not-int", ["doctor", "--tp", "two"], {}, 2, "invalid int value: 'two'"),
    ("doctor-unknown-flag", ["doctor", "--gpu"], {}, 2, "unrecognized arguments: --gpu"),
    ("no-subcommand", [], {}, 2, "required: {doctor,plan,demo,bench}"),
    ("unknown-subcommand", ["serve"], {}, 2, "invalid choice: 'serve'"),
    ("plan-no-model", ["plan"], {}, 2, "the following arguments are required: --model"),
    ("plan-model-dir-without-config", ["plan", "--model", "{dir}"], {}, 2, "no such file"),
    ("plan-arch-unknown", [*PLAN, "--arch", "sm70"], {}, 2, "argument --arch: invalid choice: 'sm70'"),
    ("plan-kv-unknown", [*PLAN, "--kv-cache-dtype", "int4"], {}, 2, "invalid choice: 'int4'"),
    ("plan-tp-negative", [*PLAN, "--tp", "-2"], {}, 2, "--tp -2: must divide the 64 attention heads"),
    ("plan-impl-unknown", [*PLAN, "--decode-impl", "cutlass"], {}, 2, "--decode-impl cutlass: unknown value"),
    ("plan-next-n-0", [*PLAN, "--next-n", "0"], {}, 2, "--next-n 0: expected an integer from 1 to 4"),
    ("plan-next-n-100", [*PLAN, "--next-n", "100"], {}, 2, "--next-n 100: expected an integer from 1 to 4"),
    ("plan-natives-no-version", [*PLAN, "--assume-natives", "flashinfer"], {}, 2,
     "--assume-natives flashinfer: needs a version"),
    ("plan-natives-bad-version", [*PLAN, "--assume-natives", "flashinfer=abc"], {}, 2, "not a version number"),
    ("plan-natives-too-old", [*PLAN, "--assume-natives", "flashinfer=0.5.0"], {}, 2, "flashinfer >= 0.6.18"),
    ("plan-natives-unknown", [*PLAN, "--assume-natives", "cutlass=3"], {}, 2, "unknown package 'cutlass'"),
    ("plan-natives-twice", [*PLAN, "--assume-natives", "flash_mla,flash_mla"], {}, 2, "named twice"),
    # An implementation choice that cannot run keeps plan's documented status 1, on one line too.
    ("plan-triton-sparse-mla-128-heads", ["plan", "--model", "deepseek-v3.2", "--arch", "sm90", "--prefill-impl",
                                          "triton_sparse_mla"], {}, 1, "at most 32 attention heads per GPU"),
    ("plan-flashmla-on-sm120", [*PLAN, "--arch", "sm120", "--decode-impl", "flashmla_kv"], {}, 1,
     "Valid decode choices"),
    ("demo-device-tpu", ["demo", "--device", "tpu"], {}, 2, "--device tpu: unknown device; accepted values: cpu"),
    ("demo-device-cpu-index", ["demo", "--device", "cpu:1"], {}, 2, "--device cpu:1"),
    ("demo-heads-0", ["demo", "--heads", "0"], {}, 2, "--heads 0: expected an integer from 1 to 128"),
    ("demo-heads-129", ["demo", "--heads", "129"], {}, 2, "--heads 129"),
    ("demo-topk-0", ["demo", "--topk", "0"], {}, 2, "--topk 0: expected an integer from 1 to 96"),
    ("demo-topk-100000", ["demo", "--topk", "100000"], {}, 2, "--topk 100000"),
    ("demo-topk-over-tokens", ["demo", "--tokens", "8", "--topk", "16"], {}, 2, "at most --tokens"),
    ("demo-tokens-0", ["demo", "--tokens", "0"], {}, 2, "--tokens 0: expected an integer from 1"),
    ("demo-steps-negative", ["demo", "--steps", "-1"], {}, 2, "--steps -1: expected an integer from 0"),
    ("bench-ops-unknown", ["bench", "--ops", "attention"], {}, 2, "--ops: unknown family or op 'attention'"),
    ("bench-replot-missing", ["bench", "--replot", "/no/such/results"], {}, 2, "--replot /no/such/results"),
    ("bench-out-is-file", ["bench", "--ops", "topk", "--out", "{latin1}"], {}, 2, "is not a directory"),
]


def _fill(items, files):
    return [str(x).format(**{k: str(v) for k, v in files.items()}) for x in items]


@pytest.mark.parametrize(("argv", "env", "status", "text"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_one_error_line(argv, env, status, text, files, monkeypatch, capsys):
    for var, value in env.items():
        monkeypatch.setenv(var, _fill([value], files)[0])
    routing.reset_config()
    try:
        code = cli.main(_fill(argv, files))
    except SystemExit as exc:  # argparse's own checks exit, as argparse does
        code = exc.code
    assert code == status
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: ") and text in lines[0], lines[0]
    assert "Traceback" not in captured.err + captured.out
    # nothing is printed before the inputs are checked (no half report)
    assert captured.out == ""


SUBPROCESS = [["doctor", "--config", "{dir}"], ["demo", "--device", "tpu"],
              ["plan", "--model", "glm-5", "--next-n", "100"], ["plan", "--model", "glm-5", "--arch", "sm70"]]


@pytest.mark.parametrize("argv", SUBPROCESS, ids=["config-dir", "tpu", "next-n", "arch"])
def test_entry_point_subprocess(argv, files):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NSA_BACKEND_")}
    result = subprocess.run([sys.executable, "-m", "nsa_backend.cli", *_fill(argv, files)], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"nsa-backend {cli.version()}"
    assert cli.version()[0].isdigit()


def test_help_lists_every_arch_family(capsys):
    # the launcher's parser spells the families out (it imports no torch); they must stay equal
    assert tuple(cli.ARCH_FAMILIES) == ARCH_FAMILIES
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "--help"])
    assert info.value.code == 0
    assert "sm121" in capsys.readouterr().out


def test_plan_accepts_the_limits(capsys):
    """The bounds themselves pass: next_n 4, a versioned and an unversioned native, 32 heads per GPU."""
    args = ["plan", "--model", "deepseek-v3.2", "--arch", "sm90", "--tp", "4", "--prefill-impl", "triton_sparse_mla",
            "--next-n", "4", "--assume-natives", "flash_mla,deep_gemm=2.6.1"]
    assert cli.main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "next_n=4" in out and "framework:triton_sparse_mla" in out


def test_demo_runs_triton_in_the_interpreter(monkeypatch):
    """On CPU tensors with TRITON_INTERPRET=1 every demo op runs a Triton kernel, not the reference,
    and its float outputs differ from the reference by rounding only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    routing.reset_config()
    import torch

    records = run_demo(torch.device("cpu"), prefill_tokens=16, steps=1, heads=2, topk=8, requested="triton")
    assert {r["impl"] for r in records} == {"triton"}
    assert all(r["ok"] for r in records), records
    diffs = [float(r["agreement"].split()[1]) for r in records if r["agreement"].startswith("diff")]
    assert diffs and any(d > 0 for d in diffs), records


def test_demo_marks_reference_rows(monkeypatch):
    import torch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    routing.reset_config()
    records = run_demo(torch.device("cpu"), prefill_tokens=8, steps=1, heads=1, topk=4, requested="auto")
    assert {r["impl"] for r in records} == {"reference"}
    assert all(r["ok"] is None and "reference itself" in r["agreement"] for r in records)
