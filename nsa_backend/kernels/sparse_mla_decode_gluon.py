"""Gluon sparse MLA decode over the "fp8_ds_mla" paged cache for sm_90 (split-K, merged as in ``tl``).

For a few heads per program the ``tl`` kernel waits on the latency of its key gathers: every tile's
656-byte rows are loaded into registers right before the MMAs that use them, and ``q`` lives in the
registers of every warp. This kernel keeps the gathers in flight and ``q`` in shared memory:

- one program (two warpgroups, 8 warps) handles one query row ``(b, s)``, ``BLOCK_H`` heads and one
  split of the row's top-k list; the head blocks of a row are neighbours in the launch order;
- the raw token rows of a tile of ``BLOCK_N = 64`` slots (512 e4m3 bytes, four fp32 scales, 64 bf16
  rope values) are copied with asynchronous copies (``cp.async``, 16 bytes each) into ``STAGES``
  shared-memory buffers; the next ``STAGES - 1`` tiles are in flight while a tile is consumed, and
  the indices of the tile after them are already in registers. A tile's row offsets (``-1`` for an
  invalid slot: ``< 0``, ``>= n_slots``, past ``topk_length`` or the split) are computed once and
  kept in shared memory; invalid rows are never dereferenced (masked copies read zeros) and their
  scores are set to ``-inf``;
- the latent bytes are dequantised from shared memory (``bf16(e4m3 * scale)``, exactly as the
  reference) into one bf16 tile ``K [BLOCK_N, 512]`` in the MMA's shared layout; the rope values
  are copied straight into an MMA-ready buffer;
- the warpgroup MMAs run transposed so that the keys fill the 64-row side and the few heads are the
  N side: ``S^T = K_nope q_nope^T + K_rope q_rope^T`` (``[BLOCK_N, BLOCK_H]``, heads split over the
  two warpgroups), online softmax over the keys in base 2, ``O^T += V^T P^T`` (``[512, BLOCK_H]``,
  ``V = K_nope``, latent dims split over the warpgroups). The ``P V`` MMAs run asynchronously
  during the next tile's copies and are waited for before its dequantisation overwrites ``K``.

Outputs follow ``_sparse_mla_fwd_kernel``: with one split the final bf16 ``out``, the natural-log
``lse`` (``+inf`` for a row without a valid key) and ``attn_sink``; with several splits the
normalised fp32 partial outputs and base-2 lse that ``_sparse_mla_decode_merge_kernel`` combines.

Only sm_90 with Triton's Gluon dialect (see ``nsa_backend.kernels._gluon``) runs this kernel; the
caller falls back to the ``tl`` kernel elsewhere.
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.configs.sparse_mla import decode_num_splits, split_keys
from nsa_backend.kernels._gluon import gluon_importable

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from nsa_backend.kernels._gluon import cp_async, cta_barrier
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None

# Architectures the kernel is written for.
GLUON_DECODE_ARCHS: tuple[int, ...] = (90,)
# Warps per program (two warpgroups).
GLUON_DECODE_NUM_WARPS = 8


def _plan_default(h_q: int) -> tuple[int, int, int]:
    """``(block_h, block_n, stages)`` for ``h_q`` heads.

    Two stages: on the H200 (h_q 16, topk 2048) three stages were not faster (B 128: 128.2 vs 130.7 us,
    B 32: 44.7 vs 44.8 us) and take 41 KiB more shared memory.
    """
    return (16 if h_q <= 16 else 32), 64, 2


if gluon is not None:

    @gluon.jit
    def _sparse_mla_decode_gluon_issue(
        kv_ptr, row_smem, lat_smem, sc_smem, rope_smem, b_idx, n0, n_stop, n_slots, page_size,
        stride_page, stride_row,
        BLOCK_N: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        """Start the asynchronous copies of the tile whose indices are ``b_idx`` (positions from ``n0``).

        The byte offset of every slot's row (``-1`` for an invalid slot) is computed once and kept in
        ``row_smem``: the copies read it back in their own layouts, the consumer reads the mask from it.
        """
        L_LAT: gl.constexpr = gl.BlockedLayout([1, 16], [1, 32], [NUM_WARPS, 1], [1, 0])
        L_ROPE: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1, 4], [32, 1], [NUM_WARPS, 1], [1, 0])
        L_I: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        o_n = n0 + gl.arange(0, BLOCK_N, layout=L_I)
        m_i = (o_n < n_stop) & (b_idx >= 0) & (b_idx < n_slots)
        b_slot = gl.where(m_i, b_idx, 0)
        o_row = (b_slot // page_size).to(gl.int64) * stride_page + (b_slot % page_size).to(gl.int64) * stride_row
        row_smem.store(gl.where(m_i, o_row, -1))
        cta_barrier()

        # [BN, 512] latent bytes; the launcher checks that the cache and its strides are 16-byte aligned
        o_lat = row_smem.load(gl.SliceLayout(1, L_LAT))
        p_lat = kv_ptr + gl.expand_dims(gl.multiple_of(gl.maximum(o_lat, 0), 16), 1)
        p_lat = p_lat + gl.expand_dims(gl.arange(0, 512, layout=gl.SliceLayout(0, L_LAT)), 0)
        cp_async(lat_smem, p_lat, mask=gl.expand_dims(o_lat >= 0, 1))
        # [BN, 64] bf16 rope values
        o_rp = row_smem.load(gl.SliceLayout(1, L_ROPE))
        p_rope = (kv_ptr + gl.multiple_of(gl.maximum(o_rp, 0), 16) + 528).to(gl.pointer_type(gl.bfloat16))
        p_rope = gl.expand_dims(p_rope, 1) + gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_ROPE)), 0)
        cp_async(rope_smem, p_rope, mask=gl.expand_dims(o_rp >= 0, 1))
        # [BN, 4] fp32 group scales
        o_sc = row_smem.load(gl.SliceLayout(1, L_SC))
        p_sc = (kv_ptr + gl.multiple_of(gl.maximum(o_sc, 0), 16) + 512).to(gl.pointer_type(gl.float32))
        p_sc = gl.expand_dims(p_sc, 1) + gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, L_SC)), 0)
        cp_async(sc_smem, p_sc, mask=gl.expand_dims(o_sc >= 0, 1))

    @gluon.jit
    def _sparse_mla_decode_gluon_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr,
        qk_scale,
        h_q, topk, n_slots, page_size, keys_per_split, rows_per_batch,
        stride_q_row, stride_q_head, stride_idx_row,
        stride_page, stride_row,
        stride_ob, stride_or, stride_os, stride_oh,
        stride_lb, stride_lr, stride_ls, stride_lh,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        SPLIT: gl.constexpr, HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
        NUM_WARPS: gl.constexpr,
    ):
        # ---- layouts
        L_DQ: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_Q: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [NUM_WARPS, 1], [1, 0])
        # S^T [BN, BH]: keys on the MMA's M side (one warpgroup's 64 rows), the heads split over the
        # warpgroups; O^T [128, BH] per latent group: latent dims on M, split over the warpgroups
        WG: gl.constexpr = NUM_WARPS // 4
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, BLOCK_H // WG, 16])
        L_O: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, BLOCK_H, 16])
        L_OUT: gl.constexpr = gl.BlockedLayout([4, 1], [32, 1], [1, NUM_WARPS], [0, 1])
        RAW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
        RAW1: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        K_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 128], gl.bfloat16)
        KR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
        Q_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 128], gl.bfloat16)
        QR_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, 64], gl.bfloat16)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_H], gl.bfloat16)

        # the head blocks of a row are neighbours in the launch order: they gather the same keys
        i_h = gl.program_id(0)
        i_r = gl.program_id(1).to(gl.int64)
        i_s = gl.program_id(2)
        i_b = i_r // rows_per_batch
        i_q = i_r % rows_per_batch

        # ---- shared memory
        lat_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_N, 512], RAW)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N, 4], RAW)
        rope_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], KR_SL)
        row_smem = gl.allocate_shared_memory(gl.int64, [STAGES, BLOCK_N], RAW1)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_N, 128], K_SL)
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [4, BLOCK_H, 128], Q_SL)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, 64], QR_SL)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, BLOCK_H], P_SL)

        # ---- key range of this split
        n_end = topk
        if HAS_TOPK_LEN:
            n_end = gl.minimum(gl.maximum(gl.load(topk_len_ptr + i_b), 0), topk)
        n_start = i_s * keys_per_split
        n_stop = gl.minimum(n_start + keys_per_split, n_end)
        n_tiles = gl.cdiv(gl.maximum(n_stop - n_start, 0), BLOCK_N)
        p_idx = idx_ptr + i_r * stride_idx_row
        L_N: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])

        # ---- prologue: the first STAGES - 1 tiles in flight, the indices of the next one in registers
        for t in gl.static_range(STAGES - 1):
            o_t = n_start + t * BLOCK_N + gl.arange(0, BLOCK_N, layout=L_N)
            b_idx_t = gl.load(p_idx + o_t, mask=o_t < n_stop, other=-1)
            _sparse_mla_decode_gluon_issue(
                kv_ptr, row_smem.index(t), lat_smem.index(t), sc_smem.index(t), rope_smem.index(t),
                b_idx_t, n_start + t * BLOCK_N, n_stop, n_slots, page_size, stride_page, stride_row,
                BLOCK_N, NUM_WARPS)
            async_copy.commit_group()
        o_t = n_start + (STAGES - 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=L_N)
        b_idx_nx = gl.load(p_idx + o_t, mask=o_t < n_stop, other=-1)

        # ---- q -> shared memory (zeros for heads past h_q)
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, L_Q))
        m_h = gl.expand_dims(o_h < h_q, 1)
        p_q = q_ptr + i_r * stride_q_row + gl.expand_dims(o_h.to(gl.int64) * stride_q_head, 1)
        o_qc = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, L_Q)), 0)
        for g in gl.static_range(4):
            q_smem.index(g).store(gl.load(p_q + g * 128 + o_qc, mask=m_h, other=0.0))
        o_qr = gl.expand_dims(gl.arange(0, 64, layout=gl.SliceLayout(0, L_Q)), 0)
        qr_smem.store(gl.load(p_q + 512 + o_qr, mask=m_h, other=0.0))

        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(0, L_S))
        b_l = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(0, L_S))
        b_acc0 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc1 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc2 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        b_acc3 = gl.zeros([128, BLOCK_H], gl.float32, layout=L_O)
        t_acc0 = warpgroup_mma_init(b_acc0)
        t_acc1 = warpgroup_mma_init(b_acc1)
        t_acc2 = warpgroup_mma_init(b_acc2)
        t_acc3 = warpgroup_mma_init(b_acc3)

        for i in range(n_tiles):
            # copies of tile i + STAGES - 1 (its buffers were consumed one iteration ago)
            j = i + STAGES - 1
            st_j = j % STAGES
            b_idx = b_idx_nx
            o_n = n_start + (j + 1) * BLOCK_N + gl.arange(0, BLOCK_N, layout=L_N)
            b_idx_nx = gl.load(p_idx + o_n, mask=o_n < n_stop, other=-1)
            _sparse_mla_decode_gluon_issue(
                kv_ptr, row_smem.index(st_j), lat_smem.index(st_j), sc_smem.index(st_j),
                rope_smem.index(st_j), b_idx, n_start + j * BLOCK_N, n_stop, n_slots, page_size,
                stride_page, stride_row, BLOCK_N, NUM_WARPS)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)
            cta_barrier()

            # the P V MMAs of the previous tile ran during the copies; they read k_smem
            b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[t_acc0, t_acc1, t_acc2, t_acc3])
            cta_barrier()
            st = i % STAGES
            # dequantise the four latent groups: bf16(e4m3 * scale)
            lat = lat_smem.index(st)
            sc = sc_smem.index(st)
            for g in gl.static_range(4):
                # [BN, 1] scales of group g, broadcast over the group's 128 values
                b_sg = sc.slice(g, 1, dim=1).load(L_DQ)
                b_raw = lat.slice(g * 128, 128, dim=1).load(L_DQ)
                b_kf = b_raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * b_sg
                k_smem.index(g).store(b_kf.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()

            # S^T [BN, BH]
            b_s = gl.zeros([BLOCK_N, BLOCK_H], gl.float32, layout=L_S)
            for g in gl.static_range(4):
                b_s = warpgroup_mma(k_smem.index(g), q_smem.index(g).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma(rope_smem.index(st), qr_smem.permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=[b_s])
            b_iv = row_smem.index(st).load(gl.SliceLayout(1, L_S))
            b_s = gl.where(gl.expand_dims(b_iv >= 0, 1), b_s * qk_scale, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=0))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 0))
            b_alpha = gl.exp2(b_m - b_m_use)
            b_l = b_l * b_alpha + gl.sum(b_p, axis=0)
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()
            # O^T [512, BH] += V^T P^T
            b_a = gl.expand_dims(gl.convert_layout(b_alpha, gl.SliceLayout(0, L_O)), 0)
            t_acc0 = warpgroup_mma(k_smem.index(0).permute((1, 0)), p_smem, b_acc0 * b_a, is_async=True)
            t_acc1 = warpgroup_mma(k_smem.index(1).permute((1, 0)), p_smem, b_acc1 * b_a, is_async=True)
            t_acc2 = warpgroup_mma(k_smem.index(2).permute((1, 0)), p_smem, b_acc2 * b_a, is_async=True)
            t_acc3 = warpgroup_mma(k_smem.index(3).permute((1, 0)), p_smem, b_acc3 * b_a, is_async=True)
        b_acc0, b_acc1, b_acc2, b_acc3 = warpgroup_mma_wait(0, deps=[t_acc0, t_acc1, t_acc2, t_acc3])
        async_copy.wait_group(0)

        # ---- epilogue
        m_empty = b_l == 0.0
        b_inv = 1.0 / gl.where(m_empty, 1.0, b_l)
        b_lse2 = gl.where(m_empty, float("-inf"), b_m + gl.log2(gl.where(m_empty, 1.0, b_l)))
        o_hl = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, L_S))
        m_hl = o_hl < h_q
        o_lh = i_b * stride_lb + i_q * stride_lr + i_s * stride_ls + o_hl.to(gl.int64) * stride_lh
        if SPLIT:
            gl.store(lse_ptr + o_lh, b_lse2, mask=m_hl)
        else:
            b_lse = gl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
            if HAS_SINK:
                b_sink = gl.load(sink_ptr + o_hl, mask=m_hl, other=0.0)
                b_inv = b_inv / (1.0 + gl.exp(b_sink - gl.where(m_empty, 0.0, b_lse)))
            gl.store(lse_ptr + o_lh, b_lse, mask=m_hl)
        b_inv_o = gl.expand_dims(gl.convert_layout(b_inv, gl.SliceLayout(0, L_OUT)), 0)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(0, L_OUT))
        m_ho = gl.expand_dims(o_ho < h_q, 0)
        o_d = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(1, L_OUT)), 1)
        p_out = (out_ptr + i_b * stride_ob + i_q * stride_or + i_s * stride_os
                 + gl.expand_dims(o_ho.to(gl.int64) * stride_oh, 0) + o_d)
        _sparse_mla_decode_gluon_store(p_out, b_acc0, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 128, b_acc1, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 256, b_acc2, b_inv_o, m_ho, SPLIT, L_OUT)
        _sparse_mla_decode_gluon_store(p_out + 384, b_acc3, b_inv_o, m_ho, SPLIT, L_OUT)

    @gluon.jit
    def _sparse_mla_decode_gluon_store(p_out, b_acc, b_inv, m_h, SPLIT: gl.constexpr, L_OUT: gl.constexpr):
        """Write one normalised [128, BLOCK_H] block of O^T (fp32 partial or final bf16)."""
        b_o = gl.convert_layout(b_acc, L_OUT) * b_inv
        if SPLIT:
            gl.store(p_out, b_o, mask=m_h)
        else:
            gl.store(p_out, b_o.to(gl.bfloat16), mask=m_h)


def gluon_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_format: str, d_v: int,
                           arch: int | None) -> bool:
    """Whether :func:`sparse_mla_decode_gluon` can run this call (the caller checks ``gluon_enabled``).

    The fp8 cache only, ``d_qk = 576`` and ``d_v = 512``, 16-byte aligned cache rows and pages (the
    copies move 16 bytes at a time) and an sm_90 launch.
    """
    if kv_format != "fp8_ds_mla" or q.shape[-1] != 576 or d_v != 512 or arch not in GLUON_DECODE_ARCHS:
        return False
    if kv_cache.data_ptr() % 16 or kv_cache.stride(0) % 16 or kv_cache.stride(1) % 16:
        return False
    return q.shape[2] > 0


def decode_gluon_plan(B: int, s_q: int, h_q: int, topk: int, num_sms: int, block_h: int | None = None,
                      block_n: int | None = None, stages: int | None = None,
                      num_splits: int | None = None) -> tuple[int, int, int, int, int]:
    """``(block_h, block_n, stages, num_splits, keys_per_split)``: a function of the shapes only.

    One program fills an SM's shared memory, so the top-k list is split (the rule of
    ``configs.sparse_mla.decode_num_splits``) until the programs of all rows and head blocks make one
    wave of one program per SM.
    """
    bh, bn, _ = _plan_default(h_q)
    bh, bn = block_h or bh, block_n or bn
    st = stages or _plan_default(bh)[2]
    if num_splits is None:
        splits, per = decode_num_splits(B * s_q, triton.cdiv(h_q, bh), topk, bn, num_sms, programs_per_sm=1)
    else:
        splits, per = split_keys(topk, num_splits, bn)
    return bh, bn, st, splits, per


def sparse_mla_decode_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    kv_format: str = "fp8_ds_mla",
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    *,
    block_h: int | None = None,
    block_n: int | None = None,
    stages: int | None = None,
    num_splits: int | None = None,
    num_warps: int = GLUON_DECODE_NUM_WARPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.sparse_mla_decode` for the "fp8_ds_mla" cache on sm_90.

    Same parameters and results as ``sparse_mla_decode_triton``; the inputs must pass
    :func:`gluon_decode_supported`. ``block_h``, ``block_n``, ``stages`` and ``num_splits`` override
    the plan of :func:`decode_gluon_plan`.
    """
    from nsa_backend.configs.sparse_mla import MERGE_BLOCK_H, MERGE_NUM_WARPS
    from nsa_backend.kernels._arch import device_sms
    from nsa_backend.kernels.sparse_mla_decode import _sparse_mla_decode_merge_kernel
    from nsa_backend.kernels.sparse_mla_prefill import LOG2E

    B, s_q, h_q, _ = q.shape
    topk = indices.shape[-1]
    dev = q.device
    out = torch.empty(B, s_q, h_q, d_v, dtype=torch.bfloat16, device=dev)
    lse = torch.empty(B, h_q, s_q, dtype=torch.float32, device=dev)
    if B == 0:
        return out, lse
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    R = B * s_q
    idx = indices.view(R, topk)
    bh, bn, st, splits, per = decode_gluon_plan(B, s_q, h_q, topk, device_sms(dev, 8), block_h, block_n,
                                                stages, num_splits)
    head_blocks = triton.cdiv(h_q, bh)
    common = dict(BLOCK_H=bh, BLOCK_N=bn, STAGES=st, HAS_SINK=attn_sink is not None,
                  HAS_TOPK_LEN=topk_length is not None, NUM_WARPS=num_warps, num_warps=num_warps)
    args = (sm_scale * LOG2E, h_q, topk, num_blocks * page, page, per, s_q,
            q.stride(1), q.stride(2), idx.stride(0), kv_cache.stride(0), kv_cache.stride(1))
    if splits == 1:
        _sparse_mla_decode_gluon_kernel[(head_blocks, R, 1)](
            q, kv_cache, idx, attn_sink, topk_length, out, lse, *args,
            out.stride(0), out.stride(1), 0, out.stride(2),
            lse.stride(0), lse.stride(2), 0, lse.stride(1),
            SPLIT=False, **common,
        )
        return out, lse
    part_o = torch.empty(R, splits, h_q, d_v, dtype=torch.float32, device=dev)
    part_lse = torch.empty(R, splits, h_q, dtype=torch.float32, device=dev)
    _sparse_mla_decode_gluon_kernel[(head_blocks, R, splits)](
        q, kv_cache, idx, None, topk_length, part_o, part_lse, *args,
        s_q * part_o.stride(0), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        s_q * part_lse.stride(0), part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
        SPLIT=True, **{**common, "HAS_SINK": False},
    )
    _sparse_mla_decode_merge_kernel[(R, triton.cdiv(h_q, MERGE_BLOCK_H))](
        part_o, part_lse, attn_sink, out, lse, h_q, s_q, splits,
        D_V=d_v, BLOCK_H=MERGE_BLOCK_H, num_warps=MERGE_NUM_WARPS,
    )
    return out, lse
