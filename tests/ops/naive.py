"""Loop-level implementations of the ops, written from the op contracts (``docs`` and op docstrings).

They are the independent check of ``nsa_backend.reference``: explicit Python loops over rows, heads
and keys, float64 arithmetic, and every number format decoded from (and encoded to) its bit pattern
here -- fp8 e4m3fn, bf16 and fp32 -- without torch dtype conversions. Tensors only carry bytes and
integers in and out. Slow by design: use tiny shapes.

Rounding emulation:
- ``f32(x)`` rounds a Python float to the nearest fp32 (ties to even). A single +, -, *, / of two
  fp32 values done in float64 and then rounded to fp32 equals the fp32 operation exactly.
- ``e4m3_encode`` and ``bf16_from_f32_bits`` round to nearest, ties to even.
"""

from __future__ import annotations

import bisect
import math
import struct
from operator import mul

import torch

INF = math.inf
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4
SCHEDULE_SEGMENT = 256
DS_MLA_NOPE = 512
DS_MLA_GROUP = 128
DS_MLA_ROPE = 64
DS_MLA_BYTES = 656


# ----------------------------------------------------------------------------------------------
# Number formats
# ----------------------------------------------------------------------------------------------

def e4m3_decode(byte: int) -> float:
    """float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN, no inf."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> 3) & 0xF
    man = byte & 0x7
    if exp == 0xF and man == 0x7:
        return math.nan
    if exp == 0:
        return sign * man * 2.0 ** -9
    return sign * (8 + man) * 2.0 ** (exp - 10)


E4M3 = [e4m3_decode(b) for b in range(256)]
# Codes 0x00..0x7E are the finite non-negative values in increasing order.
_E4M3_POS = E4M3[:0x7F]


def e4m3_encode(x: float) -> int:
    """Byte of the e4m3fn value nearest to ``x`` (ties to the even code); needs ``|x| <= 448``."""
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    assert a <= FP8_MAX, a
    i = bisect.bisect_left(_E4M3_POS, a)
    if _E4M3_POS[i] == a:
        return sign | i
    lo, hi = i - 1, i
    d_lo, d_hi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    if d_lo < d_hi:
        return sign | lo
    if d_hi < d_lo:
        return sign | hi
    return sign | (lo if lo % 2 == 0 else hi)


def f32(x: float) -> float:
    """Round to the nearest fp32 value."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def f32_bytes(x: float) -> bytes:
    return struct.pack("<f", x)


