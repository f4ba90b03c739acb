"""Triton top-k selection and logical-to-global index translation against ``nsa_backend.reference``.

Top-k results are compared as sets: with distinct logits the selected set must equal the
reference's (recall 1.0); with ties, any choice among equal values is accepted, so the sorted
selected values must equal the reference's. Every row must hold exactly
``min(topk, valid columns)`` distinct in-window indices followed by ``-1``.

Every launch path is covered: the register-resident kernel (rows held in registers, long rows
chunk by chunk; 1- and 2-bit digits; selection written from registers or from tiles read again),
the sieve kernel (rows listed by a sampled bound or whole, one program per row or rows split
over parts, the radix select when the bound misses), the whole-row kernel (rows resolved in
registers, rows resolved from a sampled bound, and the streaming radix select taken when the
bound misses) and the four-launch split path (``topk`` above ``ROW_MAX_TOPK`` or a
``TopkConfig``).
"""

from __future__ import annotations

import os
import random
import textwrap

import pytest
import torch

import nsa_backend as nb
from nsa_backend import reference as ref
from tests.ops._aot import assert_rows_fit, run_aot_script

pytest.importorskip("triton")
kt = pytest.importorskip("nsa_backend.kernels.topk")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _check_topk(out, logits, topk, starts, ends, distinct, what=""):
    R, N = logits.shape
    want = ref.topk_indices(logits, topk, starts, ends)
    assert out.shape == (R, topk) and out.dtype == torch.int32, what
    dev = out.device
    lo = starts.long().clamp(min=0) if starts is not None else torch.zeros(R, dtype=torch.long, device=dev)
    hi = ends.long().clamp(max=N) if ends is not None else torch.full((R,), N, dtype=torch.long, device=dev)
    n_valid = (hi - lo).clamp(min=0)
    k_eff = n_valid.clamp(max=topk)
    got_valid = out >= 0
    assert torch.equal(got_valid.sum(1), k_eff), f"{what}: wrong number of indices"
    # valid entries first, then -1
    assert torch.equal(got_valid, torch.arange(topk, device=out.device)[None, :] < k_eff[:, None]), what
    idx = out.long().clamp(min=0)
    in_window = (idx >= lo[:, None]) & (idx < hi[:, None])
    assert bool((in_window | ~got_valid).all()), f"{what}: index out of window"
    srt = torch.where(got_valid, idx, N + torch.arange(topk, device=out.device)[None, :]).sort(1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), f"{what}: duplicate index"
    if distinct:
        a = torch.where(got_valid, out, -1).sort(1).values
        b = want.sort(1).values
        assert torch.equal(a, b), f"{what}: selected set differs (recall < 1)"
    else:
        ninf = torch.tensor(float("-inf"), device=out.device)
        va = torch.where(got_valid, logits.gather(1, idx), ninf)
        wv = want >= 0
        vb = torch.where(wv, logits.gather(1, want.long().clamp(min=0)), ninf)
        # NaN ranks above +inf (as in torch.topk); compare it as a finite sentinel
        va, vb = (torch.where(v.isnan(), torch.full_like(v, 3e38), v).sort(1).values for v in (va, vb))
        assert torch.equal(va, vb), f"{what}: selected values differ"


def _distinct_logits(R, N, device, gen=None):
    # distinct values: a random permutation of a grid, with both signs
    vals = torch.stack([torch.randperm(N, device=device, generator=gen) for _ in range(R)]).float()
    return (vals - N / 2) * 0.37


TOPK_CASES = [
    pytest.param(4, 300, 16, "none", True, id="R4-N300-k16"),
    pytest.param(3, 50, 64, "window", True, id="fewer-valid-than-k"),
    pytest.param(2, 5000, 100, "window", True, id="N5000-window"),
    pytest.param(3, 2000, 64, "ends", False, id="ties"),
    pytest.param(2, 600, 32, "ends", False, id="ties-with-inf"),
]


