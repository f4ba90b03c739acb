"""``nsa_backend.reference`` against the loop-level implementations in ``tests/ops/naive.py``.

The naive versions are written from the op contracts, compute in float64 with explicit loops and
decode/encode every number format from its bits, so they share no code with the references. All
calls go through the public ops with ``impl="reference"`` so the validation path runs as well.
Shapes are tiny (Python loops); the head counts and head dims are the ones the models use.
"""

from __future__ import annotations

import itertools
import math
import struct

import pytest
import torch

import nsa_backend as nb
from tests.ops import naive

FP8 = torch.float8_e4m3fn
REF = "reference"
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------

def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, what: str,
                 compare: torch.Tensor | None = None) -> None:
    """Infinities must match exactly; finite entries within ``atol + rtol * |expected|``.

    ``compare`` (bool, same shape) restricts the check to the selected entries.
    """
    a = actual.double()
    e = expected.double()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    if compare is not None:
        a, e = a[compare], e[compare]
    assert not bool(torch.isnan(a).any()), f"{what}: NaN at {torch.isnan(a).nonzero()[:5].tolist()}"
    for sign in (1, -1):
        ia, ie = a == sign * math.inf, e == sign * math.inf
        bad = (ia != ie).nonzero()
        assert bad.numel() == 0, f"{what}: {'+' if sign > 0 else '-'}inf mask differs at {bad[:5].tolist()}"
    fin = torch.isfinite(e)
    err = (a[fin] - e[fin]).abs()
    bound = atol + rtol * e[fin].abs()
    if err.numel():
        worst = int((err - bound).argmax())
        assert bool((err <= bound).all()), (f"{what}: |diff| {err[worst]:.3g} > bound {bound[worst]:.3g} "
                                            f"(actual {a[fin][worst]:.6g}, expected {e[fin][worst]:.6g})")


def finite_max(t: torch.Tensor) -> float:
    f = t[torch.isfinite(t)]
    return float(f.abs().max()) if f.numel() else 1.0


def fp8(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(FP8)


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def bytes_tensor(buf: bytes | bytearray) -> torch.Tensor:
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8).clone()


def random_bytes(n: int) -> bytes:
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).tolist())


# ----------------------------------------------------------------------------------------------
# Number formats of the naive module (self-check against torch casts)
# ----------------------------------------------------------------------------------------------

def test_naive_number_formats():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    torch_vals = codes.view(FP8).float().tolist()
    for c, v in enumerate(torch_vals):
        assert (math.isnan(v) and math.isnan(naive.E4M3[c])) or v == naive.E4M3[c], c
    edges = torch.tensor([0.0, -0.0, 448.0, -448.0])
    x = torch.cat([torch.randn(4000) * 100, torch.randn(2000) * 1e-2, edges])
    x = x.clamp(-448, 448)
    want = x.to(FP8).view(torch.uint8).tolist()
    got = [naive.e4m3_encode(v) for v in x.tolist()]
    assert got == want
    y = torch.randn(3000) * 1e3
    assert [naive.bf16_from_f32_bits(v) for v in y.tolist()] == \
        [b & 0xFFFF for b in y.bfloat16().view(torch.int16).tolist()]


# ----------------------------------------------------------------------------------------------
# fp8_mqa_logits (ragged prefill)
# ----------------------------------------------------------------------------------------------

