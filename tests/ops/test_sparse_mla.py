"""Triton sparse MLA prefill and decode against ``nsa_backend.reference``.

CPU (interpreter): tiny shapes covering d_qk 576/512, head counts that are not powers of two,
invalid indices (-1, >= s_kv), attn_sink, topk_length, empty rows, both FP8 scale formats, the
integer e4m3 decode used on sm_80/86, split-K with merge, and spaced cache pages.
GPU: a seeded fuzz of 300 cases per op, the sm_90 tiles (indices read ahead, register caps) forced on
every head count, and CUDA-graph capture of decode.
AOT: every kernel x every shipped configuration compiled for sm_80 ... sm_121 within shared memory.
"""

from __future__ import annotations

import math
import os
import random
import textwrap

import pytest
import torch

from nsa_backend import reference as ref
from tests.ops._aot import run_aot_script

triton = pytest.importorskip("triton")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------
# Case builders (shared by the CPU tests and the GPU fuzz)
# ------------------------------------------------------------------------------------------------


def _invalid_mix(idx: torch.Tensor, limit: int, frac: float, gen: torch.Generator) -> torch.Tensor:
    """Replace a fraction of ``idx`` by -1, values >= limit and other negatives."""
    r = torch.rand(idx.shape, generator=gen)
    kind = torch.randint(0, 3, idx.shape, generator=gen)
    bad = torch.where(
        kind == 0,
        torch.full_like(idx, -1),
        torch.where(
            kind == 1,
            limit + torch.randint(0, 1000, idx.shape, generator=gen),
            -torch.randint(2, 1 << 30, idx.shape, generator=gen),
        ),
    ).to(idx.dtype)
    return torch.where(r < frac, bad, idx)