@pytest.mark.parametrize("R,N,topk,mode,distinct", TOPK_CASES)
def test_topk_indices(R, N, topk, mode, distinct):
    if distinct:
        logits = _distinct_logits(R, N, DEVICE)
    else:
        logits = torch.randint(-3, 4, (R, N), device=DEVICE).float()  # heavy ties
        if N == 600:  # -inf entries and one +inf
            logits[:, ::7] = float("-inf")
            logits[0, 5] = float("inf")
    starts = ends = None
    if mode == "window":
        starts = torch.randint(0, N // 2, (R,), dtype=torch.int32, device=DEVICE)
        ends = (starts + torch.randint(0, N, (R,), device=DEVICE)).int()
        starts[0], ends[0] = 10, 10  # an empty row
    elif mode == "ends":
        ends = torch.randint(0, N + 1, (R,), dtype=torch.int32, device=DEVICE)
        ends[-1] = N
    out = nb.topk_indices(logits, topk, starts, ends, impl="triton")
    _check_topk(out, logits, topk, starts, ends, distinct, what=mode)


def _case_logits(R, N, kind, gen=None):
    if kind == "distinct":
        return _distinct_logits(R, N, DEVICE, gen)
    logits = torch.randint(-3, 4, (R, N), device=DEVICE, generator=gen).float()  # heavy ties
    if kind == "special":  # -inf, +inf and NaN entries among ties
        logits[:, ::7] = float("-inf")
        logits[0, 5] = float("inf")
        logits[-1, 11] = float("nan")
        logits[-1, 40:45] = float("nan")
    return logits


def _case_window(R, N, mode, gen=None):
    starts = ends = None
    if mode in ("ends", "window"):
        ends = torch.randint(0, N + 1, (R,), dtype=torch.int32, device=DEVICE, generator=gen)
        ends[-1] = N
    if mode == "window":
        starts = (ends - torch.randint(0, N + 1, (R,), device=DEVICE, generator=gen)).clamp(min=0).int()
        starts[0], ends[0] = N // 3, N // 3  # an empty row
    return starts, ends


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("kind,mode", [("distinct", "window"), ("ties", "ends"), ("special", "none")])
def test_topk_row_sampled(monkeypatch, kind, mode, prefetch):
    # rows longer than the capacity: bound from a sample, one streaming pass, selection among the
    # keys above the bound (or the streaming radix select when too many keys tie above it)
    from nsa_backend.configs import topk as ct

    monkeypatch.setattr(ct, "ROW_MIN_CAPACITY", 256)
    R, N, topk = 5, 2500, 40
    logits = _case_logits(R, N, kind)
    starts, ends = _case_window(R, N, mode)
    if ends is not None:
        ends[1] = 30  # a row shorter than topk
    cfg = ct.RowConfig(64, 4, 1, prefetch=prefetch)
    out = kt.topk_indices_triton(logits, topk, starts, ends, config=cfg)
    _check_topk(out, logits, topk, starts, ends, kind == "distinct", what=f"{kind}-{mode}")


RESIDENT_CASES = [
    # (warps, capacity, tile of the second pass): rows held in registers whole, or chunked
    pytest.param((4, 0, 64), id="registers"),
    pytest.param((4, 0, 1024), id="registers-wide-tile"),
    pytest.param((4, 256, 64), id="chunked"),
    pytest.param((4, 128, 32), id="chunked-small-tile"),
]


@pytest.mark.parametrize("cfg", RESIDENT_CASES)
@pytest.mark.parametrize("kind,mode", [("distinct", "window"), ("ties", "ends"), ("special", "none")])
def test_topk_resident(cfg, kind, mode):
    # register-resident path: windows, rows shorter than topk, ties, -inf / +inf / NaN
    from nsa_backend.configs import topk as ct

    warps, cap, emit = cfg
    R, N, topk = 5, 700, 60
    logits = _case_logits(R, N, kind)
    starts, ends = _case_window(R, N, mode)
    if ends is not None:
        ends[1], ends[2] = 30, topk + 1  # a row shorter than topk, one just longer
    if kind == "ties":
        logits[2] = 0.0  # every key ties
    out = kt.topk_indices_triton(logits, topk, starts, ends, config=ct.ResidentConfig(warps, 1, cap, emit))
    _check_topk(out, logits, topk, starts, ends, kind == "distinct", what=f"{kind}-{mode}")


def test_topk_resident_constant_rows():
    # rows of one value (0, -inf, NaN): the threshold search runs through all 32 bits
    from nsa_backend.configs import topk as ct

    logits = torch.zeros(3, 300, device=DEVICE)
    logits[1] = float("-inf")
    logits[2] = float("nan")
    for cap in (0, 128):
        out = kt.topk_indices_triton(logits, 40, None, None, config=ct.ResidentConfig(4, 1, cap, 64))
        _check_topk(out, logits, 40, None, None, False, what=f"constant cap={cap}")


def test_topk_resident_routed(monkeypatch):
    # many short rows take the register-resident path through the public op (causal ends)
    from nsa_backend.configs import topk as ct

    monkeypatch.setattr(ct, "RESIDENT_MIN_ROWS", 32)  # fewer rows, for the interpreter
    R, N, topk = 40, 160, 24
    assert ct.use_resident_path(N, R, topk)
    logits = _distinct_logits(R, N, DEVICE)
    ends = (torch.arange(R, device=DEVICE) % N + 1).int()
    out = nb.topk_indices(logits, topk, None, ends, impl="triton")
    _check_topk(out, logits, topk, None, ends, True, what="routed")


@pytest.mark.parametrize("kind", ["distinct", "special"])
def test_topk_row_bound_missed(monkeypatch, kind):
    # a bound with fewer than topk keys above it: every long row takes the streaming radix select
    from nsa_backend.configs import topk as ct

    monkeypatch.setattr(ct, "ROW_MIN_CAPACITY", 256)
    monkeypatch.setattr(ct, "ROW_SIGMAS", -20.0)
    R, N, topk = 3, 1800, 50
    logits = _case_logits(R, N, kind)
    starts, ends = _case_window(R, N, "window")
    out = kt.topk_indices_triton(logits, topk, starts, ends, config=ct.RowConfig(128, 4, 1, prefetch=True))
    _check_topk(out, logits, topk, starts, ends, kind == "distinct", what=kind)


def test_topk_all_equal_rows():
    # every key ties: more than the capacity share the top key (streaming radix select), and
    # rows within the capacity resolve in registers
    R, N, topk = 3, 5000, 64
    logits = torch.zeros(R, N, device=DEVICE)
    ends = torch.tensor([N, 4000, 64], dtype=torch.int32, device=DEVICE)
    out = nb.topk_indices(logits, topk, None, ends, impl="triton")
    _check_topk(out, logits, topk, None, ends, False, what="all equal")


SIEVE_CASES = [
    # (tile, warps, programs per SM, sample, list length, parts per row, merging tile, merging warps)
    pytest.param((64, 1, 1, 64, 256, 1, 1024, 4), id="one-program"),
    pytest.param((32, 2, 2, 64, 256, 3, 64, 1), id="parts"),
]


@pytest.mark.parametrize("cfg", SIEVE_CASES)
@pytest.mark.parametrize("kind,mode", [("distinct", "window"), ("few-ties", "ends"), ("special", "none")])
def test_topk_sieve(cfg, kind, mode):
    # sieve kernel: rows longer than DIRECT sieved by a sampled bound into a list, shorter rows
    # listed whole, rows shorter than topk; one program per row or rows split over parts; special
    # values among heavy ties (more keys at the bound than the list holds: radix select)
    from nsa_backend.configs import topk as ct

    config = ct.SieveConfig(*cfg[:5], split=cfg[5], merge_block=cfg[6], merge_warps=cfg[7])
    R, N, topk = 4, 1000, 40
    assert ct.sieve_sizes(topk, config) == (256, 64, 128)
    if kind == "few-ties":  # each value about twice: ties at the threshold inside the list
        logits = torch.randint(-300, 300, (R, N), device=DEVICE).float()
    else:
        logits = _case_logits(R, N, kind)
    starts, ends = _case_window(R, N, mode)
    if ends is not None:
        ends[1], ends[2] = 30, 100  # shorter than topk; listed whole
    out = kt.topk_indices_triton(logits, topk, starts, ends, config=config)
    _check_topk(out, logits, topk, starts, ends, kind == "distinct", what=f"{kind}-{mode}")


@pytest.mark.parametrize("cfg", SIEVE_CASES)
def test_topk_sieve_bound_missed(monkeypatch, cfg):
    # a bound with fewer than topk keys above it, and rows of one value (more keys tie at the bound
    # than the list holds): the streaming radix select
    from nsa_backend.configs import topk as ct

    config = ct.SieveConfig(*cfg[:5], split=cfg[5], merge_block=cfg[6], merge_warps=cfg[7])
    R, N, topk = 3, 900, 30
    logits = _case_logits(R, N, "distinct")
    logits[1] = 2.0
    monkeypatch.setattr(ct, "ROW_SIGMAS", -20.0)
    out = kt.topk_indices_triton(logits, topk, None, None, config=config)
    _check_topk(out, logits, topk, None, None, False, what="missed")


@pytest.mark.parametrize("distinct", [True, False])
def test_topk_split_candidate_overflow(monkeypatch, distinct):
    # split path: a threshold bin larger than the candidate list makes the finish scan the row
    from nsa_backend.configs import topk as ct

    monkeypatch.setattr(ct, "MAX_CANDIDATES", 8)
    R, N, topk = 3, 3000, 50
    logits = _distinct_logits(R, N, DEVICE) * 1e-3 + 1.0 if distinct else \
        torch.randint(0, 3, (R, N), device=DEVICE).float()
    ends = torch.tensor([N, N - 7, 60], dtype=torch.int32, device=DEVICE)
    out = kt.topk_indices_triton(logits, topk, None, ends, config=ct.TopkConfig(1024, 4))
    _check_topk(out, logits, topk, None, ends, distinct, what="overflow")


def test_topk_path_choice():
    from nsa_backend.configs import topk as ct

    # prefill: register-resident up to RESIDENT_MAX_N columns, sieve above
    assert ct.use_resident_path(ct.RESIDENT_MAX_N, ct.RESIDENT_MIN_ROWS, 2048)
    assert not ct.use_resident_path(ct.RESIDENT_MAX_N + 1, 4096, 2048)
    assert ct.use_sieve_path(ct.RESIDENT_MAX_N + 1, ct.RESIDENT_MIN_ROWS, 2048)
    assert ct.use_sieve_path(65536, 4096, 2048) and not ct.use_row_path(65536, 4096, 2048)
    # decode: sieve for many rows, whole-row kernel for few or short rows, rows split over parts
    # when fewer rows than SMs are very long
    assert ct.use_sieve_path(8192, ct.SIEVE_MIN_ROWS, 2048)
    assert ct.use_row_path(8192, 128, 2048) and ct.use_row_path(ct.SIEVE_MIN_N, 256, 2048)
    assert ct.use_sieve_path(ct.SIEVE_SPLIT_MIN_N + 1, 1, 2048)
    assert ct.sieve_config(65536, 4096, 132) == ct.SIEVE_PREFILL_CONFIG
    assert ct.sieve_config(65536, 256, 132) == ct.SIEVE_DECODE_CONFIG
    assert ct.sieve_config(65536, 128, 132).split == 4 and ct.sieve_config(65536, 100, 132).split == 5
    assert ct.sieve_config(131072, 1, 132).split == ct.SIEVE_MAX_SPLIT
    # topk above ROW_MAX_TOPK: split path
    assert not ct.use_resident_path(4096, 4096, ct.ROW_MAX_TOPK + 1)
    assert not ct.use_sieve_path(65536, 4096, ct.ROW_MAX_TOPK + 1)
    assert not ct.use_row_path(4096, 1, ct.ROW_MAX_TOPK + 1)
    for max_n, cfg in ct.shipped_resident_configs():
        assert ct.resident_config(max_n, 4096) == cfg
        cap, fin = ct.resident_sizes(max_n, ct.ROW_MAX_TOPK, cfg)
        assert cap >= max_n and fin == 0 and cap // (32 * cfg.num_warps) <= 64  # keys per thread
    for cfg in ct.shipped_sieve_configs():
        assert ct.sieve_sizes(ct.ROW_MAX_TOPK, cfg) == (8192, 2048, 4096)


def test_topk_sieve_routed(monkeypatch):
    # the public op routes rows to the sieve kernel: one program per row, and rows split over parts
    from nsa_backend.configs import topk as ct

    small = ct.SieveConfig(64, 2, 1, 64, 256, list_block=128)
    monkeypatch.setattr(ct, "SIEVE_DECODE_CONFIG", small)
    monkeypatch.setattr(ct, "SIEVE_MIN_N", 200)
    monkeypatch.setattr(ct, "SIEVE_MIN_ROWS", 4)
    monkeypatch.setattr(ct, "SIEVE_SPLIT_MIN_N", 400)
    monkeypatch.setattr(ct, "SIEVE_PART_MIN_N", 128)
    for R, N in ((5, 300), (2, 700)):
        assert ct.use_sieve_path(N, R, 24)
        logits = _distinct_logits(R, N, DEVICE)
        ends = torch.full((R,), N, dtype=torch.int32, device=DEVICE)
        ends[0] = N - 11
        out = nb.topk_indices(logits, 24, None, ends, impl="triton")
        _check_topk(out, logits, 24, None, ends, True, what=f"R={R} N={N}")


def test_topk_split_path_large_topk():
    # topk above ROW_MAX_TOPK runs the four-launch path
    from nsa_backend.configs import topk as ct

    R, N = 2, 3000
    topk = ct.ROW_MAX_TOPK + 52
    logits = _case_logits(R, N, "special")
    starts, ends = _case_window(R, N, "window")
    out = nb.topk_indices(logits, topk, starts, ends, impl="triton")
    _check_topk(out, logits, topk, starts, ends, False, what="large topk")


def test_logical_to_global_indices():
    idx = torch.tensor([[0, 5, -1, 130, 64], [64, 3, 100, -7, 200]], dtype=torch.int32, device=DEVICE)
    table = torch.tensor([[2, 0, 5], [1, -1, 4]], dtype=torch.int32, device=DEVICE)
    req = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    for page in (64, 32):
        out = nb.logical_to_global_indices(idx, table, req, page, impl="triton")
        assert torch.equal(out, ref.logical_to_global_indices(idx, table, req, page))


_AOT_SCRIPT = textwrap.dedent("""
    import json, os
    os.environ.pop("TRITON_INTERPRET", None)
    from nsa_backend.kernels import aot
    from nsa_backend.kernels.aot_registry import shipped_jobs

    rows = []
    for job in shipped_jobs(aot.TARGET_ARCHS, ["topk"]):
        k = job.compile()
        rows.append([job.kind, job.arch, job.config, k.shared_bytes, k.shared_limit])
    print("AOT-ROWS " + json.dumps(rows))
""")


def test_aot_compile_all_archs():
    rows = run_aot_script(_AOT_SCRIPT, timeout=600, marker="AOT-ROWS ")
    assert_rows_fit(rows, {80, 86, 89, 90, 100, 120, 121})


# ----------------------------------------------------------------------------------------------
# GPU fuzz
# ----------------------------------------------------------------------------------------------

FUZZ_CASES = int(os.environ.get("NSA_FUZZ_CASES", "300"))


@pytest.mark.gpu
def test_fuzz_topk_indices_gpu():
    rng = random.Random(5)
    gen = torch.Generator(device="cuda").manual_seed(5)
    for case in range(FUZZ_CASES):
        topk = rng.choice([2048, 2048, 1024, 512, rng.randint(1, 3000)])
        big = rng.random() < 0.15
        N = rng.randint(0, 131072) if big else rng.randint(0, 9000)
        R = rng.randint(1, 4) if big else rng.randint(1, 40)
        distinct = rng.random() < 0.6
        if distinct:
            logits = _distinct_logits(R, N, "cuda", gen) if N else torch.empty(R, 0, device="cuda")
        else:
            logits = torch.randint(-rng.randint(1, 50), 50, (R, N), device="cuda", generator=gen).float()
            if N and rng.random() < 0.3:
                logits[:, :: rng.randint(2, 9)] = float("-inf")
        mode = rng.choice(["none", "ends", "window"])
        starts = ends = None
        if mode != "none":
            ends = torch.randint(0, N + 1, (R,), dtype=torch.int32, device="cuda", generator=gen)
        if mode == "window":
            starts = (ends - torch.randint(0, N + 1, (R,), device="cuda", generator=gen)).clamp(min=0).int()
        out = nb.topk_indices(logits, topk, starts, ends, impl="triton")
        _check_topk(out, logits, topk, starts, ends, distinct,
                    what=f"case {case}: R={R} N={N} topk={topk} mode={mode} distinct={distinct}")


def _many_rows(R: int, N: int, kind: str, gen: torch.Generator):
    """``(logits, starts, ends)`` on ``gen``'s device: ``"randn"`` rows, or ``"ties"`` rows (small
    integers, every fifth column ``-inf``, NaNs in row 1, row 2 all zero, row 3 all ``-inf``); the
    first half of the rows end causally (``N - R // 2 + i``), the others at random, with random
    window starts."""
    dev = gen.device
    if kind == "randn":
        logits = torch.randn(R, N, device=dev, generator=gen)
    else:
        logits = torch.randint(-20, 20, (R, N), device=dev, generator=gen).float()
        logits[:, ::5] = float("-inf")
        logits[1, 3:40] = float("nan")
        logits[2] = 0.0
        logits[3] = float("-inf")
    ends = torch.randint(0, N + 1, (R,), dtype=torch.int32, device=dev, generator=gen)
    ends[: R // 2] = N - R // 2 + torch.arange(R // 2, device=dev, dtype=torch.int32)
    starts = (ends - torch.randint(0, N + 1, (R,), device=dev, generator=gen)).clamp(min=0).int()
    return logits, starts, ends


@pytest.mark.gpu
@pytest.mark.parametrize("R,N,topk", [(1500, 9000, 2048), (1024, 32768, 2048), (1100, 40000, 2048),
                                      (600, 70000, 2048), (300, 20000, 512), (1200, 5000, 512),
                                      (100, 70000, 2048)])
def test_topk_many_rows_gpu(R, N, topk):
    # many rows: the register-resident path (>= RESIDENT_MIN_ROWS rows of <= RESIDENT_MAX_N
    # columns), the sieve path (one program per row, several rows per persistent program, rows
    # split over parts); windows, ties, -inf and NaN
    gen = torch.Generator(device="cuda").manual_seed(R + N)
    for kind in ("randn", "ties"):
        logits, starts, ends = _many_rows(R, N, kind, gen)
        starts[: R // 2] = 0
        out = nb.topk_indices(logits, topk, starts, ends, impl="triton")
        # selected values compared (float32 randn rows may hold equal values)
        _check_topk(out, logits, topk, starts, ends, False, what=f"{kind} R={R} N={N}")


def _resident_gpu_cases():
    from nsa_backend.configs import topk as ct

    cases = [(max_n, cfg) for max_n, cfg in ct.shipped_resident_configs()]
    cases.append((40000, ct.ResidentConfig(16, 1, 16384, 1024)))  # chunked rows
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("max_n,cfg", _resident_gpu_cases())
def test_topk_resident_gpu(max_n, cfg):
    # every shipped register-resident configuration (and chunked rows) on rows of its largest
    # length and of about half of it: windows, ties, -inf, NaN, rows shorter than topk
    gen = torch.Generator(device="cuda").manual_seed(max_n)
    for N in (max_n, max_n // 2 + 77):
        R = 96
        for kind in ("randn", "ties"):
            logits, starts, ends = _many_rows(R, N, kind, gen)
            for topk in (2048, 100):
                for s in (None, starts):
                    out = kt.topk_indices_triton(logits, topk, s, ends, config=cfg)
                    _check_topk(out, logits, topk, s, ends, False, what=f"{cfg} {kind} N={N} topk={topk}")


@pytest.mark.gpu
def test_fuzz_logical_to_global_gpu():
    rng = random.Random(11)
    for case in range(FUZZ_CASES):
        page = rng.choice([1, 16, 32, 64])
        B, M = rng.randint(1, 20), rng.randint(0, 50)
        R, K = rng.randint(1, 64), rng.choice([1, 512, 2048])
        table = torch.randint(-1, 10000, (B, M), dtype=torch.int32, device="cuda")
        idx = torch.randint(-2, max(M, 1) * page + 10, (R, K), dtype=torch.int32, device="cuda")
        req = torch.randint(0, B, (R,), dtype=torch.int32, device="cuda")
        out = nb.logical_to_global_indices(idx, table, req, page, impl="triton")
        assert torch.equal(out, ref.logical_to_global_indices(idx, table, req, page)), f"case {case}"