def _windows(S: int, N: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random half-open windows plus the edge cases: full, empty, empty at N, single key."""
    ks = torch.randint(0, N + 1, (S,))
    ke = torch.minimum(ks + torch.randint(0, N + 1, (S,)), torch.tensor(N))
    fixed = [(0, N), (N // 2, N // 2), (N, N), (N - 1, N)]
    for i, (a, b) in enumerate(fixed[:max(S - 1, 0)]):
        ks[i + 1], ke[i + 1] = a, b
    return ks.int(), ke.int()


MQA_CASES = [
    # S, H, D, N, clean_logits, max_seqlen_k
    pytest.param(5, 4, 64, 40, True, 0, id="S5-H4-D64-N40-clean"),
    pytest.param(3, 1, 128, 17, True, 0, id="S3-H1-D128-N17-clean"),
    pytest.param(3, 24, 128, 12, False, 0, id="S3-H24-D128-N12-unclean"),
    pytest.param(2, 32, 64, 20, True, 0, id="S2-H32-D64-N20-clean"),
    pytest.param(2, 64, 64, 11, False, 0, id="S2-H64-D64-N11-unclean"),
    pytest.param(2, 128, 64, 6, True, 0, id="S2-H128-D64-N6-clean"),
    pytest.param(3, 4, 128, 30, False, 30, id="S3-H4-D128-N30-compressed-exact"),
    pytest.param(3, 32, 64, 13, False, 20, id="S3-H32-D64-N13-compressed-wide"),
]


@pytest.mark.parametrize("S, H, D, N, clean, max_seqlen_k", MQA_CASES)
def test_fp8_mqa_logits(S, H, D, N, clean, max_seqlen_k):
    q = fp8(S, H, D, scale=2.0)
    k = fp8(N, D, scale=2.0)
    k_scale = torch.rand(N) * 0.05 + 1e-3
    weights = torch.randn(S, H)
    ks, ke = _windows(S, N)
    out = nb.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, clean_logits=clean, max_seqlen_k=max_seqlen_k,
                            impl=REF)
    want = naive.fp8_mqa_logits(q, (k, k_scale), weights, ks, ke, max_seqlen_k)
    cols = max_seqlen_k if max_seqlen_k > 0 else N
    assert out.dtype == torch.float32 and out.shape == (S, cols)
    j = torch.arange(cols)[None, :]
    if max_seqlen_k > 0:
        inside = j < (ke - ks).long()[:, None]
    else:
        inside = (j >= ks.long()[:, None]) & (j < ke.long()[:, None])
    tol = 2e-5 * finite_max(want)
    assert_close(out, want, rtol=2e-5, atol=tol, what="logits in window", compare=inside)
    if clean:
        assert torch.equal(out == NEG_INF, ~inside), "clean_logits: -inf mask differs from the windows"


# ----------------------------------------------------------------------------------------------
# get_paged_mqa_logits_metadata
# ----------------------------------------------------------------------------------------------

META_CASES = [
    pytest.param([0, 1, 256, 257, 1000, 0, 3000], 4, id="1d-mixed-sms4"),
    pytest.param([0, 0, 0], 3, id="1d-all-empty"),
    pytest.param([10, 20], 8, id="1d-fewer-segments-than-sms"),
    pytest.param([[5, 600], [0, 0], [256, 257], [2049, 3]], 7, id="2d-next_n2-sms7"),
    pytest.param([[100, 101, 102, 103]] * 3 + [[4000, 4001, 4002, 4003]], 132, id="2d-next_n4-sms132"),
    pytest.param([5000, 1, 70000, 256], 78, id="1d-long-sms78"),
]


@pytest.mark.parametrize("ctx, num_sms", META_CASES)
def test_paged_mqa_logits_metadata(ctx, num_sms):
    context_lens = i32(ctx)
    B = context_lens.shape[0]
    meta = nb.get_paged_mqa_logits_metadata(context_lens, 64, num_sms, impl=REF)
    assert meta.dtype == torch.int32 and meta.shape == (num_sms + 1, 2)
    segs = naive.schedule_segments(context_lens)
    total = sum(segs)
    before = [sum(segs[:b]) for b in range(B)]
    rows = meta.tolist()
    assert rows[-1] == [B, 0], f"sentinel {rows[-1]}"
    starts = []
    for w, (b, s) in enumerate(rows):
        if b == B:
            assert s == 0, f"worker {w}: sentinel form is (B, 0), got {(b, s)}"
            starts.append(total)
        else:
            assert 0 <= b < B and 0 <= s < segs[b], f"worker {w}: {(b, s)} is not a segment (segs {segs})"
            starts.append(before[b] + s)
    assert starts[0] == 0 or total == 0
    assert all(x <= y for x, y in itertools.pairwise(starts)), f"not monotone: {starts}"
    counts = [y - x for x, y in itertools.pairwise(starts)]
    assert max(counts) - min(counts) <= 1, f"unbalanced: {counts}"
    # Every (request, segment) is covered exactly once, in order.
    all_segs = [(b, s) for b in range(B) for s in range(segs[b])]
    covered = [all_segs[g] for x, y in itertools.pairwise(starts) for g in range(x, y)]
    assert covered == all_segs


# ----------------------------------------------------------------------------------------------
# fp8_paged_mqa_logits (decode / MTP)
# ----------------------------------------------------------------------------------------------

PAGED_CASES = [
    # B, next_n, H, D, block_kv, context_lens (1-D: per request; 2-D: per row), page padding bytes,
    # extra output columns (negative: fewer columns than visible keys), cache rank
    pytest.param(3, 1, 4, 128, 64, [70, 0, 5], 0, 0, 4, id="1d-n1-H4-D128-bkv64"),
    pytest.param(2, 2, 24, 64, 32, [40, 1], 96, 3, 4, id="1d-n2-H24-D64-bkv32-padded"),
    pytest.param(2, 3, 32, 64, 32, [2, 35], 0, 0, 3, id="1d-n3-H32-D64-short-3d-cache"),
    pytest.param(2, 4, 1, 128, 32, [33, 4], 48, 2, 4, id="1d-n4-H1-D128-padded"),
    pytest.param(2, 1, 64, 64, 32, [[12], [7]], 16, 0, 4, id="2d-n1-H64-D64-padded"),
    pytest.param(2, 2, 4, 64, 64, [[66, 70], [0, 3]], 0, 5, 4, id="2d-n2-H4-D64-bkv64"),
    pytest.param(1, 3, 24, 128, 32, [[5, 0, 40]], 64, 0, 3, id="2d-n3-H24-D128-padded-3d-cache"),
    pytest.param(2, 4, 4, 64, 32, [[1, 2, 33, 34], [9, 9, 9, 9]], 0, 1, 4, id="2d-n4-H4-D64"),
    pytest.param(1, 1, 128, 64, 32, [9], 32, 0, 4, id="1d-n1-H128-D64-padded"),
    pytest.param(2, 2, 4, 64, 32, [50, 20], 0, -6, 4, id="1d-n2-H4-D64-truncated-columns"),
]


@pytest.mark.parametrize("B, next_n, H, D, block_kv, ctx, pad, extra, rank", PAGED_CASES)
def test_fp8_paged_mqa_logits(B, next_n, H, D, block_kv, ctx, pad, extra, rank):
    context_lens = i32(ctx)
    vis = naive.visible_keys(context_lens, next_n)
    keys_per_req = [max(ctx[b]) if context_lens.dim() == 2 else ctx[b] for b in range(B)]
    pages_per_req = [(n + block_kv - 1) // block_kv for n in keys_per_req]
    num_pages = sum(pages_per_req) + 2  # two pages nobody uses
    perm = torch.randperm(num_pages).tolist()
    max_blocks = max(pages_per_req) + 1
    # Entries past a request's pages are never read: fill them with ids outside the cache.
    block_table = torch.full((B, max_blocks), -1, dtype=torch.int32)
    block_table[:, -1] = 10**6
    page_bytes = block_kv * (D + 4)
    stride0 = page_bytes + pad
    # Unwritten slots, unused pages and padding hold random bytes (NaN patterns included).
    buf = bytearray(random_bytes(num_pages * stride0))
    for b in range(B):
        ids = [perm.pop() for _ in range(pages_per_req[b])]
        block_table[b, :len(ids)] = i32(ids)
        n = keys_per_req[b]
        codes = fp8(n, D, scale=2.0).view(torch.uint8).tolist()
        scales = (torch.rand(n) * 0.05 + 1e-3).tolist()
        buf = naive.pack_indexer_pages(codes, scales, block_kv, page_ids=ids, num_pages=num_pages,
                                       page_stride=stride0, fill=buf)
    wide = bytes_tensor(buf).view(num_pages, stride0)
    shape = (num_pages, block_kv, 1, D + 4) if rank == 4 else (num_pages, block_kv, D + 4)
    kv_cache = wide[:, :page_bytes].view(*shape)
    assert kv_cache.stride(0) == stride0
    q = fp8(B, next_n, H, D, scale=2.0)
    weights = torch.randn(B * next_n, H)
    max_context_len = max([*vis, 0]) + extra
    meta = nb.get_paged_mqa_logits_metadata(context_lens, block_kv, 8, impl=REF)
    out = nb.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, meta, max_context_len,
                                  clean_logits=True, impl=REF)
    want = naive.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)
    assert out.dtype == torch.float32 and out.shape == (B * next_n, max_context_len)
    assert_close(out, want, rtol=2e-5, atol=2e-5 * finite_max(want), what="paged logits")


# ----------------------------------------------------------------------------------------------
# pack_indexer_k_cache
# ----------------------------------------------------------------------------------------------

def _read_indexer_cache(cache: torch.Tensor, N: int, D: int) -> tuple[list[list[int]], list[float]]:
    """Per-byte decoder of the page-wise layout: token n -> page n // block_kv."""
    block_kv = cache.shape[1]
    raw, base = naive.raw_bytes(cache)
    codes, scales = [], []
    for n in range(N):
        c, s = naive.read_indexer_cache_token(raw, base, cache.stride(0), block_kv, D, n // block_kv,
                                              n % block_kv)
        codes.append(c)
        scales.append(s)
    return codes, scales


INDEXER_PACK_CASES = [
    pytest.param(70, 128, 64, torch.bfloat16, id="N70-D128-bkv64-bf16"),
    pytest.param(40, 64, 32, torch.float32, id="N40-D64-bkv32-f32"),
    pytest.param(32, 64, 32, torch.float16, id="N32-D64-bkv32-f16-full-page"),
    pytest.param(5, 128, 32, torch.bfloat16, id="N5-D128-bkv32-bf16-zero-rows"),
]


@pytest.mark.parametrize("N, D, block_kv, dtype", INDEXER_PACK_CASES)
def test_pack_indexer_k_cache_quantises(N, D, block_kv, dtype):
    k = (torch.randn(N, D) * torch.rand(N, 1) * 4).to(dtype)
    k[-1] = 0  # amax below the floor
    if N > 2:
        k[1, :] *= 1e-7  # tiny values: floor scale, subnormal codes
    cache = nb.pack_indexer_k_cache(k, block_kv, impl=REF)
    P = (N + block_kv - 1) // block_kv
    assert cache.dtype == torch.uint8 and cache.shape == (P, block_kv, 1, D + 4)
    rows = k.float().tolist()  # exact for bf16/f16/f32
    codes, scales = naive.quantize_indexer_rows(rows)
    expected = naive.pack_indexer_pages(codes, scales, block_kv)
    assert bytes(cache.contiguous().view(-1).tolist()) == bytes(expected), "bytes differ from naive packing"
    got_codes, got_scales = _read_indexer_cache(cache, N, D)
    assert got_codes == codes and got_scales == scales
    # Dequantised values are within fp8 precision of the input.
    for row, c, s in zip(rows, got_codes, got_scales):
        for x, b in zip(row, c):
            assert abs(naive.E4M3[b] * s - x) <= abs(x) / 16 + s * 2.0 ** -10, (x, b, s)


@pytest.mark.parametrize("N, D, block_kv", [pytest.param(33, 64, 32, id="N33-D64-bkv32"),
                                            pytest.param(64, 128, 64, id="N64-D128-bkv64")])
def test_pack_indexer_k_cache_prequantised(N, D, block_kv):
    k_fp8 = fp8(N, D, scale=50.0)
    k_scale = torch.rand(N) * 3 + 1e-3
    cache = nb.pack_indexer_k_cache((k_fp8, k_scale), block_kv, impl=REF)
    got_codes, got_scales = _read_indexer_cache(cache, N, D)
    assert got_codes == k_fp8.view(torch.uint8).tolist()
    assert got_scales == k_scale.tolist()
    # The whole buffer, tail slots of the last page included (zero).
    n_tail = cache.shape[0] * block_kv - N
    expected = naive.pack_indexer_pages(got_codes + [[0] * D] * n_tail, got_scales + [0.0] * n_tail, block_kv)
    assert bytes(cache.view(-1).tolist()) == bytes(expected)


# ----------------------------------------------------------------------------------------------
# topk_indices
# ----------------------------------------------------------------------------------------------

TOPK_CASES = [
    # R, N, topk, windows
    pytest.param(4, 40, 16, None, id="R4-N40-k16-full"),
    pytest.param(3, 12, 16, None, id="R3-N12-k16-fewer-than-topk"),
    pytest.param(6, 30, 8, "random", id="R6-N30-k8-windows"),
    pytest.param(5, 20, 4, "edges", id="R5-N20-k4-edge-windows"),
    pytest.param(3, 25, 1, "starts-only", id="R3-N25-k1-starts"),
    pytest.param(3, 25, 7, "ends-only", id="R3-N25-k7-ends"),
]


def _topk_windows(kind, R, N):
    if kind is None:
        return None, None
    if kind == "random":
        s = torch.randint(0, N, (R,))
        return i32(s.tolist()), i32((s + torch.randint(0, N, (R,))).clamp(max=N).tolist())
    if kind == "edges":
        # full, empty, reversed (empty), ends past N, a single column
        return i32([0, 7, 9, 15, N - 1]), i32([N, 7, 3, N + 10, N])
    if kind == "starts-only":
        return i32([0, 10, N]), None
    return None, i32([N, 3, 0])


@pytest.mark.parametrize("R, N, topk, windows", TOPK_CASES)
def test_topk_indices(R, N, topk, windows):
    # Distinct logits so the top-k set is unique.
    logits = (torch.randperm(R * N).float() * 0.37 - 50).view(R, N)[:, torch.randperm(N)].contiguous()
    starts, ends = _topk_windows(windows, R, N)
    out = nb.topk_indices(logits, topk, starts, ends, impl=REF)
    assert out.dtype == torch.int32 and out.shape == (R, topk)
    want = naive.topk_indices(logits, topk, starts, ends)
    for i, row in enumerate(out.tolist()):
        picked = [c for c in row if c != -1]
        assert len(picked) == len(set(picked)), f"row {i}: duplicates {row}"
        assert set(picked) == set(want[i]), f"row {i}: {sorted(picked)} != {sorted(want[i])}"
        assert row.count(-1) == topk - len(want[i]), f"row {i}: -1 padding {row}"


# ----------------------------------------------------------------------------------------------
# logical_to_global_indices
# ----------------------------------------------------------------------------------------------

L2G_CASES = [
    # R, K, B, max_blocks, page_size
    pytest.param(5, 12, 3, 4, 16, id="R5-K12-B3-M4-page16"),
    pytest.param(4, 16, 2, 3, 64, id="R4-K16-B2-M3-page64"),
    pytest.param(3, 8, 4, 5, 1, id="R3-K8-B4-M5-page1"),
]


@pytest.mark.parametrize("R, K, B, M, page", L2G_CASES)
def test_logical_to_global_indices(R, K, B, M, page):
    block_table = torch.randint(0, 1000, (B, M), dtype=torch.int32)
    # Positions from -3 to past the block table; -1 sprinkled in.
    indices = torch.randint(-3, M * page + 2 * page, (R, K), dtype=torch.int32)
    indices[torch.rand(R, K) < 0.2] = -1
    indices[0, 0], indices[0, 1], indices[0, 2] = M * page - 1, M * page, 0
    req_ids = torch.randint(0, B, (R,), dtype=torch.int32)
    out = nb.logical_to_global_indices(indices, block_table, req_ids, page, impl=REF)
    assert out.dtype == torch.int32 and out.shape == (R, K)
    assert out.tolist() == naive.logical_to_global_indices(indices, block_table, req_ids, page)


# ----------------------------------------------------------------------------------------------
# flash_mla_sparse_fwd
# ----------------------------------------------------------------------------------------------

def _sparse_indices(rows: int, s_kv: int, topk: int, pool: list[int] | None = None,
                    limit: int | None = None) -> torch.Tensor:
    """Distinct valid indices per row (from ``pool``), with -1 and >= ``limit`` entries mixed in."""
    pool = list(range(s_kv)) if pool is None else pool
    limit = s_kv if limit is None else limit
    out = torch.empty(rows, topk, dtype=torch.int32)
    for r in range(rows):
        pick = torch.randperm(len(pool))[:topk].tolist()
        row = [pool[p] for p in pick] + [-1] * (topk - len(pick))
        for c in range(topk):
            u = float(torch.rand(()))
            if u < 0.2:
                row[c] = -1
            elif u < 0.3:
                row[c] = limit + int(torch.randint(0, 5000, ()))
        out[r] = i32(row)
    return out


def _check_attention(out, lse, want_out, want_lse, what):
    # Rows without a valid entry: output exactly zero (lse +inf is checked by assert_close).
    empty = want_lse == math.inf  # [.., h_q] in out's row order after the permute below
    if out.dim() == 4:  # decode: out [B, s_q, h_q, d_v], lse [B, h_q, s_q]
        empty = empty.transpose(1, 2)
    assert bool((out[empty].float() == 0).all()), f"{what}: empty rows must give a zero output"
    # bf16 output: half a bf16 ulp of rounding plus fp32 accumulation differences.
    assert_close(out, want_out, rtol=2.0 ** -8, atol=2e-3 * finite_max(want_out) + 1e-6, what=f"{what} out")
    assert_close(lse, want_lse, rtol=1e-5, atol=1e-5, what=f"{what} lse")


PREFILL_CASES = [
    # s_q, h_q, d_qk, s_kv, topk, attn_sink, topk_length
    pytest.param(3, 4, 576, 40, 16, False, False, id="sq3-h4-d576-kv40-k16"),
    pytest.param(2, 1, 512, 20, 8, True, False, id="sq2-h1-d512-sink"),
    pytest.param(3, 24, 576, 30, 8, False, True, id="sq3-h24-d576-topk_length"),
    pytest.param(2, 32, 512, 16, 4, True, True, id="sq2-h32-d512-sink-topk_length"),
    pytest.param(1, 64, 576, 12, 8, True, True, id="sq1-h64-d576-sink-topk_length"),
    pytest.param(1, 128, 512, 9, 4, False, False, id="sq1-h128-d512"),
]


@pytest.mark.parametrize("s_q, h_q, d_qk, s_kv, topk, sink, use_tl", PREFILL_CASES)
def test_flash_mla_sparse_fwd(s_q, h_q, d_qk, s_kv, topk, sink, use_tl):
    q = torch.randn(s_q, h_q, d_qk).bfloat16()
    kv = torch.randn(s_kv, 1, d_qk).bfloat16()
    indices = _sparse_indices(s_q, s_kv, topk).view(s_q, 1, topk)
    attn_sink = torch.randn(h_q) * 2 if sink else None
    topk_length = i32(torch.randint(0, topk + 1, (s_q,)).tolist()) if use_tl else None
    if use_tl:
        topk_length[0] = topk  # keep one row whole
    sm_scale = d_qk ** -0.5
    out, mx, lse = nb.flash_mla_sparse_fwd(q, kv, indices, sm_scale, 512, attn_sink, topk_length, impl=REF)
    assert out.dtype == torch.bfloat16 and out.shape == (s_q, h_q, 512)
    assert mx.dtype == lse.dtype == torch.float32 and mx.shape == lse.shape == (s_q, h_q)
    w_out, w_mx, w_lse = naive.flash_mla_sparse_fwd(q, kv, indices, sm_scale, 512, attn_sink, topk_length)
    _check_attention(out, lse, w_out, w_lse, "prefill")
    assert_close(mx, w_mx, rtol=1e-5, atol=1e-5, what="prefill max_logits")


@pytest.mark.parametrize("sink", [pytest.param(False, id="no-sink"), pytest.param(True, id="sink")])
def test_flash_mla_sparse_fwd_empty_rows(sink):
    s_kv, topk, h_q = 10, 6, 4
    q = torch.randn(4, h_q, 576).bfloat16()
    kv = torch.randn(s_kv, 1, 576).bfloat16()
    indices = i32([[-1] * topk,                       # all -1
                   [s_kv, s_kv + 1, 99, -1, 10**6, s_kv],  # all out of range
                   [0, 1, 2, 3, 4, 5],                # cut to nothing by topk_length
                   [7, -1, s_kv, 3, -1, 9]]).view(4, 1, topk)
    topk_length = i32([topk, topk, 0, topk])
    attn_sink = torch.randn(h_q) if sink else None
    out, mx, lse = nb.flash_mla_sparse_fwd(q, kv, indices, 576 ** -0.5, 512, attn_sink, topk_length, impl=REF)
    assert torch.equal(out[:3].float(), torch.zeros(3, h_q, 512))
    assert torch.equal(lse[:3], torch.full((3, h_q), math.inf))
    assert torch.equal(mx[:3], torch.full((3, h_q), -math.inf))
    w_out, w_mx, w_lse = naive.flash_mla_sparse_fwd(q, kv, indices, 576 ** -0.5, 512, attn_sink, topk_length)
    _check_attention(out, lse, w_out, w_lse, "prefill")
    assert_close(mx, w_mx, rtol=1e-5, atol=1e-5, what="prefill max_logits")


# ----------------------------------------------------------------------------------------------
# sparse_mla_decode
# ----------------------------------------------------------------------------------------------

def _ds_mla_cache(num_blocks: int, page: int, pad: int, rank: int, poison_slot0: bool):
    """fp8_ds_mla cache with every slot holding a packed random token (slot 0 NaN bytes if poisoned)."""
    stride0 = page * naive.DS_MLA_BYTES + pad
    buf = bytearray(random_bytes(num_blocks * stride0))
    kv = torch.randn(num_blocks * page, 576).bfloat16()
    for s, tok in enumerate(naive.pack_fp8_ds_mla(kv, "arbitrary")):
        p0 = (s // page) * stride0 + (s % page) * naive.DS_MLA_BYTES
        buf[p0:p0 + naive.DS_MLA_BYTES] = b"\xff" * naive.DS_MLA_BYTES if (poison_slot0 and s == 0) else tok
    wide = bytes_tensor(buf).view(num_blocks, stride0)
    shape = (num_blocks, page, 1, naive.DS_MLA_BYTES) if rank == 4 else (num_blocks, page, naive.DS_MLA_BYTES)
    return wide[:, :page * naive.DS_MLA_BYTES].view(*shape)


def _bf16_cache(num_blocks: int, page: int, d_qk: int, pad: int, poison_slot0: bool):
    wide = torch.randn(num_blocks, page * d_qk + pad).bfloat16()
    if poison_slot0:
        wide[0, :d_qk] = float("nan")
    return wide[:, :page * d_qk].view(num_blocks, page, 1, d_qk)


DECODE_CASES = [
    # kv_format, B, s_q, h_q, d_qk, page, num_blocks, topk, pad, cache rank, sink, topk_length
    pytest.param("fp8_ds_mla", 2, 1, 4, 576, 16, 4, 8, 0, 3, False, False, id="fp8-B2-sq1-h4-k8"),
    pytest.param("fp8_ds_mla", 2, 2, 16, 576, 16, 3, 8, 40, 4, True, True,
                 id="fp8-B2-sq2-h16-padded-sink-tl"),
    pytest.param("fp8_ds_mla", 1, 4, 1, 576, 8, 4, 16, 8, 3, True, False, id="fp8-B1-sq4-h1-padded"),
    pytest.param("fp8_ds_mla", 1, 1, 128, 576, 8, 2, 4, 0, 4, False, True, id="fp8-B1-sq1-h128"),
    pytest.param("bf16", 2, 2, 4, 576, 16, 3, 8, 32, 4, True, True, id="bf16-B2-sq2-h4-d576-padded"),
    pytest.param("bf16", 2, 1, 24, 512, 16, 2, 8, 0, 4, False, False, id="bf16-B2-sq1-h24-d512"),
]


@pytest.mark.parametrize("fmt, B, s_q, h_q, d_qk, page, num_blocks, topk, pad, rank, sink, use_tl",
                         DECODE_CASES)
def test_sparse_mla_decode(fmt, B, s_q, h_q, d_qk, page, num_blocks, topk, pad, rank, sink, use_tl):
    n_slots = num_blocks * page
    if fmt == "fp8_ds_mla":
        cache = _ds_mla_cache(num_blocks, page, pad, rank, poison_slot0=False)
    else:
        cache = _bf16_cache(num_blocks, page, d_qk, pad, poison_slot0=False)
    q = torch.randn(B, s_q, h_q, d_qk).bfloat16()
    indices = _sparse_indices(B * s_q, n_slots, topk).view(B, s_q, topk)
    attn_sink = torch.randn(h_q) * 2 if sink else None
    topk_length = None
    if use_tl:
        # Request 0 cut part-way (or kept whole when alone), request 1 (if any) left with nothing.
        topk_length = i32([int(torch.randint(1, topk, ())) if B > 1 else topk] + [0] * (B - 1))
    sm_scale = d_qk ** -0.5
    out, lse = nb.sparse_mla_decode(q, cache, indices, sm_scale, 512, fmt, attn_sink, topk_length, impl=REF)
    assert out.dtype == torch.bfloat16 and out.shape == (B, s_q, h_q, 512)
    assert lse.dtype == torch.float32 and lse.shape == (B, h_q, s_q)
    w_out, w_lse = naive.sparse_mla_decode(q, cache, indices, sm_scale, 512, fmt, attn_sink, topk_length)
    _check_attention(out, lse, w_out, w_lse, "decode")


def test_sparse_mla_invalid_entries_never_contribute():
    """Entries that are skipped (-1, out of range, past topk_length) must not leak the data of any
    row: here slot / row 0 holds NaN (an uninitialised cache) and no valid entry refers to it."""
    h_q, topk = 4, 8
    # Prefill: kv row 0 is NaN, valid indices come from rows 1..
    s_kv = 20
    kv = torch.randn(s_kv, 1, 576).bfloat16()
    kv[0] = float("nan")
    q = torch.randn(3, h_q, 576).bfloat16()
    indices = _sparse_indices(3, s_kv, topk, pool=list(range(1, s_kv))).view(3, 1, topk)
    indices[0, 0, :] = -1                 # empty row
    indices[1, 0, -1] = -1                # a skipped entry next to valid ones
    indices[2, 0, 5] = 0                  # the NaN row, but past topk_length
    topk_length = i32([topk, topk, 3])
    out, mx, lse = nb.flash_mla_sparse_fwd(q, kv, indices, 576 ** -0.5, 512, None, topk_length, impl=REF)
    w_out, w_mx, w_lse = naive.flash_mla_sparse_fwd(q, kv, indices, 576 ** -0.5, 512, None, topk_length)
    _check_attention(out, lse, w_out, w_lse, "prefill (NaN in an unused kv row)")
    assert_close(mx, w_mx, rtol=1e-5, atol=1e-5, what="prefill max_logits (NaN in an unused kv row)")
    # Decode, both cache formats.
    for fmt in ("fp8_ds_mla", "bf16"):
        page, num_blocks = 16, 2
        cache = _ds_mla_cache(num_blocks, page, 0, 3, poison_slot0=True) if fmt == "fp8_ds_mla" \
            else _bf16_cache(num_blocks, page, 576, 0, poison_slot0=True)
        qd = torch.randn(2, 1, h_q, 576).bfloat16()
        pool = list(range(1, num_blocks * page))
        idx = _sparse_indices(2, num_blocks * page, topk, pool=pool).view(2, 1, topk)
        idx[:, 0, -1] = -1
        out, lse = nb.sparse_mla_decode(qd, cache, idx, 576 ** -0.5, 512, fmt, None, None, impl=REF)
        w_out, w_lse = naive.sparse_mla_decode(qd, cache, idx, 576 ** -0.5, 512, fmt)
        _check_attention(out, lse, w_out, w_lse, f"decode {fmt} (NaN in an unused slot)")


# ----------------------------------------------------------------------------------------------
# fp8_ds_mla packing
# ----------------------------------------------------------------------------------------------

def _ds_mla_inputs() -> torch.Tensor:
    kv = torch.randn(7, 576)
    kv[1, 0:128] = 0.0                                   # all-zero group: floor scale
    kv[1, 128:256] *= 1e-3
    kv[1, 200] = 30.0                                    # one outlier: subnormal codes
    kv[1, 256:384] = -kv[1, 256:384].abs()
    kv[1, 260:270] = -0.0                                # negative zeros keep their sign
    kv[1, 384:512] *= 1e4                                # large magnitudes
    kv[2, :512] *= 1e-6                                  # amax below the floor in every group
    kv[3, :512] *= 2.0 ** torch.randint(-20, 20, (512,)).float()  # wide dynamic range
    kv[4, 0] = 448.0                                     # amax exactly 448: scale 1 in both formats
    kv[4, 1:128] = kv[4, 1:128].clamp(-400, 400)
    kv[5, 128:256] = kv[5, 128:256].clamp(-3.5, 3.5)
    kv[5, 128] = 3.5                                     # amax 448 * 2^-7
    kv[6, 512:] *= 1e5                                   # rope stays bf16 exactly
    return kv.bfloat16()


@pytest.mark.parametrize("fmt", [pytest.param("arbitrary", id="arbitrary"), pytest.param("pow2", id="pow2")])
def test_pack_unpack_fp8_ds_mla(fmt):
    kv = _ds_mla_inputs()
    N = kv.shape[0]
    packed = nb.pack_fp8_ds_mla(kv, fmt, impl=REF)
    assert packed.dtype == torch.uint8 and packed.shape == (N, 656)
    want = naive.pack_fp8_ds_mla(kv, fmt)
    for n in range(N):
        got = bytes(packed[n].tolist())
        if got != want[n]:
            diff = [i for i in range(656) if got[i] != want[n][i]]
            pytest.fail(f"token {n}: {len(diff)} bytes differ, first at {diff[:8]}")
    vals = naive.bf16_values(kv)
    floor = naive.f32(1e-4)
    for n in range(N):
        scales = struct.unpack_from("<4f", want[n], 512)
        for g, s in enumerate(scales):
            amax = max(abs(x) for x in vals[n][g * 128:(g + 1) * 128])
            exact = naive.f32(max(amax, floor) / 448)
            if fmt == "pow2":
                assert math.frexp(s)[0] == 0.5, f"token {n} group {g}: scale {s!r} is not a power of two"
                assert s >= exact > s / 2, (n, g, s, exact)
            else:
                assert s == exact, (n, g, s, exact)
    # Round trip: the reference unpack equals the naive byte decoder bit for bit, and is within fp8
    # precision of the input.
    un = nb.unpack_fp8_ds_mla(packed, impl=REF)
    assert un.dtype == torch.bfloat16 and un.shape == (N, 576)
    un_vals = naive.bf16_values(un)
    for n in range(N):
        assert un_vals[n] == naive.unpack_ds_mla_token(want[n]), f"token {n}: unpack differs"
        scales = struct.unpack_from("<4f", want[n], 512)
        for d in range(512):
            x, y, s = vals[n][d], un_vals[n][d], scales[d // 128]
            assert abs(x - y) <= abs(x) * (2.0 ** -4 + 2.0 ** -8) + s * 2.0 ** -9, (n, d, x, y, s)
        assert un_vals[n][512:] == vals[n][512:], f"token {n}: rope not exact"
    # A whole paged cache unpacks in one call.
    cache = packed[:6].reshape(3, 2, 1, 656)
    assert torch.equal(nb.unpack_fp8_ds_mla(cache, impl=REF).view(6, 576), un[:6])


def test_pack_fp8_ds_mla_power_of_two_amax():
    """Groups whose amax / 448 is exactly 2**k keep the scale 2**k in both formats (no rounding up)."""
    ks = list(range(-20, 16))  # amax >= the 1e-4 floor
    kv = (torch.rand(len(ks) // 4, 576) * 2 - 1) * 0.999
    for g, k in enumerate(ks):
        row, col = divmod(g, 4)
        kv[row, col * 128:(col + 1) * 128] *= 448.0 * 2.0 ** k
        kv[row, col * 128 + g % 128] = -448.0 * 2.0 ** k
    kv = kv.bfloat16()
    for fmt in ("arbitrary", "pow2"):
        packed = nb.pack_fp8_ds_mla(kv, fmt, impl=REF)
        want = naive.pack_fp8_ds_mla(kv, fmt)
        for row in range(kv.shape[0]):
            scales = struct.unpack_from("<4f", bytes(packed[row].tolist()), 512)
            assert list(scales) == [2.0 ** ks[4 * row + c] for c in range(4)], (fmt, row, scales)
            assert bytes(packed[row].tolist()) == want[row], (fmt, row)


WRITE_CASES = [
    # scale_format, cache rank, page padding, slot dtype
    pytest.param("arbitrary", 3, 0, torch.int64, id="arbitrary-3d-dense-i64"),
    pytest.param("pow2", 3, 100, torch.int32, id="pow2-3d-padded-i32"),
    pytest.param("arbitrary", 4, 656, torch.int32, id="arbitrary-4d-padded-i32"),
    pytest.param("pow2", 4, 0, torch.int64, id="pow2-4d-dense-i64"),
]


@pytest.mark.parametrize("fmt, rank, pad, slot_dtype", WRITE_CASES)
def test_write_fp8_ds_mla_cache(fmt, rank, pad, slot_dtype):
    num_blocks, page = 3, 8
    n_slots = num_blocks * page
    stride0 = page * 656 + pad
    before = random_bytes(num_blocks * stride0)
    wide = bytes_tensor(before).view(num_blocks, stride0)
    shape = (num_blocks, page, 1, 656) if rank == 4 else (num_blocks, page, 656)
    cache = wide[:, :page * 656].view(*shape)
    slots = [9, -1, n_slots - 1, n_slots, 0, -7, 17, n_slots + 100]
    kv = _ds_mla_inputs()[:6].clone()
    kv = torch.cat([kv, torch.randn(2, 576).bfloat16()])
    nb.write_fp8_ds_mla_cache(kv, cache, torch.tensor(slots, dtype=slot_dtype), fmt, impl=REF)
    toks = naive.pack_fp8_ds_mla(kv, fmt)
    ref_toks = nb.pack_fp8_ds_mla(kv, fmt, impl=REF)
    expected = bytearray(before)
    for t, s in enumerate(slots):
        if 0 <= s < n_slots:
            p0 = (s // page) * stride0 + (s % page) * 656
            expected[p0:p0 + 656] = toks[t]
            assert bytes(cache.reshape(n_slots, 656)[s].tolist()) == bytes(ref_toks[t].tolist()), \
                f"slot {s}: bytes differ from pack_fp8_ds_mla"
    after = bytes(wide.view(-1).tolist())
    if after != bytes(expected):
        diff = [i for i in range(len(after)) if after[i] != expected[i]]
        pytest.fail(f"{len(diff)} bytes differ, first at byte {diff[0]} (slot-space offset)")


# ----------------------------------------------------------------------------------------------
# tf32_hc_prenorm_gemm
# ----------------------------------------------------------------------------------------------

HC_CASES = [
    # M, N, K, num_splits
    pytest.param(3, 24, 256, None, id="M3-N24-K256-full"),
    pytest.param(5, 8, 128, None, id="M5-N8-K128-full"),
    pytest.param(3, 24, 256, 1, id="M3-N24-K256-split1"),
    pytest.param(4, 24, 256, 3, id="M4-N24-K256-split3-uneven"),
    pytest.param(2, 16, 512, 8, id="M2-N16-K512-split8"),
    pytest.param(3, 8, 192, 2, id="M3-N8-K192-split2"),
]


@pytest.mark.parametrize("M, N, K, splits", HC_CASES)
def test_tf32_hc_prenorm_gemm(M, N, K, splits):
    a = torch.randn(M, K).bfloat16()
    b = torch.randn(N, K)
    want_d, want_sq = naive.hc_prenorm_gemm(a, b)
    mag = a.double().abs() @ b.double().abs().T  # sum of |terms|, for the tolerance
    if splits is None:
        d = torch.full((M, N), float("nan"))
        sq = torch.full((M,), float("nan"))
    else:
        d = torch.full((splits, M, N), float("nan"))
        sq = torch.full((splits, M), float("nan"))
    nb.tf32_hc_prenorm_gemm(a, b, d, sq, splits, impl=REF)
    assert not torch.isnan(d).any() and not torch.isnan(sq).any(), "output not fully written"
    d_sum = d if splits is None else d.double().sum(0)
    sq_sum = sq if splits is None else sq.double().sum(0)
    assert_close(d_sum, want_d, rtol=0, atol=float(2e-6 * mag.max()), what="d")
    assert_close(sq_sum, want_sq, rtol=1e-6, atol=0, what="sqr_sum")
    if splits is not None:
        # Every split is a partial sum over a contiguous K range; the ranges tile [0, K).
        d_full = torch.empty(M, N)
        sq_full = torch.empty(M)
        nb.tf32_hc_prenorm_gemm(a, b, d_full, sq_full, impl=REF)
        assert_close(d_sum, d_full, rtol=0, atol=float(2e-6 * mag.max()), what="sum of splits vs 2-D")
        assert_close(sq_sum, sq_full, rtol=1e-6, atol=0, what="sqr_sum of splits vs 2-D")
        assert bool((sq >= 0).all())