def prefill_case(
    s_q: int,
    h_q: int,
    d_qk: int,
    s_kv: int,
    topk: int,
    frac_invalid: float,
    sink: bool,
    topk_len: bool,
    seed: int,
    device: str = DEV,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h_q, d_qk, generator=g).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, generator=g).bfloat16()
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    idx = _invalid_mix(idx, s_kv, frac_invalid, g)
    if s_q > 1:
        idx[-1] = -1  # one row without a valid key
    args = dict(
        q=q,
        kv=kv,
        indices=idx,
        sm_scale=d_qk**-0.5,
        d_v=512,
        attn_sink=torch.randn(h_q, generator=g) * 2 if sink else None,
        topk_length=torch.randint(0, topk + 4, (s_q,), generator=g, dtype=torch.int32) if topk_len else None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def decode_case(
    B: int,
    s_q: int,
    h_q: int,
    topk: int,
    kv_format: str,
    scale_format: str,
    page: int,
    num_blocks: int,
    frac_invalid: float,
    sink: bool,
    topk_len: bool,
    pad_pages: bool,
    seed: int,
    d_qk: int = 576,
    device: str = DEV,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = num_blocks * page
    kv = torch.randn(n, d_qk, generator=g).bfloat16()
    if kv_format == "fp8_ds_mla":
        kv[: n // 3] *= 50.0  # wide dynamic range across tokens
        rows = ref.pack_fp8_ds_mla(kv, scale_format).view(num_blocks, page, 656)
    else:
        rows = kv.view(num_blocks, page, 1, d_qk)
    if pad_pages:  # pages spaced apart: stride(0) larger than one page
        big = torch.zeros(num_blocks, page + 3, *rows.shape[2:], dtype=rows.dtype)
        big[:, :page] = rows
        rows = big[:, :page]
    q = torch.randn(B, s_q, h_q, d_qk, generator=g).bfloat16()
    idx = torch.randint(0, n, (B, s_q, topk), generator=g, dtype=torch.int32)
    idx = _invalid_mix(idx, n, frac_invalid, g)
    if B * s_q > 1:
        idx[-1, -1] = -1
    args = dict(
        q=q,
        kv_cache=rows,
        indices=idx,
        sm_scale=d_qk**-0.5,
        d_v=512,
        kv_format=kv_format,
        attn_sink=torch.randn(h_q, generator=g) * 2 if sink else None,
        topk_length=torch.randint(0, topk + 4, (B,), generator=g, dtype=torch.int32) if topk_len else None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def _fp32_reference_prefill(a: dict) -> tuple[torch.Tensor, ...]:
    """fp32 reference outputs (before the bf16 cast of ``out``) and the probability-weighted ``|V|``."""
    s_kv = a["kv"].shape[0]
    idx = a["indices"][:, 0, :].long()
    valid = ref._topk_valid(idx, s_kv, a["topk_length"])
    k_rows = a["kv"][:, 0, :].float()[idx.clamp(0, s_kv - 1)]
    out, mx, lse = ref._sparse_attention(a["q"], k_rows, valid, a["sm_scale"], a["d_v"], a["attn_sink"])
    return out, mx, lse, _abs_weighted(a["q"], k_rows, valid, a["sm_scale"], a["d_v"])


def _fp32_reference_decode(a: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``out [B*s_q, h_q, d_v]``, ``lse [B, h_q, s_q]`` of the reference (no bf16 cast of ``out``) and
    the probability-weighted ``|V|`` of every output."""
    B, s_q, h_q, d_qk = a["q"].shape
    cache = a["kv_cache"]
    n = cache.shape[0] * cache.shape[1]
    idx = a["indices"].reshape(B * s_q, -1).long()
    tl_rows = a["topk_length"].long().repeat_interleave(s_q) if a["topk_length"] is not None else None
    valid = ref._topk_valid(idx, n, tl_rows)
    k_rows = ref._gather_cache_rows(cache, a["kv_format"], idx.clamp(0, n - 1), d_qk)
    qr = a["q"].reshape(B * s_q, h_q, d_qk)
    out, _, lse = ref._sparse_attention(qr, k_rows, valid, a["sm_scale"], a["d_v"], a["attn_sink"])
    return (
        out,
        lse.view(B, s_q, h_q).transpose(1, 2),
        _abs_weighted(qr, k_rows, valid, a["sm_scale"], a["d_v"]),
    )


def _abs_weighted(
    q: torch.Tensor, k_rows: torch.Tensor, valid: torch.Tensor, sm_scale: float, d_v: int
) -> torch.Tensor:
    """sum_n softmax(P)_n |V_n| per row and head: the scale of the rounding of bf16 probabilities."""
    p = torch.einsum("thd,tkd->thk", q.float(), k_rows) * sm_scale
    p = p.masked_fill(~valid[:, None, :], float("-inf"))
    w = torch.softmax(p, dim=-1).nan_to_num(0.0)
    return torch.einsum("thk,tkd->thd", w, k_rows[..., :d_v].abs())


def _check_out(
    name: str, out: torch.Tensor, want: torch.Tensor, case: str, abs_weighted: torch.Tensor | None = None
) -> float:
    """bf16 tolerance against the fp32 reference: |d| <= 2^-7 (|want| + 1 + sum_n p_n |v_n|): about one
    bf16 ulp of the result plus the rounding of the bf16 probabilities fed to the P @ V product."""
    assert out.dtype == torch.bfloat16, case
    assert not torch.isnan(out).any(), f"{name}: NaN, {case}"
    err = (out.float() - want.float()).abs()
    bound = (want.float().abs() + 1) * 2**-7
    if abs_weighted is not None:
        bound = bound + abs_weighted * 2**-7
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert worst <= 0, f"{name}: max abs err {err.max().item():.3e} over bound, {case}"
    return err.max().item() if err.numel() else 0.0


def _check_stat(name: str, got: torch.Tensor, want: torch.Tensor, case: str, tol: float = 2e-4) -> None:
    """Same infinities; finite values within ``tol`` (absolute + relative)."""
    inf_g, inf_w = torch.isinf(got), torch.isinf(want)
    assert torch.equal(inf_g, inf_w) and torch.equal(got[inf_g], want[inf_w]), f"{name}: inf pattern, {case}"
    fin = ~inf_w
    if fin.any():
        d = (got[fin] - want[fin]).abs().max().item()
        scale = want[fin].abs().max().item()
        assert d <= tol * (1 + scale), f"{name}: max err {d:.3e}, {case}"


def run_prefill_case(a: dict, case: str, prefill=None, **kw) -> float:
    """Run ``prefill`` (default: ``flash_mla_sparse_fwd_triton``) on case ``a`` with ``kw``; check it against the
    fp32 reference and return the largest ``out`` error."""
    if prefill is None:
        from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton as prefill

    out, mx, lse = prefill(**a, **kw)
    r_out, r_mx, r_lse, r_abs = _fp32_reference_prefill(a)
    err = _check_out("out", out, r_out, case, r_abs)
    _check_stat("lse", lse, r_lse, case)
    _check_stat("max_logits", mx, r_mx, case)
    return err


def run_decode_case(a: dict, case: str, decode=None, **kw) -> float:
    """Run ``decode`` (default: ``sparse_mla_decode_triton``) on case ``a`` with ``kw``; check it against
    the fp32 reference and return the largest ``out`` error."""
    if decode is None:
        from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton as decode

    out, lse = decode(**a, **kw)
    r_out, r_lse, r_abs = _fp32_reference_decode(a)
    err = _check_out("out", out.view(r_out.shape), r_out, case, r_abs)
    _check_stat("lse", lse, r_lse, case)
    return err


# ------------------------------------------------------------------------------------------------
# CPU interpreter tests
# ------------------------------------------------------------------------------------------------

PREFILL_CPU = [
    pytest.param(
        dict(s_q=3, h_q=3, d_qk=576, s_kv=40, topk=40, frac_invalid=0.3, sink=False, topk_len=False),
        id="d576-h3-invalid",
    ),
    pytest.param(
        dict(s_q=2, h_q=20, d_qk=512, s_kv=33, topk=24, frac_invalid=0.2, sink=True, topk_len=True),
        id="d512-h20-sink-topklen",
    ),
    pytest.param(
        dict(s_q=2, h_q=1, d_qk=576, s_kv=9, topk=17, frac_invalid=0.0, sink=True, topk_len=False),
        id="d576-h1-sink",
    ),
]


@pytest.mark.parametrize("kw", PREFILL_CPU)
def test_prefill_matches_reference(kw):
    a = prefill_case(seed=1, **kw)
    run_prefill_case(a, str(kw))


@pytest.mark.parametrize("flags", [dict(idx_ahead=True)], ids=["idx_ahead"])
def test_prefill_launch_options_match_reference(flags):
    """Indices read one iteration ahead: a partial last tile, topk_length and invalid keys."""
    from nsa_backend.configs.sparse_mla import AttnConfig
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

    a = prefill_case(3, 18, 576, 50, 45, 0.3, True, True, seed=4)
    out, mx, lse = flash_mla_sparse_fwd_triton(**a, config=AttnConfig(16, 16, 4, 1, **flags))
    r_out, r_mx, r_lse, r_abs = _fp32_reference_prefill(a)
    _check_out("out", out, r_out, str(flags), r_abs)
    _check_stat("lse", lse, r_lse, str(flags))
    _check_stat("max_logits", mx, r_mx, str(flags))


def test_prefill_empty_rows():
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

    a = prefill_case(2, 2, 576, 8, 16, 0.0, True, False, seed=3)
    a["indices"][:] = -1
    a["indices"][1, 0, 3] = 8  # == s_kv: invalid too
    out, mx, lse = flash_mla_sparse_fwd_triton(**a)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.isposinf(lse).all() and torch.isneginf(mx).all()


# decode_case arguments shared by the CPU cases; each case lists what it changes.
DECODE_DEFAULTS = dict(
    B=2,
    s_q=1,
    h_q=3,
    topk=40,
    kv_format="fp8_ds_mla",
    scale_format="arbitrary",
    page=16,
    num_blocks=3,
    frac_invalid=0.3,
    sink=False,
    topk_len=False,
    pad_pages=False,
)


def _decode_param(case_id: str, launch: dict, **changes):
    return pytest.param({**DECODE_DEFAULTS, **changes}, launch, id=case_id)


DECODE_CPU = [
    _decode_param("fp8-pow2-mtp2-nosplit", dict(num_splits=1), s_q=2, scale_format="pow2"),
    _decode_param(
        "fp8-arbitrary-mtp3-split3-sink-topklen-padded",
        dict(num_splits=3),
        s_q=3, h_q=5, topk=48, num_blocks=4, frac_invalid=0.2, sink=True, topk_len=True, pad_pages=True,
    ),
    _decode_param(
        "fp8-integer-decode-h17-split2",
        dict(num_splits=2, native_fp8=False),
        B=1, h_q=17, topk=33, page=8, num_blocks=5, frac_invalid=0.1, sink=True,
    ),
    _decode_param(
        "fp8-idx-ahead-mtp2-split3-sink-topklen",
        dict(num_splits=3, config=("idx_ahead",)),
        s_q=2, h_q=5, topk=57, num_blocks=4, frac_invalid=0.2, sink=True, topk_len=True, pad_pages=True,
    ),
    # the two ways of reading the fp8 keys for P V (share_keys: converted once into shared memory; reread_keys:
    # the bytes read and converted again), native and integer e4m3
    *(param
      for flag in ("share_keys", "reread_keys")
      for param in (
          _decode_param(
              f"fp8-{flag.replace('_', '-')}-mtp2-split3-sink-topklen",
              dict(num_splits=3, config=(flag,)),
              s_q=2, h_q=5, topk=57, num_blocks=4, frac_invalid=0.2, sink=True, topk_len=True, pad_pages=True,
          ),
          _decode_param(
              f"fp8-integer-{flag.replace('_', '-')}-split2",
              dict(num_splits=2, native_fp8=False, config=(flag,)),
              B=1, h_q=17, topk=33, page=8, num_blocks=5, frac_invalid=0.1, sink=True,
          ),
      )),
    # kv_scale_format="pow2" where the integer dequantisation of power-of-two scales is taken (the interpreter runs
    # the general conversion in its place; tests/ops/test_sparse_mla_decode_gluon.py checks its bits)
    _decode_param(
        "fp8-pow2-integer-reread-keys-split2",
        dict(num_splits=2, native_fp8=False, kv_scale_format="pow2", config=("reread_keys",)),
        s_q=2, h_q=6, topk=45, num_blocks=4, frac_invalid=0.25, sink=True, topk_len=True, scale_format="pow2",
    ),
    _decode_param(
        "fp8-integer-split2-sink-topklen",
        dict(num_splits=2, native_fp8=False),
        s_q=2, h_q=6, topk=45, num_blocks=4, frac_invalid=0.25, sink=True, topk_len=True, pad_pages=True,
    ),
    _decode_param(
        "bf16-split2",
        dict(num_splits=2),
        h_q=4, topk=30, kv_format="bf16", scale_format="pow2", num_blocks=2, topk_len=True,
    ),
    _decode_param(
        "bf16-split2-padded",
        dict(num_splits=2),
        h_q=2, topk=24, kv_format="bf16", scale_format="pow2", num_blocks=2, sink=True, topk_len=True,
        pad_pages=True,
    ),
]


@pytest.mark.parametrize("kw, launch", DECODE_CPU)
def test_decode_matches_reference(kw, launch):
    from nsa_backend.configs.sparse_mla import AttnConfig

    launch = dict(launch)
    flags = launch.pop("config", ())
    cfg = AttnConfig(16, 16, 4, 1, idx_ahead="idx_ahead" in flags, share_keys="share_keys" in flags,
                     reread_keys="reread_keys" in flags)
    a = decode_case(seed=2, **kw)
    run_decode_case(a, str(kw), config=cfg, **launch)


def test_pow2_dequant_replaces_the_integer_e4m3_decoding():
    """The power-of-two dequantisation is taken for ``kv_scale_format="pow2"`` on the archs that decode e4m3 with
    integer operations; archs with an fp8 unit keep it (measured no faster there), and other scale formats never
    take it."""
    from nsa_backend.configs.sparse_mla import pow2_dequant

    assert pow2_dequant("pow2", fp8_unit=False)
    assert not pow2_dequant("pow2", fp8_unit=True)
    assert not pow2_dequant("arbitrary", fp8_unit=False) and not pow2_dequant(None, fp8_unit=False)


def test_share_and_reread_keys_exclude_each_other():
    from nsa_backend.configs.sparse_mla import AttnConfig

    with pytest.raises(ValueError, match="share_keys / reread_keys: a configuration takes at most one of them"):
        AttnConfig(32, 32, 4, 1, share_keys=True, reread_keys=True)


def test_merge_block_d_rule():
    """Whole-row merge programs while they fill the GPU, narrower slices for few rows, always a slice that
    divides the output width."""
    from nsa_backend.configs.sparse_mla import MERGE_BLOCK_D_CHOICES, merge_block_d

    assert merge_block_d(264, 512, 132) == 512
    assert merge_block_d(132, 512, 132) == 512
    assert merge_block_d(66, 512, 132) == 256
    assert merge_block_d(64, 512, 132) == 128
    assert merge_block_d(32, 512, 132) == 64
    assert merge_block_d(1, 512, 132) == MERGE_BLOCK_D_CHOICES[-1]
    assert merge_block_d(1, 96, 132) == 96  # no choice divides 96: the full width
    for programs in (1, 7, 40, 300):
        for d_v in (64, 128, 256, 512):
            assert d_v % merge_block_d(programs, d_v, 132) == 0


def _merge_reference(part_o, part_lse, sink):
    """fp32 torch merge: ``part_lse`` is base 2; natural-log ``lse``, ``+inf`` and zeros for rows whose
    splits are all empty; the sink scales the output by ``1 / (1 + exp(sink - lse))``."""
    m = part_lse.amax(dim=1, keepdim=True)
    empty = torch.isinf(m) & (m < 0)
    w = torch.exp2(part_lse - torch.where(empty, 0.0, m))  # [R, S, h]
    total = w.sum(dim=1)  # [R, h]
    out = (w.unsqueeze(-1) * part_o).sum(dim=1) / torch.where(empty[:, 0], 1.0, total).unsqueeze(-1)
    lse2 = torch.where(empty[:, 0], 0.0, m[:, 0]) + torch.log2(torch.where(empty[:, 0], 1.0, total))
    lse = torch.where(empty[:, 0], float("inf"), lse2 * math.log(2.0))
    if sink is not None:
        out = out / (1.0 + torch.exp(sink - torch.where(empty[:, 0], 0.0, lse))).unsqueeze(-1)
    return out, lse


def test_merge_pdl_follows_the_gpu_itself(monkeypatch):
    """The merge is a programmatic dependent launch only on a GPU that has the wait instruction (sm_90 on,
    by its own capability even when routing is forced to another arch), never in the interpreter or off
    CUDA."""
    from nsa_backend.kernels.sparse_mla_decode import merge as dec

    assert not dec.merge_pdl(torch.device("cpu"))
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", "sm120")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for cap, want in ((86, False), (89, False), (90, True), (120, True)):
        monkeypatch.setattr(dec, "device_capability", lambda d, cap=cap: cap)
        assert dec.merge_pdl(cuda) is (want and dec.gdc_wait is not None), cap
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not dec.merge_pdl(cuda)


@pytest.mark.parametrize("splits", [2, 3, 7, 9, 20])
@pytest.mark.parametrize("min_per_sm", [1, 64], ids=["default-slices", "narrowest-slices"])
@pytest.mark.parametrize("sink", [False, True], ids=["no-sink", "sink"])
def test_merge_splits_matches_reference(monkeypatch, splits, min_per_sm, sink):
    """The split merge of the decode kernels, whole rows or in column slices (more programs than rows),
    with empty splits and heads of a row without any valid slot."""
    from nsa_backend.configs import sparse_mla as cfgs
    from nsa_backend.kernels import sparse_mla_decode as dec

    monkeypatch.setattr(cfgs, "MERGE_MIN_PROGRAMS_PER_SM", min_per_sm)
    g = torch.Generator().manual_seed(3)
    B, s_q, h_q, d_v = 2, 2, 20, 512
    R = B * s_q
    part_o = torch.randn(R, splits, h_q, d_v, generator=g)
    part_lse = torch.randn(R, splits, h_q, generator=g) * 4
    part_lse[0, 1] = float("-inf")  # one empty split
    part_lse[2, : splits // 2 + 1] = float("-inf")  # the first splits of a row empty (the running max starts late)
    part_lse[1, :, 3] = float("-inf")  # a head of a row without any valid slot
    part_o[1, :, 3] = 0.0
    attn_sink = torch.randn(h_q, generator=g) if sink else None
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16)
    lse = torch.empty(B, h_q, s_q)
    dec.merge_splits(part_o, part_lse, attn_sink, out, lse)
    want_o, want_lse = _merge_reference(part_o, part_lse, attn_sink)
    torch.testing.assert_close(out.float().view(R, h_q, d_v), want_o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.permute(0, 2, 1).reshape(R, h_q), want_lse, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[0, 3, 1]) and lse[0, 3, 1] > 0 and out[0, 1, 3].abs().max() == 0


def test_decode_plan_is_shape_only():
    from nsa_backend.kernels.sparse_mla_decode import decode_plan

    dev = torch.device("cpu")
    cfg, splits, per = decode_plan(32, 1, 128, 2048, "fp8_ds_mla", dev)
    assert splits * per >= 2048 and per % cfg.block_n == 0
    assert decode_plan(32, 1, 128, 2048, "fp8_ds_mla", dev) == (cfg, splits, per)
    assert decode_plan(1, 1, 16, 16, "bf16", dev)[1] == 1


# ------------------------------------------------------------------------------------------------
# Ahead-of-time compile for every target architecture
# ------------------------------------------------------------------------------------------------

_AOT_SCRIPT = textwrap.dedent("""
    import json, sys
    from concurrent.futures import ProcessPoolExecutor

    def job(item):
        from nsa_backend.kernels.aot_registry import sparse_mla_jobs
        arch, i = item
        j = sparse_mla_jobs(arch)[i]
        r = j.compile()
        return [arch, j.kind, j.config, r.shared_bytes, r.fits]

    if __name__ == "__main__":
        from nsa_backend.kernels.aot_registry import sparse_mla_jobs
        archs = [int(a) for a in sys.argv[1].split(",")]
        items = [(arch, i) for arch in archs for i in range(len(sparse_mla_jobs(arch)))]
        with ProcessPoolExecutor(int(sys.argv[2])) as ex:
            print(json.dumps(list(ex.map(job, items))))
""")


def _aot(archs: list[int]) -> list:
    return run_aot_script(_AOT_SCRIPT, ",".join(map(str, archs)), str(os.cpu_count() or 2), timeout=900,
                          env={"TRITON_DEFAULT_FP_FUSION": "1"})


@pytest.mark.slow
def test_aot_all_archs_fit_shared_memory():
    from nsa_backend.kernels.aot import TARGET_ARCHS

    rows = _aot(list(TARGET_ARCHS))
    bad = [r for r in rows if not r[-1]]
    assert not bad, f"over the shared-memory limit: {bad}"
    assert {r[0] for r in rows} == set(TARGET_ARCHS)


def test_aot_smallest_budget_fits():
    """sm_120 (99 KiB of shared memory): every shipped configuration compiles and fits."""
    rows = _aot([120])
    bad = [r for r in rows if not r[-1]]
    assert not bad, f"over the shared-memory limit: {bad}"


# ------------------------------------------------------------------------------------------------
# GPU fuzz
# ------------------------------------------------------------------------------------------------

HEADS = (1, 16, 24, 64, 128)


def prefill_fuzz_cases(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        topk = rnd.choice([16, 64, 100, 512, 1024, 2048, 2048, 8192 if i % 25 == 0 else 640])
        flags = rnd.random() < 0.5
        cases.append(
            dict(
                s_q=rnd.randint(1, 4),
                h_q=rnd.choice(HEADS),
                d_qk=rnd.choice([576, 576, 512]),
                s_kv=rnd.randint(1, 4096),
                topk=topk,
                frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
                sink=flags,
                topk_len=flags,
                seed=i,
            )
        )
    return cases


def decode_fuzz_cases(n: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    cases = []
    for i in range(n):
        flags = rnd.random() < 0.5
        fmt = rnd.choice(["fp8_ds_mla", "fp8_ds_mla", "bf16"])
        page = rnd.choice([64, 64, 32])
        cases.append(
            dict(
                B=rnd.randint(1, 4),
                s_q=rnd.randint(1, 4),
                h_q=rnd.choice(HEADS),
                topk=rnd.choice([64, 128, 500, 1024, 2048]),
                kv_format=fmt,
                scale_format=rnd.choice(["pow2", "arbitrary"]),
                page=page,
                num_blocks=rnd.randint(1, 40),
                frac_invalid=rnd.choice([0.0, 0.1, 0.5, 0.95]),
                sink=flags,
                topk_len=flags,
                pad_pages=rnd.random() < 0.3,
                seed=i,
            )
        )
    return cases


# The GPU fuzz runs as shards of its 300 cases, so pytest-xdist spreads them.
FUZZ_SHARDS = 4


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_prefill_gpu_fuzz(shard):
    errs = [run_prefill_case(prefill_case(**c), str(c)) for c in prefill_fuzz_cases(300)[shard::FUZZ_SHARDS]]
    print(f"prefill fuzz shard {shard}: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
@pytest.mark.parametrize("shard", range(FUZZ_SHARDS))
def test_decode_gpu_fuzz(shard):
    rnd = random.Random(1)
    errs = []
    for i, c in enumerate(decode_fuzz_cases(300)):
        launch = {"num_splits": rnd.choice([None, None, 1])}
        if c["kv_format"] == "fp8_ds_mla" and c["scale_format"] == "pow2" and i % 2 == 0:
            launch["kv_scale_format"] = "pow2"  # the integer dequantisation of power-of-two scales
        if i % FUZZ_SHARDS == shard:
            errs.append(run_decode_case(decode_case(**c), str(c) + str(launch), **launch))
    print(f"decode fuzz shard {shard}: {len(errs)} cases, max abs err {max(errs):.3e}")


@pytest.mark.gpu
def test_decode_integer_fp8_path_gpu():
    for i, h in enumerate(HEADS):
        c = dict(DECODE_DEFAULTS, s_q=2, h_q=h, topk=512, page=64, num_blocks=20, frac_invalid=0.1, sink=True,
                 topk_len=True, seed=100 + i)
        run_decode_case(decode_case(**c), str(c), native_fp8=False)


@pytest.mark.gpu
def test_idx_ahead_and_register_cap_gpu():
    """The sm_90 tiles (indices read ahead, register caps) and the 32-head tile on every head count, whatever
    routing picks."""
    from nsa_backend.configs.sparse_mla import AttnConfig
    from nsa_backend.kernels.sparse_mla_prefill import flash_mla_sparse_fwd_triton

    rnd = random.Random(5)
    dec_cfgs = [AttnConfig(16, 32, 4, 4, idx_ahead=True), AttnConfig(32, 32, 4, 3, idx_ahead=True),
                AttnConfig(32, 32, 4, 2)]
    pre_cfgs = [AttnConfig(16, 32, 4, 3, maxnreg=128), AttnConfig(32, 64, 8, 2, maxnreg=128),
                AttnConfig(16, 32, 4, 3, idx_ahead=True), AttnConfig(32, 32, 4, 2)]
    for i, c in enumerate(decode_fuzz_cases(8, seed=11)):
        cfg = dec_cfgs[i % len(dec_cfgs)]
        launch = {"config": cfg, "num_splits": rnd.choice([None, 1, 3])}
        run_decode_case(decode_case(**c), str(c) + str(launch), **launch)
    for i, c in enumerate(prefill_fuzz_cases(6, seed=12)):
        cfg = pre_cfgs[i % len(pre_cfgs)]
        a = prefill_case(**c)
        out, mx, lse = flash_mla_sparse_fwd_triton(**a, config=cfg)
        r_out, r_mx, r_lse, r_abs = _fp32_reference_prefill(a)
        _check_out("out", out, r_out, str(c) + str(cfg), r_abs)
        _check_stat("lse", lse, r_lse, str(c) + str(cfg))
        _check_stat("max_logits", mx, r_mx, str(c) + str(cfg))


@pytest.mark.gpu
def test_decode_pow2_scales_give_the_same_numbers_gpu():
    """``kv_scale_format="pow2"`` (integer dequantisation, one bf16 product per pair of keys) gives the bits of the
    general path on caches with power-of-two scales, on every tile the tables use and through both e4m3 decodings:
    every byte value but NaN, scales from 2^-30 to 2^7, invalid and masked keys."""
    from nsa_backend.configs.sparse_mla import AttnConfig
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

    cfgs = [None, AttnConfig(16, 16, 4, 2, share_keys=True), AttnConfig(32, 64, 4, 1, reread_keys=True),
            AttnConfig(32, 32, 4, 2), AttnConfig(16, 32, 4, 4, idx_ahead=True)]
    g = torch.Generator().manual_seed(3)
    for i, cfg in enumerate(cfgs):
        a = decode_case(3, 2, 32, 512, "fp8_ds_mla", "pow2", 64, 20, 0.1, True, True, False, seed=40 + i)
        rows = a["kv_cache"].view(-1, 656)
        latent = torch.randint(0, 256, (rows.shape[0], 512), generator=g, dtype=torch.uint8)
        latent[(latent & 0x7F) == 0x7F] = 0x00  # e4m3 NaN
        latent[0] = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8).repeat(3)[:512]
        scales = torch.exp2(torch.randint(-30, 8, (rows.shape[0], 4), generator=g).float())
        rows[:, :512] = latent.to(rows.device)
        rows[:, 512:528] = scales.view(torch.uint8).view(-1, 16).to(rows.device)
        for native in (None, False):
            want = sparse_mla_decode_triton(**a, config=cfg, native_fp8=native)
            got = sparse_mla_decode_triton(**a, kv_scale_format="pow2", config=cfg, native_fp8=native)
            for name, x, y in (("out", got[0], want[0]), ("lse", got[1], want[1])):
                assert torch.equal(x, y), (name, cfg, native, (x.float() - y.float()).abs().max().item())


@pytest.mark.gpu
def test_decode_cuda_graph_capture():
    from nsa_backend.kernels.sparse_mla_decode import sparse_mla_decode_triton

    a = decode_case(4, 2, 16, 2048, "fp8_ds_mla", "pow2", 64, 64, 0.1, True, True, False, seed=7)
    sparse_mla_decode_triton(**a)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        g_out, g_lse = sparse_mla_decode_triton(**a)
    a["q"].copy_(torch.randn_like(a["q"]))
    g.replay()
    torch.cuda.synchronize()
    want_out, want_lse = sparse_mla_decode_triton(**a)
    assert torch.equal(g_out, want_out) and torch.equal(g_lse, want_lse)
