"""Plain-PyTorch reference implementations: the ground truth of every kernel test.

Each function has the name and signature of the public op (without ``impl``) and follows the
semantics in ``docs/ops.md``. They run on CPU and GPU, accumulate in float32 and favour clarity
over speed; large inputs are processed in chunks so memory stays bounded.

Inputs are assumed valid: the public ops in ``nsa_backend`` validate before calling here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest amax used to derive a quantisation scale, so all-zero groups get a finite scale.
AMAX_FLOOR = 1e-4
# Row segment length of the paged-logits schedule (DeepGEMM's SPLIT_KV: four 64-token pages).
PAGED_SCHEDULE_SPLIT_KV = 256
# fp8_ds_mla token layout: 512 e4m3 latent values, 4 fp32 scales, 64 bf16 rope values.
DS_MLA_NOPE_DIM = 512
DS_MLA_ROPE_DIM = 64
DS_MLA_GROUP = 128
DS_MLA_TOKEN_BYTES = DS_MLA_NOPE_DIM + 4 * (DS_MLA_NOPE_DIM // DS_MLA_GROUP) + 2 * DS_MLA_ROPE_DIM  # 656
# Element budget of one chunk of intermediate scores.
_CHUNK_ELEMS = 1 << 24


# ----------------------------------------------------------------------------------------------
# Lightning indexer
# ----------------------------------------------------------------------------------------------

def _indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_h relu(q[s, h] . k[n]) * weights[s, h] -> [S, N] float32 (k scale not applied)."""
    qf = q.float()  # [S, H, D]
    kf = k.float()  # [N, D]
    w = weights.float()  # [S, H]
    S, H, _ = qf.shape
    N = kf.shape[0]
    out = torch.empty(S, N, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, S * H))
    for n0 in range(0, N, step):
        s = torch.einsum("shd,nd->shn", qf, kf[n0:n0 + step]).relu_()  # [S, H, n]
        out[:, n0:n0 + step] = torch.einsum("shn,sh->sn", s, w)
    return out


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    k, k_scale = kv
    S = q.shape[0]
    N = k.shape[0]
    logits = _indexer_scores(q, k, weights) * k_scale.float()[None, :]  # [S, N]
    ks = cu_seq_len_k_start.long()[:, None]
    ke = cu_seq_len_k_end.long()[:, None]
    cols = torch.arange(N, device=q.device)[None, :]
    logits.masked_fill_((cols < ks) | (cols >= ke), float("-inf"))
    if max_seqlen_k <= 0:
        return logits
    j = torch.arange(max_seqlen_k, device=q.device)[None, :]
    src = ks + j  # [S, max_seqlen_k]
    valid = (src < ke) & (src < N)
    out = torch.full((S, max_seqlen_k), float("-inf"), dtype=torch.float32, device=q.device)
    gathered = torch.gather(logits, 1, src.clamp(0, max(N - 1, 0))) if N > 0 else out
    return torch.where(valid, gathered, out)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int) -> torch.Tensor:
    """DeepGEMM's schedule: every request's context in segments of 256 keys, spread evenly over
    ``num_sms`` workers (DeepGEMM ``smxx_paged_mqa_logits_metadata``, one q atom per request).

    Request ``b`` has ``ceil(L_b / 256)`` segments, where ``L_b`` is ``context_lens[b]`` (1-D) or
    its last column ``context_lens[b, -1]`` (2-D). Worker ``w`` starts at segment
    ``start_w = w * (total // num_sms) + min(w, total % num_sms)`` of the concatenation; entry
    ``w`` holds ``(b, start_w - segments before b)`` with ``b`` the number of requests whose
    segments all end at or before ``start_w``. Entry ``num_sms`` is the end sentinel ``(B, 0)``.
    Negative lengths count as empty. No host synchronisation.
    """
    lens = context_lens.long()
    if lens.dim() == 2:
        lens = lens[:, -1] if lens.shape[1] > 0 else lens.new_zeros(lens.shape[0])
    segs = (lens.clamp(min=0) + PAGED_SCHEDULE_SPLIT_KV - 1) // PAGED_SCHEDULE_SPLIT_KV  # [B]
    cum = torch.cumsum(segs, 0)  # inclusive prefix
    total = cum[-1:].sum()  # 0-d, 0 when B == 0
    w = torch.arange(num_sms + 1, device=lens.device)
    start = w * (total // num_sms) + torch.minimum(w, total % num_sms)  # [num_sms + 1]
    req = torch.searchsorted(cum, start, right=True)  # requests with cum <= start
    before = torch.cat([cum.new_zeros(1), cum])[req]
    return torch.stack([req, start - before], dim=1).to(torch.int32)


def _paged_visible_lengths(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """Number of visible keys per query row, [B * next_n] int64, for both context_lens forms."""
    lens = context_lens.long()
    if lens.dim() == 2:
        return lens.reshape(-1)
    # 1-D: row j of request b is the query at position L - next_n + j and sees keys t <= that.
    j = torch.arange(next_n, device=lens.device)
    return (lens[:, None] - next_n + j[None, :] + 1).clamp(min=0).reshape(-1)


def unpack_indexer_k_cache(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a paged indexer cache into (values [P, block_kv, D] e4m3, scales [P, block_kv] f32)."""
    P, block_kv = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.reshape(P, -1)[:, : block_kv * (head_dim + 4)]
    values = flat[:, : block_kv * head_dim].contiguous().view(FP8).view(P, block_kv, head_dim)
    scales = flat[:, block_kv * head_dim:].contiguous().view(torch.float32).view(P, block_kv)
    return values, scales


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    D = q.shape[-1]
    values, scales = unpack_indexer_k_cache(kv_cache, D)

    def page_keys(pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Index the bytes: older torch has no CPU indexing kernel for float8.
        return values.view(torch.uint8)[pages].view(FP8).reshape(-1, D), scales[pages].reshape(-1)

    return _paged_logits(q, weights, context_lens, block_table, max_context_len, kv_cache.shape[1],
                         kv_cache.shape[0], page_keys)


def _paged_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    block_kv: int,
    num_pages: int,
    page_keys: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]],
) -> torch.Tensor:
    """Paged indexer logits ``[B * next_n, max_context_len]`` of queries ``q [B, next_n, H, D]``;
    ``page_keys(pages)`` gives the keys of those pages ``[len(pages) * block_kv, D]`` and their
    per-key scales (or None when the keys carry them)."""
    B, next_n, H, _ = q.shape
    visible = _paged_visible_lengths(context_lens, next_n)  # [B * next_n]
    out = torch.full((B * next_n, max_context_len), float("-inf"), dtype=torch.float32, device=q.device)
    w_rows = weights.reshape(B, next_n, H)
    for b in range(B):
        n_keys = min(int(visible[b * next_n: (b + 1) * next_n].max()), max_context_len) if next_n else 0
        if n_keys <= 0:
            continue
        n_pages = min((n_keys + block_kv - 1) // block_kv, block_table.shape[1])
        n_keys = min(n_keys, n_pages * block_kv)
        pages = block_table[b, :n_pages].long()
        # A page id outside the cache is treated as holding no visible key.
        bad_page = ((pages < 0) | (pages >= num_pages)).repeat_interleave(block_kv)[:n_keys]
        k, ks = page_keys(pages.clamp(0, max(num_pages - 1, 0)))
        logits = _indexer_scores(q[b], k[:n_keys], w_rows[b])  # [next_n, n_keys]
        if ks is not None:
            logits = logits * ks[None, :n_keys]
        t = torch.arange(n_keys, device=q.device)[None, :]
        hidden = (t >= visible[b * next_n: (b + 1) * next_n, None]) | bad_page[None, :]
        out[b * next_n: (b + 1) * next_n, :n_keys] = logits.masked_fill(hidden, float("-inf"))
    return out


def pack_indexer_k_cache(k, block_kv: int = 64) -> torch.Tensor:
    if isinstance(k, (tuple, list)):
        k_fp8, k_scale = k
        k_scale = k_scale.float()
    else:
        kf = k.float()
        k_scale = _scale_from_amax(kf.abs().amax(dim=-1))
        k_fp8 = (kf / k_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    N, D = k_fp8.shape
    P = (N + block_kv - 1) // block_kv
    values = torch.zeros(P * block_kv, D, dtype=torch.uint8, device=k_fp8.device)
    scales = torch.zeros(P * block_kv, dtype=torch.float32, device=k_fp8.device)
    values[:N] = k_fp8.view(torch.uint8)
    scales[:N] = k_scale
    page_values = values.view(P, block_kv * D)
    page_scales = scales.view(P, block_kv).view(torch.uint8).view(P, block_kv * 4)
    return torch.cat([page_values, page_scales], dim=1).view(P, block_kv, 1, D + 4)


# ----------------------------------------------------------------------------------------------
# Top-k
# ----------------------------------------------------------------------------------------------

def topk_indices(
    logits: torch.Tensor,
    topk: int,
    starts: torch.Tensor | None = None,
    ends: torch.Tensor | None = None,
) -> torch.Tensor:
    R, N = logits.shape
    dev = logits.device
    lo = starts.long() if starts is not None else torch.zeros(R, dtype=torch.long, device=dev)
    hi = ends.long().clamp(max=N) if ends is not None else torch.full((R,), N, dtype=torch.long, device=dev)
    cols = torch.arange(N, device=dev)[None, :]
    valid = (cols >= lo[:, None]) & (cols < hi[:, None])  # [R, N]
    # Invalid columns rank below every valid one, -inf included: key order is (valid, logit).
    keyed = torch.where(valid, logits.float(), torch.full_like(logits, float("-inf"), dtype=torch.float32))
    k_eff = min(topk, N)
    out = torch.full((R, topk), -1, dtype=torch.int32, device=dev)
    if k_eff == 0:
        return out
    # Sort by (valid desc, logit desc); stable so equal logits keep column order.
    order = torch.sort(keyed, dim=1, descending=True, stable=True).indices
    vsorted = torch.gather(valid, 1, order)
    order = torch.gather(order, 1, torch.sort(vsorted.int(), dim=1, descending=True, stable=True).indices)
    top = order[:, :k_eff]
    n_valid = valid.sum(dim=1, keepdim=True)
    rank = torch.arange(k_eff, device=dev)[None, :]
    out[:, :k_eff] = torch.where(rank < n_valid, top, torch.full_like(top, -1)).int()
    return out


def logical_to_global_indices(
    indices: torch.Tensor,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    page_size: int,
) -> torch.Tensor:
    pos = indices.long()
    max_pages = block_table.shape[1]
    page = torch.div(pos, page_size, rounding_mode="floor")
    ok = (pos >= 0) & (page < max_pages)
    req = req_ids.long()
    ok = ok & ((req >= 0) & (req < block_table.shape[0]))[:, None]
    rows = block_table[req.clamp(0, max(block_table.shape[0] - 1, 0))].long()  # [R, M]
    block = torch.gather(rows, 1, page.clamp(0, max(max_pages - 1, 0))) if max_pages else page
    slot = block * page_size + pos % page_size
    ok = ok & (block >= 0)
    return torch.where(ok, slot, torch.full_like(slot, -1)).int()


# ----------------------------------------------------------------------------------------------
# Sparse MLA
# ----------------------------------------------------------------------------------------------

def _sparse_attention(
    q: torch.Tensor,  # [T, h, d_qk] (any float)
    k_rows: torch.Tensor,  # [T, topk, d_qk] float32 gathered keys
    valid: torch.Tensor,  # [T, topk] bool
    sm_scale: float,
    d_v: int,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each query row over its own gathered keys; returns fp32 (out, max_logits, lse)."""
    T, h, _ = q.shape
    out = torch.empty(T, h, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(T, h, dtype=torch.float32, device=q.device)
    mx = torch.empty(T, h, dtype=torch.float32, device=q.device)
    step = max(1, _CHUNK_ELEMS // max(1, h * k_rows.shape[1]))
    for t0 in range(0, T, step):
        sl = slice(t0, t0 + step)
        # Skipped entries may point at rows holding anything (NaN in an uninitialised cache): zero them.
        k = k_rows[sl].masked_fill(~valid[sl, :, None], 0.0)  # [t, topk, d_qk]
        p = torch.einsum("thd,tkd->thk", q[sl].float(), k) * sm_scale  # [t, h, topk]
        p = p.masked_fill(~valid[sl, None, :], float("-inf"))
        m = p.amax(dim=-1)  # [t, h]
        l_ = torch.logsumexp(p, dim=-1)  # -inf when no valid key
        w = torch.exp(p - torch.where(torch.isinf(l_), torch.zeros_like(l_), l_)[..., None])
        o = torch.einsum("thk,tkd->thd", w, k[:, :, :d_v])
        empty = torch.isinf(l_)
        o = o.masked_fill(empty[..., None], 0.0)
        if attn_sink is not None:
            sink = attn_sink.float()[None, :]
            o = o * torch.sigmoid(l_ - sink)[..., None]  # exp(l)/(exp(l)+exp(s))
            o = o.masked_fill(empty[..., None], 0.0)
        out[sl] = o
        lse[sl] = torch.where(empty, torch.full_like(l_, float("inf")), l_)
        mx[sl] = m
    return out, mx, lse


def _topk_valid(indices: torch.Tensor, limit: int, topk_length: torch.Tensor | None) -> torch.Tensor:
    """indices [T, topk] -> bool mask of usable entries (in range and inside topk_length)."""
    valid = (indices >= 0) & (indices < limit)
    if topk_length is not None:
        rank = torch.arange(indices.shape[-1], device=indices.device)[None, :]
        valid &= rank < topk_length.long()[:, None]
    return valid


def flash_mla_sparse_fwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    s_kv = kv.shape[0]
    idx = indices[:, 0, :].long()  # [s_q, topk]
    valid = _topk_valid(idx, s_kv, topk_length)
    k_rows = kv[:, 0, :].float()[idx.clamp(0, max(s_kv - 1, 0))] if s_kv else \
        torch.zeros(*idx.shape, q.shape[-1], device=q.device)
    out, mx, lse = _sparse_attention(q, k_rows, valid, sm_scale, d_v, attn_sink)
    return out.to(torch.bfloat16), mx, lse


def unpack_fp8_ds_mla(packed: torch.Tensor) -> torch.Tensor:
    flat = packed.reshape(-1, DS_MLA_TOKEN_BYTES)
    N = flat.shape[0]
    nope = flat[:, :DS_MLA_NOPE_DIM].contiguous().view(FP8).float()  # [N, 512]
    scales = flat[:, DS_MLA_NOPE_DIM:DS_MLA_NOPE_DIM + 16].contiguous().view(torch.float32)  # [N, 4]
    nope = (nope.view(N, -1, DS_MLA_GROUP) * scales[:, :, None]).view(N, DS_MLA_NOPE_DIM)
    rope = flat[:, DS_MLA_NOPE_DIM + 16:].contiguous().view(torch.bfloat16).float()  # [N, 64]
    return torch.cat([nope, rope], dim=1).to(torch.bfloat16)


def _scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """``max(amax, 1e-4) / 448`` as a true division on every device (CUDA turns division by a
    Python scalar into a multiplication by its reciprocal, which can differ in the last bit)."""
    a = amax.float().clamp(min=AMAX_FLOOR)
    return a / torch.full_like(a, FP8_MAX)


def ds_mla_scales(amax: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Per-group dequantisation scale from the group's absolute maximum."""
    scale = _scale_from_amax(amax)
    if scale_format == "pow2":
        # Smallest power of two >= scale, exactly (log2 can round 2^k * (1 + eps) down to k).
        m, e = torch.frexp(scale)  # scale = m * 2**e, 0.5 <= m < 1
        scale = torch.ldexp(torch.ones_like(scale), e - (m == 0.5).int())
    return scale


def pack_fp8_ds_mla(kv: torch.Tensor, scale_format: str = "arbitrary") -> torch.Tensor:
    N = kv.shape[0]
    x = kv.float()
    nope = x[:, :DS_MLA_NOPE_DIM].view(N, -1, DS_MLA_GROUP)  # [N, 4, 128]
    scale = ds_mla_scales(nope.abs().amax(dim=-1), scale_format)  # [N, 4]
    q8 = (nope / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(N, DS_MLA_NOPE_DIM)
    rope = kv[:, DS_MLA_NOPE_DIM:].to(torch.bfloat16).contiguous()
    return torch.cat([q8.view(torch.uint8), scale.contiguous().view(torch.uint8).view(N, 16),
                      rope.view(torch.uint8).view(N, 2 * DS_MLA_ROPE_DIM)], dim=1)


def write_fp8_ds_mla_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale_format: str = "arbitrary",
) -> None:
    packed = pack_fp8_ds_mla(kv, scale_format)  # [T, 656]
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    pages = kv_cache.view(num_blocks, page, DS_MLA_TOKEN_BYTES)  # pages may be spaced apart
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_blocks * page)
    slots = slots[keep]
    pages[slots // page, slots % page] = packed[keep]


def _gather_cache_rows(kv_cache: torch.Tensor, kv_format: str, slots: torch.Tensor, d_qk: int) -> torch.Tensor:
    """Dequantised keys for global slots (clamped into range) -> float32 [..., d_qk]."""
    if kv_format == "fp8_ds_mla_v4":
        return _gather_v4_rows(kv_cache, slots)
    if kv_format == "fp8_ds_mla":
        flat = kv_cache.reshape(-1, DS_MLA_TOKEN_BYTES)
        rows = flat[slots.reshape(-1)]
        return unpack_fp8_ds_mla(rows).float().view(*slots.shape, d_qk)
    flat = kv_cache.reshape(-1, kv_cache.shape[-1])
    return flat[slots.reshape(-1)].float().view(*slots.shape, d_qk)


def sparse_mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    kv_scale_format: str | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the keys are bf16(e4m3 * scale) whatever the scale format (kv_scale_format is a kernel hint)
    if extra_indices is not None:
        return _sparse_mla_decode_two_lists(q, kv_cache, indices, sm_scale, d_v, kv_format, attn_sink, topk_length,
                                            extra_kv_cache, extra_indices, extra_topk_length)
    B, s_q, h_q, d_qk = q.shape
    topk = indices.shape[-1]
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    idx = indices.reshape(B * s_q, topk).long()
    tl_rows = topk_length.long().repeat_interleave(s_q) if topk_length is not None else None
    valid = _topk_valid(idx, n_slots, tl_rows)
    out = torch.empty(B * s_q, h_q, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(B * s_q, h_q, dtype=torch.float32, device=q.device)
    qr = q.reshape(B * s_q, h_q, d_qk)
    step = max(1, _CHUNK_ELEMS // max(1, topk * d_qk))
    for r0 in range(0, B * s_q, step):
        sl = slice(r0, r0 + step)
        k_rows = _gather_cache_rows(kv_cache, kv_format, idx[sl].clamp(0, max(n_slots - 1, 0)), d_qk)
        o, _, l_ = _sparse_attention(qr[sl], k_rows, valid[sl], sm_scale, d_v, attn_sink)
        out[sl], lse[sl] = o, l_
    out = out.view(B, s_q, h_q, d_v).to(torch.bfloat16)
    lse = lse.view(B, s_q, h_q).transpose(1, 2).contiguous()  # [B, h_q, s_q]
    return out, lse


# ----------------------------------------------------------------------------------------------
# mHC pre-norm GEMM
# ----------------------------------------------------------------------------------------------

def tf32_hc_prenorm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
) -> None:
    """fp32 (not TF32) reference: d = a @ b.T, sqr_sum = sum(a^2); split over K when d is 3-D."""
    K = a.shape[1]
    af = a.float()
    bf = b.float()
    if d.dim() == 2:
        d.copy_(af @ bf.T)
        sqr_sum.copy_((af * af).sum(-1))
        return
    S = d.shape[0]
    bounds = split_bounds(K, S)
    for s, (k0, k1) in enumerate(bounds):
        d[s].copy_(af[:, k0:k1] @ bf[:, k0:k1].T)
        sqr_sum[s].copy_((af[:, k0:k1] ** 2).sum(-1))


def split_bounds(K: int, num_splits: int, align: int = 64) -> list[tuple[int, int]]:
    """Partition [0, K) into ``num_splits`` contiguous ranges of whole ``align``-wide blocks."""
    blocks = K // align
    per = math.ceil(blocks / num_splits)
    return [(min(s * per, blocks) * align, min((s + 1) * per, blocks) * align) for s in range(num_splits)]


# ----------------------------------------------------------------------------------------------
# fp8_ds_mla_v4 (DeepSeek-V4) KV cache: packing and the normalise + rope + quantise write
# ----------------------------------------------------------------------------------------------

# Token: 448 e4m3 latent ("nope") values and 64 bf16 rope values (576 data bytes), then 7 UE8M0
# scales (one per 64 latent values) and one zero pad byte (8 scale bytes): 584 bytes. A page of P
# tokens holds the P data rows first and the P scale rows after them.
V4_NOPE_DIM = 448
V4_ROPE_DIM = 64
V4_HEAD_DIM = V4_NOPE_DIM + V4_ROPE_DIM  # 512
V4_GROUP = 64
V4_NUM_SCALES = V4_NOPE_DIM // V4_GROUP  # 7
V4_DATA_BYTES = V4_NOPE_DIM + 2 * V4_ROPE_DIM  # 576
V4_SCALE_BYTES = V4_NUM_SCALES + 1  # 8
V4_TOKEN_BYTES = V4_DATA_BYTES + V4_SCALE_BYTES  # 584


def v4_cache_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a block-split V4 cache ``uint8 [num_blocks, P, (1,) 584]`` (``stride(0)`` may be
    padded): the data rows ``[num_blocks, P, 576]`` and the scale rows ``[num_blocks, P, 8]`` of every
    token, in token order. Writing into the views writes the cache."""
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    flat = torch.as_strided(kv_cache, (num_blocks, page * V4_TOKEN_BYTES), (kv_cache.stride(0), 1))
    data = flat[:, :page * V4_DATA_BYTES].view(num_blocks, page, V4_DATA_BYTES)
    scales = flat[:, page * V4_DATA_BYTES:].view(num_blocks, page, V4_SCALE_BYTES)
    return data, scales


def ue8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 ``2 ** (code - 127)`` (255 is NaN)."""
    c = codes.to(torch.int32)
    out = torch.ldexp(torch.ones_like(c, dtype=torch.float32), c - 127)
    return torch.where(c == 255, torch.full_like(out, float("nan")), out)


def _quantise_v4(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 ``[N, 512]`` -> (data ``[N, 576]``, scale rows ``[N, 8]``) uint8."""
    N = kv.shape[0]
    nope = kv[:, :V4_NOPE_DIM].float().view(N, V4_NUM_SCALES, V4_GROUP)
    scale = ds_mla_scales(nope.abs().amax(dim=-1), "pow2")  # [N, 7], 2^ceil(log2(max(amax, 1e-4) / 448))
    q8 = (nope / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(N, V4_NOPE_DIM)
    codes = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)  # biased fp32 exponent = UE8M0 byte
    rope = kv[:, V4_NOPE_DIM:].contiguous().view(torch.uint8)  # [N, 128]
    pad = torch.zeros(N, 1, dtype=torch.uint8, device=kv.device)
    return torch.cat([q8.view(torch.uint8), rope], dim=1), torch.cat([codes, pad], dim=1)


def pack_fp8_ds_mla_v4(kv: torch.Tensor) -> torch.Tensor:
    data, scales = _quantise_v4(kv)
    return torch.cat([data, scales], dim=1)


def unpack_fp8_ds_mla_v4(packed: torch.Tensor) -> torch.Tensor:
    if packed.dim() == 2:  # one token per row: pages of size 1
        packed = packed.view(packed.shape[0], 1, V4_TOKEN_BYTES)
        squeeze = True
    else:
        squeeze = False
    data, scales = v4_cache_pages(packed)
    nb_, page = data.shape[0], data.shape[1]
    data = data.reshape(nb_ * page, V4_DATA_BYTES)
    scales = scales.reshape(nb_ * page, V4_SCALE_BYTES)
    T = data.shape[0]
    nope = data[:, :V4_NOPE_DIM].contiguous().view(FP8).float().view(T, V4_NUM_SCALES, V4_GROUP)
    nope = (nope * ue8m0_to_float(scales[:, :V4_NUM_SCALES])[:, :, None]).view(T, V4_NOPE_DIM)
    rope = data[:, V4_NOPE_DIM:].contiguous().view(torch.bfloat16)
    out = torch.cat([nope.to(torch.bfloat16), rope], dim=1)
    if squeeze:
        return out
    return out.view(*packed.shape[:-1], V4_HEAD_DIM)


def v4_kv_rms_norm(kv: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the 512 dims, rounded once to bf16: ``bf16(x * (1 / sqrt(mean(x^2) + eps)) * w)``.

    The sum of squares is taken in float64 (every square of a bf16 value is exact there), so the
    result does not depend on the order of summation; the rest is float32 with correctly rounded
    ``sqrt`` and division (no fused multiply-add). Both are computed in float64 and rounded to float32,
    which gives the correctly rounded float32 results (53 >= 2 * 24 + 2 bits) on any CPU: vectorised
    float32 ``sqrt`` of some CPU math libraries is off by an ulp now and then.
    """
    x = kv.float()
    ss = kv.double().square().sum(dim=-1, keepdim=True)
    ms = (ss / V4_HEAD_DIM).float()
    v = ms + torch.full_like(ms, eps)
    root = torch.sqrt(v.double()).float()
    rms = (1.0 / root.double()).float()
    return ((x * rms) * weight.float()).to(torch.bfloat16)


def v4_kv_rope(kv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J) rotary embedding of the last 64 dims of bf16 ``kv [T, 512]``: pairs
    ``(2i, 2i+1)`` turn by ``cos_sin_cache[pos] = [cos(32) | sin(32)]``, in float32 (no fused
    multiply-add), rounded to bf16. ``positions`` must index ``cos_sin_cache``."""
    T = kv.shape[0]
    half = V4_ROPE_DIM // 2
    cs = cos_sin_cache.float()[positions.long()]  # [T, 64]
    cos, sin = cs[:, :half], cs[:, half:]
    r = kv[:, V4_NOPE_DIM:].float().view(T, half, 2)
    even, odd = r[:, :, 0], r[:, :, 1]
    new_even = even * cos - odd * sin
    new_odd = even * sin + odd * cos
    rope = torch.stack([new_even, new_odd], dim=-1).view(T, V4_ROPE_DIM).to(torch.bfloat16)
    return torch.cat([kv[:, :V4_NOPE_DIM], rope], dim=1)


def write_fp8_ds_mla_v4_cache(
    kv: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> None:
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < num_blocks * page)
    if cos_sin_cache is not None:
        pos = positions.long()
        keep &= (pos >= 0) & (pos < cos_sin_cache.shape[0])
    x = kv[keep]
    if norm_weight is not None:
        x = v4_kv_rms_norm(x, norm_weight, eps)
    if cos_sin_cache is not None:
        x = v4_kv_rope(x, positions[keep], cos_sin_cache)
    data, scales = _quantise_v4(x)
    pages_data, pages_scales = v4_cache_pages(kv_cache)
    s = slots[keep]
    pages_data[s // page, s % page] = data
    pages_scales[s // page, s % page] = scales


# ----------------------------------------------------------------------------------------------
# Sparse MLA over the DeepSeek-V4 cache: two index lists (window + compressed), FlashMLA's contract
# ----------------------------------------------------------------------------------------------

def _gather_v4_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Dequantised V4 keys (``unpack_fp8_ds_mla_v4``) at global slots (clamped into range) -> float32
    ``[..., 512]``."""
    data, scales = v4_cache_pages(kv_cache)
    page = data.shape[1]
    s = slots.reshape(-1)
    rows = torch.cat([data[s // page, s % page], scales[s // page, s % page]], dim=1)  # [n, 584], one token each
    return unpack_fp8_ds_mla_v4(rows).float().view(*slots.shape, V4_HEAD_DIM)


def _sparse_mla_decode_two_lists(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int,
    kv_format: str,
    attn_sink: torch.Tensor | None,
    topk_length: torch.Tensor | None,
    extra_kv_cache: torch.Tensor,
    extra_indices: torch.Tensor,
    extra_topk_length: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over ``indices[:topk_length]`` of ``kv_cache`` together with
    ``extra_indices[:extra_topk_length]`` of ``extra_kv_cache``: one softmax over both key lists."""
    B, s_q, h_q, d_qk = q.shape
    R = B * s_q
    lists = ((kv_cache, indices, topk_length), (extra_kv_cache, extra_indices, extra_topk_length))
    out = torch.empty(R, h_q, d_v, dtype=torch.float32, device=q.device)
    lse = torch.empty(R, h_q, dtype=torch.float32, device=q.device)
    qr = q.reshape(R, h_q, d_qk)
    width = indices.shape[-1] + extra_indices.shape[-1]
    step = max(1, _CHUNK_ELEMS // max(1, width * d_qk))
    for r0 in range(0, R, step):
        sl = slice(r0, r0 + step)
        keys, valid = [], []
        for cache, idx, length in lists:
            n_slots = cache.shape[0] * cache.shape[1]
            rows = idx.reshape(R, idx.shape[-1]).long()
            lens = length.long().repeat_interleave(s_q) if length is not None else None
            valid.append(_topk_valid(rows, n_slots, lens)[sl])
            keys.append(_gather_cache_rows(cache, kv_format, rows[sl].clamp(0, max(n_slots - 1, 0)), d_qk))
        o, _, l_ = _sparse_attention(qr[sl], torch.cat(keys, dim=1), torch.cat(valid, dim=1), sm_scale, d_v,
                                     attn_sink)
        out[sl], lse[sl] = o, l_
    out = out.view(B, s_q, h_q, d_v).to(torch.bfloat16)
    return out, lse.view(B, s_q, h_q).transpose(1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# Lightning indexer with an MXFP4 key cache (DeepSeek-V4)
# ----------------------------------------------------------------------------------------------

# MXFP4: e2m1 values, two per byte (even element in the low nibble), one UE8M0 scale per 32 values.
MXFP4_BLOCK = 32
# Magnitudes of the eight e2m1 codes (the sign is bit 3).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
# Smallest amax used for an MXFP4 scale (all-zero blocks get the scale 2^-126, byte 1).
MXFP4_AMAX_FLOOR = 6.0 * 2.0 ** -126


def ue8m0_exponents(values: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(v))`` of positive fp32 ``values``, exactly (from the binary exponent), int32."""
    mantissa, exponent = torch.frexp(values.float())  # v = m * 2^e, 0.5 <= m < 1
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to e2m1 codes (uint8 0..15): nearest value, ties to the even code, saturating at 6."""
    a = x.abs()
    # Between codes c and c + 1 the midpoint rounds up only when c + 1 is even (c odd).
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
            + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (code | ((x < 0).int() << 3)).to(torch.uint8)


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 of the last axis (a multiple of 32): ``(packed [..., D/2] uint8, scales [..., D/32] uint8)``.

    Block scale ``2^k`` with ``k = ceil(log2(max(amax, 6 * 2^-126) / 6))`` clipped to ``[-127, 127]``, stored as
    the UE8M0 byte ``k + 127``; values ``x / 2^k`` rounded to e2m1 (nearest, ties to even, saturating).
    """
    xf = x.float()
    D = xf.shape[-1]
    blocks = xf.reshape(*xf.shape[:-1], D // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp(min=MXFP4_AMAX_FLOOR)
    k = ue8m0_exponents(amax / E2M1_MAX).clamp(-127, 127)
    codes = _e2m1_codes(blocks * torch.exp2(-k.double()).float()[..., None]).reshape(*xf.shape[:-1], D)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (k + 127).to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Values of MXFP4 rows: ``packed [..., D/2]`` and ``scales [..., D/32]`` (uint8) -> fp32 ``[..., D]``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    p = packed.view(torch.uint8).long()
    codes = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    vals = table[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = torch.exp2(scales.view(torch.uint8).double() - 127).float()
    return (vals.reshape(*scale.shape, MXFP4_BLOCK) * scale[..., None]).reshape(vals.shape)


def _indexer_q_values(q: torch.Tensor, q_scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 queries: e4m3 ``q`` as is (``q_scale`` None), or MXFP4 ``q [..., D/2]`` with ``q_scale [..., D/32]``."""
    return q.float() if q_scale is None else dequantize_mxfp4(q, q_scale)


def fp8_fp4_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> torch.Tensor:
    """Ragged logits over MXFP4 keys ``k [N, D/2]`` with scales ``k_scale [N, D/32]`` (uint8)."""
    kf = dequantize_mxfp4(k, k_scale)
    ones = torch.ones(kf.shape[0], dtype=torch.float32, device=kf.device)
    return fp8_mqa_logits(_indexer_q_values(q, q_scale), (kf, ones), weights, cu_seq_len_k_start,
                          cu_seq_len_k_end, clean_logits, max_seqlen_k)


def unpack_indexer_k_cache_fp4(kv_cache: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a paged MXFP4 indexer cache ``[P, block_kv, (1,) D/2 + D/32]`` into
    ``(packed [P, block_kv, D/2], scales [P, block_kv, D/32])`` uint8 (pages ``[data | scales]``)."""
    P, block_kv = kv_cache.shape[0], kv_cache.shape[1]
    half, ns = head_dim // 2, head_dim // MXFP4_BLOCK
    flat = kv_cache.reshape(P, -1)[:, : block_kv * (half + ns)]
    return (flat[:, : block_kv * half].reshape(P, block_kv, half),
            flat[:, block_kv * half:].reshape(P, block_kv, ns))


def fp8_fp4_paged_mqa_logits(
    q: torch.Tensor,
    q_scale: torch.Tensor | None,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor | None,
    max_context_len: int,
    clean_logits: bool = False,
) -> torch.Tensor:
    """Paged logits over an MXFP4 cache; same visibility rules as :func:`fp8_paged_mqa_logits`."""
    qf = _indexer_q_values(q, q_scale)  # [B, next_n, H, D]
    D = qf.shape[-1]
    packed, scales = unpack_indexer_k_cache_fp4(kv_cache, D)

    def page_keys(pages: torch.Tensor) -> tuple[torch.Tensor, None]:
        return dequantize_mxfp4(packed[pages], scales[pages]).reshape(-1, D), None

    return _paged_logits(qf, weights, context_lens, block_table, max_context_len, kv_cache.shape[1],
                         kv_cache.shape[0], page_keys)


def pack_indexer_k_cache_fp4(k: torch.Tensor, block_kv: int = 64) -> torch.Tensor:
    """MXFP4 paged indexer cache of float keys ``[N, D]``: ``uint8 [ceil(N / block_kv), block_kv, 1, D/2 + D/32]``,
    each page ``block_kv`` rows of packed values then ``block_kv`` rows of UE8M0 scales; unused slots zero."""
    N, D = k.shape
    P = (N + block_kv - 1) // block_kv
    packed, scales = quantize_mxfp4(k)
    half, ns = D // 2, D // MXFP4_BLOCK
    values = torch.zeros(P * block_kv, half, dtype=torch.uint8, device=k.device)
    sc = torch.zeros(P * block_kv, ns, dtype=torch.uint8, device=k.device)
    values[:N] = packed
    sc[:N] = scales
    return torch.cat([values.view(P, block_kv * half), sc.view(P, block_kv * ns)], dim=1).view(
        P, block_kv, 1, half + ns)