def bf16_decode(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def bf16_from_f32_bits(x: float) -> int:
    """bf16 bit pattern of the fp32 value ``x`` (round to nearest, ties to even; finite input)."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits += 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16) & 0xFFFF


def bf16_round(x: float) -> float:
    """fp32-round then bf16-round (what an fp32 result stored as bf16 becomes)."""
    return bf16_decode(bf16_from_f32_bits(f32(x)))


def _leaves(nested, fn):
    if isinstance(nested, list):
        return [_leaves(v, fn) for v in nested]
    return fn(nested)


def fp8_values(t: torch.Tensor):
    """Nested lists of the float values of an e4m3fn tensor, decoded byte by byte."""
    return _leaves(t.view(torch.uint8).tolist(), lambda b: E4M3[b])


def bf16_values(t: torch.Tensor):
    """Nested lists of the float values of a bf16 tensor, decoded from the bit patterns."""
    return _leaves(t.view(torch.int16).tolist(), bf16_decode)


def raw_bytes(t: torch.Tensor) -> tuple[bytes, int]:
    """(all bytes of the tensor's storage, byte offset of element 0)."""
    return bytes(t.untyped_storage()), t.storage_offset() * t.element_size()


def dot(a, b) -> float:
    return sum(map(mul, a, b))


# ----------------------------------------------------------------------------------------------
# Lightning indexer
# ----------------------------------------------------------------------------------------------

def _indexer_logit(q_heads, w_heads, k_row, k_scale: float) -> float:
    """sum_h relu(q[h] . k) * w[h] * k_scale."""
    acc = 0.0
    for qh, wh in zip(q_heads, w_heads):
        s = dot(qh, k_row)
        if s > 0:
            acc += s * wh
    return acc * k_scale


def fp8_mqa_logits(q, kv, weights, ks, ke, max_seqlen_k: int = 0) -> torch.Tensor:
    """Ragged logits; ``-inf`` outside ``[ks[i], ke[i])``; compressed when ``max_seqlen_k > 0``."""
    k, k_scale = kv
    qv, kvv = fp8_values(q), fp8_values(k)
    w, sc = weights.tolist(), k_scale.tolist()
    ks, ke = ks.tolist(), ke.tolist()
    S, N = len(qv), len(kvv)
    full = [[-INF] * N for _ in range(S)]
    for i in range(S):
        for n in range(max(ks[i], 0), min(ke[i], N)):
            full[i][n] = _indexer_logit(qv[i], w[i], kvv[n], sc[n])
    if max_seqlen_k <= 0:
        return torch.tensor(full, dtype=torch.float64).view(S, N)
    out = [[-INF] * max_seqlen_k for _ in range(S)]
    for i in range(S):
        for j in range(min(ke[i] - ks[i], max_seqlen_k)):
            out[i][j] = full[i][ks[i] + j]
    return torch.tensor(out, dtype=torch.float64).view(S, max_seqlen_k)


def visible_keys(context_lens: torch.Tensor, next_n: int) -> list[int]:
    """Keys visible to each query row ``b * next_n + j`` (both ``context_lens`` forms)."""
    ctx = context_lens.tolist()
    out = []
    for b in range(len(ctx)):
        for j in range(next_n):
            if context_lens.dim() == 2:
                out.append(max(ctx[b][j], 0))
            else:
                # Query at position L - next_n + j sees keys t <= L - next_n + j.
                out.append(max(ctx[b] - next_n + j + 1, 0))
    return out


def read_indexer_cache_token(raw: bytes, base: int, page_stride: int, block_kv: int, head_dim: int,
                             page: int, offset: int) -> tuple[list[int], float]:
    """(fp8 bytes, fp32 scale) of token ``offset`` in ``page``: values page-wise first, then scales."""
    p0 = base + page * page_stride
    v0 = p0 + offset * head_dim
    codes = list(raw[v0:v0 + head_dim])
    (scale,) = struct.unpack_from("<f", raw, p0 + block_kv * head_dim + 4 * offset)
    return codes, scale


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                         max_context_len: int) -> torch.Tensor:
    """Paged decode logits, ``-inf`` for keys a row cannot see."""
    B, next_n, _, D = q.shape
    block_kv = kv_cache.shape[1]
    raw, base = raw_bytes(kv_cache)
    stride0 = kv_cache.stride(0)
    qv = fp8_values(q)
    w = weights.tolist()
    bt = block_table.tolist()
    vis = visible_keys(context_lens, next_n)
    out = [[-INF] * max_context_len for _ in range(B * next_n)]
    for b in range(B):
        for j in range(next_n):
            r = b * next_n + j
            for t in range(min(vis[r], max_context_len)):
                codes, scale = read_indexer_cache_token(raw, base, stride0, block_kv, D, bt[b][t // block_kv],
                                                        t % block_kv)
                out[r][t] = _indexer_logit(qv[b][j], w[r], [E4M3[c] for c in codes], scale)
    return torch.tensor(out, dtype=torch.float64).view(B * next_n, max_context_len)


def schedule_segments(context_lens: torch.Tensor) -> list[int]:
    """Segments (of 256 keys) of each request; a 2-D ``context_lens`` counts its last row (DeepGEMM)."""
    ctx = context_lens.tolist()
    lens = [row[-1] if row else 0 for row in ctx] if context_lens.dim() == 2 else ctx
    return [(max(n, 0) + SCHEDULE_SEGMENT - 1) // SCHEDULE_SEGMENT for n in lens]


def quantize_indexer_rows(rows) -> tuple[list[list[int]], list[float]]:
    """Per-token fp8 quantisation: scale = max(amax, 1e-4) / 448 in fp32, code = e4m3(x / scale)."""
    codes, scales = [], []
    floor = f32(AMAX_FLOOR)
    for row in rows:
        s = f32(max(max(abs(x) for x in row), floor) / FP8_MAX)
        codes.append([e4m3_encode(max(-FP8_MAX, min(FP8_MAX, f32(x / s)))) for x in row])
        scales.append(s)
    return codes, scales


def pack_indexer_pages(codes, scales, block_kv: int, page_ids=None, num_pages=None, page_stride=None,
                       fill: bytes | None = None) -> bytearray:
    """Bytes of a paged indexer cache holding token ``n`` at page ``page_ids[n // block_kv]``.

    Defaults: consecutive pages, no padding, zero fill. ``fill`` (same length as the buffer) gives the
    bytes of every slot (and padding) that no token is written to.
    """
    N = len(codes)
    D = len(codes[0]) if N else 0
    page_bytes = block_kv * (D + 4)
    n_logical = (N + block_kv - 1) // block_kv
    page_ids = list(range(n_logical)) if page_ids is None else page_ids
    num_pages = n_logical if num_pages is None else num_pages
    page_stride = page_bytes if page_stride is None else page_stride
    buf = bytearray(fill) if fill is not None else bytearray(num_pages * page_stride)
    assert len(buf) == num_pages * page_stride
    for n in range(N):
        p0 = page_ids[n // block_kv] * page_stride
        off = n % block_kv
        buf[p0 + off * D: p0 + (off + 1) * D] = bytes(codes[n])
        buf[p0 + block_kv * D + 4 * off: p0 + block_kv * D + 4 * off + 4] = f32_bytes(scales[n])
    return buf


# ----------------------------------------------------------------------------------------------
# Top-k
# ----------------------------------------------------------------------------------------------

def topk_indices(logits, topk: int, starts=None, ends=None) -> list[list[int]]:
    """Per row: columns of the ``topk`` largest logits in ``[starts[i], ends[i])``, best first (no -1)."""
    rows = logits.tolist()
    R = len(rows)
    N = logits.shape[1]
    lo = starts.tolist() if starts is not None else [0] * R
    hi = ends.tolist() if ends is not None else [N] * R
    out = []
    for i, row in enumerate(rows):
        cols = list(range(max(lo[i], 0), min(hi[i], N)))
        cols.sort(key=lambda c, row=row: row[c], reverse=True)
        out.append(cols[:topk])
    return out


def logical_to_global_indices(indices, block_table, req_ids, page_size: int) -> list[list[int]]:
    bt = block_table.tolist()
    out = []
    for req, row in zip(req_ids.tolist(), indices.tolist()):
        res = []
        for pos in row:
            if pos < 0 or pos // page_size >= len(bt[req]):
                res.append(-1)
            else:
                res.append(bt[req][pos // page_size] * page_size + pos % page_size)
        out.append(res)
    return out


# ----------------------------------------------------------------------------------------------
# Sparse MLA
# ----------------------------------------------------------------------------------------------

def _attend(q_heads, keys, sm_scale: float, d_v: int, sink):
    """Softmax attention of each head over ``keys`` (list of float rows). -> (out, max_logit, lse)."""
    outs, mxs, lses = [], [], []
    for h, qh in enumerate(q_heads):
        if not keys:
            outs.append([0.0] * d_v)
            mxs.append(-INF)
            lses.append(INF)
            continue
        p = [dot(qh, k) * sm_scale for k in keys]
        m = max(p)
        e = [math.exp(x - m) for x in p]
        z = sum(e)
        lse = m + math.log(z)
        o = [0.0] * d_v
        for ek, k in zip(e, keys):
            wk = ek / z
            o = [acc + wk * v for acc, v in zip(o, k[:d_v])]
        if sink is not None:
            # exp(lse) / (exp(lse) + exp(sink)), written to avoid overflow.
            f = 1.0 / (1.0 + math.exp(min(sink[h] - lse, 700.0)))
            o = [x * f for x in o]
        outs.append(o)
        mxs.append(m)
        lses.append(lse)
    return outs, mxs, lses


def flash_mla_sparse_fwd(q, kv, indices, sm_scale: float, d_v: int = 512, attn_sink=None, topk_length=None):
    """-> (out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q]) as float64 tensors."""
    qv = bf16_values(q)
    kvv = [row[0] for row in bf16_values(kv)] if kv.dim() == 3 else bf16_values(kv)
    idx = indices.reshape(indices.shape[0], -1).tolist()
    tl = topk_length.tolist() if topk_length is not None else None
    sink = attn_sink.tolist() if attn_sink is not None else None
    s_kv = len(kvv)
    outs, mxs, lses = [], [], []
    for i, row in enumerate(idx):
        n = len(row) if tl is None else max(0, min(tl[i], len(row)))
        keys = [kvv[x] for x in row[:n] if 0 <= x < s_kv]
        o, m, lse = _attend(qv[i], keys, sm_scale, d_v, sink)
        outs.append(o)
        mxs.append(m)
        lses.append(lse)
    f64 = torch.float64
    return torch.tensor(outs, dtype=f64), torch.tensor(mxs, dtype=f64), torch.tensor(lses, dtype=f64)


def ds_mla_scale(amax: float, scale_format: str) -> float:
    """Group scale: fp32 max(amax, 1e-4) / 448, rounded up to a power of two for ``"pow2"``."""
    s = f32(max(amax, f32(AMAX_FLOOR)) / FP8_MAX)
    if scale_format == "pow2":
        m, e = math.frexp(s)  # s = m * 2**e, 0.5 <= m < 1
        s = 2.0 ** (e - 1) if m == 0.5 else 2.0 ** e
    return s


def pack_ds_mla_token(values, rope_bits, scale_format: str) -> bytes:
    """656 bytes of one token: 512 e4m3 codes, 4 fp32 scales, 64 bf16 rope values (bit patterns)."""
    codes, scales = [], []
    for g in range(DS_MLA_NOPE // DS_MLA_GROUP):
        grp = values[g * DS_MLA_GROUP:(g + 1) * DS_MLA_GROUP]
        s = ds_mla_scale(max(abs(x) for x in grp), scale_format)
        scales.append(s)
        codes.extend(e4m3_encode(max(-FP8_MAX, min(FP8_MAX, f32(x / s)))) for x in grp)
    return bytes(codes) + struct.pack("<4f", *scales) + struct.pack("<64H", *rope_bits)


def pack_fp8_ds_mla(kv: torch.Tensor, scale_format: str) -> list[bytes]:
    """One 656-byte string per row of a ``[N, 576]`` bf16 tensor."""
    bits = [[b & 0xFFFF for b in row] for row in kv.view(torch.int16).tolist()]
    return [pack_ds_mla_token([bf16_decode(b) for b in row[:DS_MLA_NOPE]], row[DS_MLA_NOPE:], scale_format)
            for row in bits]


def unpack_ds_mla_token(tok: bytes) -> list[float]:
    """576 values of one token as bf16 numbers: e4m3 * scale in fp32, then rounded to bf16."""
    assert len(tok) == DS_MLA_BYTES
    scales = struct.unpack_from("<4f", tok, DS_MLA_NOPE)
    nope = [bf16_round(E4M3[tok[d]] * scales[d // DS_MLA_GROUP]) for d in range(DS_MLA_NOPE)]
    rope = [bf16_decode(b) for b in struct.unpack_from("<64H", tok, DS_MLA_NOPE + 16)]
    return nope + rope


def paged_token_bytes(raw: bytes, base: int, page_stride: int, row_bytes: int, page_size: int,
                      slot: int) -> bytes:
    p0 = base + (slot // page_size) * page_stride + (slot % page_size) * row_bytes
    return raw[p0:p0 + row_bytes]


def sparse_mla_decode(q, kv_cache, indices, sm_scale: float, d_v: int = 512, kv_format: str = "fp8_ds_mla",
                      attn_sink=None, topk_length=None):
    """-> (out [B, s_q, h_q, d_v], lse [B, h_q, s_q]) as float64 tensors; slots addressed in bytes."""
    B, s_q, h_q, d_qk = q.shape
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    n_slots = num_blocks * page
    raw, base = raw_bytes(kv_cache)
    elt = kv_cache.element_size()
    row_bytes = kv_cache.shape[-1] * elt
    page_stride = kv_cache.stride(0) * elt
    qv = bf16_values(q)
    idx = indices.tolist()
    tl = topk_length.tolist() if topk_length is not None else None
    sink = attn_sink.tolist() if attn_sink is not None else None

    def key(slot):
        tok = paged_token_bytes(raw, base, page_stride, row_bytes, page, slot)
        if kv_format == "fp8_ds_mla":
            return unpack_ds_mla_token(tok)
        return [bf16_decode(b) for b in struct.unpack(f"<{d_qk}H", tok)]

    out = [[None] * s_q for _ in range(B)]
    lse = [[[0.0] * s_q for _ in range(h_q)] for _ in range(B)]
    for b in range(B):
        for i in range(s_q):
            row = idx[b][i]
            n = len(row) if tl is None else max(0, min(tl[b], len(row)))
            keys = [key(s) for s in row[:n] if 0 <= s < n_slots]
            o, _, lse_bi = _attend(qv[b][i], keys, sm_scale, d_v, sink)
            out[b][i] = o
            for h in range(h_q):
                lse[b][h][i] = lse_bi[h]
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# mHC pre-norm GEMM
# ----------------------------------------------------------------------------------------------

def hc_prenorm_gemm(a, b, k0: int = 0, k1: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(a[:, k0:k1] @ b[:, k0:k1].T, sum(a[:, k0:k1]^2, -1)) in float64 from bf16 bits and fp32 values."""
    av = bf16_values(a)
    bv = b.tolist()
    k1 = a.shape[1] if k1 is None else k1
    d = [[dot(ar[k0:k1], br[k0:k1]) for br in bv] for ar in av]
    sq = [dot(ar[k0:k1], ar[k0:k1]) for ar in av]
    return torch.tensor(d, dtype=torch.float64), torch.tensor(sq, dtype=torch.float64)
