"""Gluon paged indexer logits for sm_90 (Hopper): the MMA of one key tile overlaps the epilogue of another.

:func:`fp8_paged_mqa_logits_gluon` computes :func:`nsa_backend.fp8_paged_mqa_logits` for one or two
query rows per request (``next_n`` 1 or 2), ``D = 128``, pages of 64 keys and 16-byte aligned
pages; the launcher ``nsa_backend.kernels.indexer.fp8_paged_mqa_logits_triton`` calls it where
:func:`supported` says so (``configs.indexer.PAGED_GLUON`` / ``PAGED_GLUON_CP`` /
``PAGED_GLUON_HEADS``) and keeps the ``tl`` kernel otherwise.

    logits[r, t] = k_scale[t] * sum_h relu(q[r, h] . k[t]) * w[r, h]

A program handles all ``NP = next_n`` rows of one request and one chunk of its keys, one page (64
keys) per tile; one warpgroup computes:

- the rows' ``q`` tiles ``[HP, 128]`` (heads padded to ``HP``, zero-filled) are copied once into
  NVMMA-swizzled shared memory and stay there; the weights stay in registers;
- per tile and row, ``S^T = K q^T`` (``[64 keys, HP heads]``, the keys on the MMA's M side) is an
  asynchronous warpgroup MMA with both operands in shared memory, so the head sum stays inside each
  thread and its quad. MMAs and epilogues are interleaved with one accumulator per MMA in flight:
  at ``next_n`` 2, row 1's MMA runs during row 0's epilogue and row 0's MMA of the next tile during
  row 1's epilogue; at ``next_n`` 1, the next tile's MMA runs during the epilogue. The loop body
  covers ``UNROLL`` tiles and no MMA stays in flight across iterations (ptxas serialises the
  warpgroup MMAs of a loop whose accumulators are read while one is in flight across the back
  edge), so the last epilogue of each iteration runs alone;
- the epilogue is ``k_scale * sum_h relu(s) w`` (the scale is applied after the head sum, as in
  the reference, so any fp32 scale is exact), ``-inf`` for keys a row does not see (past its
  visible length or the block table, or on a page id outside the cache), and a store of the 64
  logits.

The key tiles ``[64, 128]`` (fp8) and their 64 fp32 scales come into a ring of ``STAGES`` buffers
in one of three ways (``configs.indexer.PagedGluonConfig``):

- ``_indexer_paged_gluon_ws_kernel`` (shipped where TMA applies): warp-specialised, a one-warp
  loader partition issues two TMA copies per page (the cache viewed as rows of 128 bytes, which
  needs a page stride of whole rows) as soon as the compute warpgroup releases a buffer, through
  ``full`` / ``empty`` mbarriers; the compute warpgroup has no CTA barrier per tile;
- ``_indexer_paged_gluon_kernel`` with TMA: the compute warpgroup issues the copies itself,
  ``STAGES - 1`` tiles ahead (a buffer is refilled after the barrier that follows its last read);
- ``_indexer_paged_gluon_kernel`` with ``cp.async`` (16-byte copies by every thread), for page
  strides TMA cannot address.

Keys of the chunk past the request's longest visible length are filled with ``-inf`` without
reading the cache. Every copy reads inside the cache: page ids outside ``[0, num_pages)`` read page
0 (their keys are ``-inf``); padding tiles of the last iteration read a valid page (TMA) or nothing
(masked ``cp.async``).

On the host, the TMA descriptors of a cache are built once and reused while the cache keeps its
address, shape and strides (``_cached_descriptors``, the last ``DESCRIPTOR_CACHE_SIZE`` caches), and
the launch (configuration, chunk, grid) is computed once per shape, which keeps eager calls close to
the ``tl`` kernel's host cost.

Only sm_90 with Triton's Gluon dialect (see ``nsa_backend.kernels._gluon``) runs this kernel.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import replace

import torch
import triton

from nsa_backend.configs import indexer as cfgs
from nsa_backend.kernels._arch import device_sms
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable

# Whether the paged launcher takes this kernel where :func:`supported` allows it.
ENABLED = True
# Capabilities the kernel is written for (warpgroup MMA, fp8 operands).
GLUON_ARCHS: tuple[int, ...] = (90,)
PAGE = 64
HEAD_DIM = 128
# Query rows per request the kernel computes (a program reads each page once for all of them).
NEXT_NS: tuple[int, ...] = (1, 2)
NUM_WARPS = 4

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from nsa_backend.kernels._gluon import cp_async, cta_barrier, tma_load
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


if gluon is not None:

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton >= 3.7

        @gluon.jit
        def _indexer_paged_gluon_as_rows(smem, STAGES: gl.constexpr, PAGE: gl.constexpr, layout: gl.constexpr):
            return smem.reinterpret(gl.float32, [STAGES, PAGE], layout)
    else:

        @gluon.jit
        def _indexer_paged_gluon_as_rows(smem, STAGES: gl.constexpr, PAGE: gl.constexpr, layout: gl.constexpr):
            return smem._reinterpret(gl.float32, [STAGES, PAGE], layout)

    @gluon.jit
    def _indexer_paged_gluon_load(kv_ptr, k_desc, sc_desc, k_dst, sc_dst, bar, i_pg, live, num_pages, stride_page,
                                  page_rows, PAGE: gl.constexpr, D: gl.constexpr, TMA: gl.constexpr,
                                  L_K: gl.constexpr, L_SC: gl.constexpr):
        """Start the copies of one page (``[PAGE, D]`` fp8 keys, ``[PAGE]`` fp32 scales) into ``k_dst`` /
        ``sc_dst``; a page id outside the cache reads page 0.

        ``TMA``: two tensor-memory-accelerator copies (one thread) that complete on ``bar``; ``live``
        False issues nothing. Otherwise ``cp.async`` copies by every thread, committed as one group;
        ``live`` False zero-fills (reads nothing)."""
        m_pg = (i_pg >= 0) & (i_pg < num_pages)
        i_pg = gl.where(m_pg, i_pg, 0)
        if TMA:
            mbarrier.expect(bar, PAGE * D + PAGE * 4, pred=live)
            tma_load(k_desc, [i_pg * page_rows, 0], bar, k_dst, pred=live)
            tma_load(sc_desc, [i_pg, 0], bar, sc_dst, pred=live)
        else:
            o_pg = i_pg.to(gl.int64) * stride_page
            n_live = live.to(gl.int32) * PAGE
            o_r = gl.arange(0, PAGE, layout=gl.SliceLayout(1, L_K))
            o_d = gl.arange(0, D, layout=gl.SliceLayout(0, L_K))
            p_k = kv_ptr + o_pg + gl.expand_dims(o_r * D, 1) + gl.expand_dims(o_d, 0)  # [PAGE, D]
            m_k = gl.expand_dims(o_r < n_live, 1) & gl.expand_dims(o_d < D, 0)
            cp_async(k_dst, p_k.to(gl.pointer_type(gl.float8e4nv)), mask=m_k)
            o_s = gl.arange(0, PAGE, layout=L_SC)
            p_sc = (kv_ptr + o_pg + PAGE * D + o_s * 4).to(gl.pointer_type(gl.float32))  # [PAGE]
            cp_async(sc_dst, p_sc, mask=o_s < n_live)
            async_copy.commit_group()

    @gluon.jit
    def _indexer_paged_gluon_landed(bars, j, n_it, PENDING: gl.constexpr, STAGES: gl.constexpr,
                                    TMA: gl.constexpr):
        """Wait until key tile ``j`` is in shared memory (this thread's view; a CTA barrier follows):
        its mbarrier phase, or all but the ``PENDING`` newest ``cp.async`` groups."""
        if TMA:
            mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1, pred=j < n_it)
        else:
            async_copy.wait_group(PENDING)
            fence_async_shared()

    @gluon.jit
    def _indexer_paged_gluon_window(ctx_ptr, i_b, row0, row1, i_c, next_n, max_ctx, max_blocks, chunk,
                                    PAGE: gl.constexpr, CTX_2D: gl.constexpr):
        """Keys visible to rows ``row0`` and ``row1`` of request ``i_b`` (clamped to ``[0, max_ctx]`` and to the
        block table), the chunk ``[c0, c1)`` of program ``i_c`` and its tiles with a visible key."""
        if CTX_2D:
            vis0 = gl.load(ctx_ptr + i_b.to(gl.int64) * next_n + row0)
            vis1 = gl.load(ctx_ptr + i_b.to(gl.int64) * next_n + row1)
        else:
            n_ctx = gl.load(ctx_ptr + i_b)
            vis0 = n_ctx - next_n + 1 + row0
            vis1 = n_ctx - next_n + 1 + row1
        vis0 = gl.minimum(gl.maximum(vis0, 0), max_ctx)
        vis1 = gl.minimum(gl.maximum(vis1, 0), max_ctx)
        kmax = gl.minimum(gl.maximum(vis0, vis1), max_blocks * PAGE)
        vis0 = gl.minimum(vis0, kmax)
        vis1 = gl.minimum(vis1, kmax)
        c0 = i_c * chunk
        c1 = gl.minimum(c0 + chunk, max_ctx)
        n_tiles = gl.cdiv(gl.maximum(gl.minimum(c1, kmax) - c0, 0), PAGE)
        return vis0, vis1, c0, c1, n_tiles

    @gluon.jit
    def _indexer_paged_gluon_fill(p_row0, p_row1, t_lo, c1, NP: gl.constexpr, PAGE: gl.constexpr,
                                  NUM_WARPS: gl.constexpr):
        """``-inf`` for the keys ``[t_lo, c1)`` of the chunk, which no row of the request sees."""
        L_F: gl.constexpr = gl.BlockedLayout([2], [32], [NUM_WARPS], [0])
        b_inf = gl.full([PAGE], float("-inf"), gl.float32, layout=L_F)
        o_f = gl.arange(0, PAGE, layout=L_F)
        for t0 in range(t_lo, c1, PAGE):
            gl.store(p_row0 + t0 + o_f, b_inf, mask=t0 + o_f < c1)
            if NP == 2:
                gl.store(p_row1 + t0 + o_f, b_inf, mask=t0 + o_f < c1)

    @gluon.jit
    def _indexer_paged_gluon_row(b_s, b_w, b_sc, o_t, vis, m_pg, p_row, c1):
        """Logits of one row against one key tile: ``[PAGE]`` stored at ``p_row + o_t``."""
        b_l = gl.sum(gl.maximum(b_s, 0.0) * gl.expand_dims(b_w, 0), axis=1) * b_sc  # [PAGE]
        b_l = gl.where((o_t < vis) & m_pg, b_l, float("-inf"))
        gl.store(p_row + o_t, b_l, mask=o_t < c1)

    @gluon.jit
    def _indexer_paged_gluon_rows(q_smem, q_ptr, w_ptr, out_ptr, i_b, next_n, H, stride_out, NP: gl.constexpr,
                                  HP: gl.constexpr, D: gl.constexpr, L_K: gl.constexpr, COL: gl.constexpr):
        """Start the copy of request ``i_b``'s ``NP`` q tiles ``[HP, D]`` into ``q_smem`` (one cp.async
        group; heads past ``H`` zero-filled); return the rows' weights ``[HP]`` and output row pointers."""
        o_qh = gl.arange(0, HP, layout=gl.SliceLayout(1, L_K))
        o_qd = gl.arange(0, D, layout=gl.SliceLayout(0, L_K))
        m_q = gl.expand_dims(o_qh < H, 1) & gl.expand_dims(o_qd < D, 0)
        o_q0 = (i_b.to(gl.int64) * next_n * H + o_qh) * D  # [HP]
        p_q0 = q_ptr + gl.expand_dims(o_q0, 1) + gl.expand_dims(o_qd, 0)  # [HP, D]
        cp_async(q_smem.index(0), p_q0, mask=m_q)
        if NP == 2:
            cp_async(q_smem.index(1), p_q0 + H * D, mask=m_q)
        async_copy.commit_group()
        o_wh = gl.arange(0, HP, layout=COL)
        p_w0 = w_ptr + i_b.to(gl.int64) * next_n * H + o_wh
        b_w0 = gl.load(p_w0, mask=o_wh < H, other=0.0)  # [HP]
        b_w1 = gl.load(p_w0 + (NP - 1) * H, mask=o_wh < H, other=0.0)  # [HP]
        p_row0 = out_ptr + i_b.to(gl.int64) * next_n * stride_out
        p_row1 = p_row0 + (NP - 1) * stride_out
        return b_w0, b_w1, p_row0, p_row1

    @gluon.jit
    def _indexer_paged_gluon_kernel(
        q_ptr, kv_ptr, k_desc, sc_desc, w_ptr, ctx_ptr, bt_ptr, out_ptr,
        H, max_ctx, num_pages, max_blocks, stride_bt, stride_page, page_rows, stride_out, next_n, chunk,
        NP: gl.constexpr, D: gl.constexpr, HP: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        UNROLL: gl.constexpr, TMA: gl.constexpr, CTX_2D: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        gl.static_assert(STAGES >= 3)
        gl.static_assert((NP == 1) | (NP == 2))
        # S^T [PAGE, HP] per row: keys on the M side (16 per warp), heads on N inside each warp
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HP, 32])
        L_K: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([4], [32], [NUM_WARPS], [0])
        KQ_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        SC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        ROW: gl.constexpr = gl.SliceLayout(1, L_S)
        COL: gl.constexpr = gl.SliceLayout(0, L_S)

        i_b = gl.program_id(0)
        i_c = gl.program_id(1)
        vis0, vis1, c0, c1, n_tiles = _indexer_paged_gluon_window(ctx_ptr, i_b, 0, NP - 1, i_c, next_n, max_ctx,
                                                                  max_blocks, chunk, PAGE, CTX_2D)
        n_it = gl.cdiv(n_tiles, UNROLL) * UNROLL  # tiles the loop computes (the last ones may be padding)
        # tiles copied: every computed tile (TMA: each copy must be waited for), or the real ones
        # (cp.async: padding tiles are zero-filled without reading)
        if TMA:
            n_copy = n_it
        else:
            n_copy = n_tiles

        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D], KQ_SL)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [NP, HP, D], KQ_SL)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        if TMA:
            sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, PAGE], sc_desc.layout)
            sc_rows = _indexer_paged_gluon_as_rows(sc_smem, STAGES, PAGE, SC_SL)
            for s in gl.static_range(STAGES):
                mbarrier.init(bars.index(s), count=1)
        else:
            sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE], SC_SL)
            sc_rows = sc_smem

        # q of every row (heads past H zero-filled), its own copy group
        b_w0, b_w1, p_row0, p_row1 = _indexer_paged_gluon_rows(q_smem, q_ptr, w_ptr, out_ptr, i_b, next_n, H,
                                                               stride_out, NP, HP, D, L_K, COL)

        # the first STAGES - 1 tiles in flight
        p_bt = bt_ptr + i_b.to(gl.int64) * stride_bt
        tile0 = c0 // PAGE
        last = max_blocks - 1
        if TMA:
            fence_async_shared()  # barrier initialisation before the copies that complete on them
        for t in gl.static_range(STAGES - 1):
            i_pg = gl.load(p_bt + gl.minimum(tile0 + t, last))
            _indexer_paged_gluon_load(kv_ptr, k_desc, sc_desc, k_smem.index(t), sc_smem.index(t), bars.index(t),
                                      i_pg, t < n_copy, num_pages, stride_page, page_rows, PAGE, D, TMA, L_K, L_SC)
        if TMA:
            async_copy.wait_group(0)  # q
            fence_async_shared()
        # cp.async groups: q, tiles 0 .. STAGES - 2
        _indexer_paged_gluon_landed(bars, 0, n_it, STAGES - 2, STAGES, TMA)
        cta_barrier()

        # UNROLL tiles per iteration, NP MMAs per tile; every epilogue but the iteration's last runs
        # while the next MMA does. No MMA is in flight across iterations (ptxas would serialise them).
        # Padding tiles past the chunk have keys at or past hi: -inf (vis <= kmax) or not stored (>= c1).
        # After the barrier of tile j, tile j - 1 is no longer read: tile j + STAGES - 1 is copied into
        # its buffer.
        b_zero = gl.zeros([PAGE, HP], gl.float32, layout=L_S)
        o_n = gl.arange(0, PAGE, layout=ROW)
        for i in range(n_it // UNROLL):
            j0 = i * UNROLL
            st = j0 % STAGES
            t_r0 = warpgroup_mma(k_smem.index(st), q_smem.index(0).permute((1, 0)), b_zero, use_acc=False,
                                 is_async=True)
            if NP == 2:
                t_r1 = warpgroup_mma(k_smem.index(st), q_smem.index(1).permute((1, 0)), b_zero, use_acc=False,
                                     is_async=True)
            for u in gl.static_range(UNROLL):
                j = j0 + u
                st = j % STAGES
                jn = j + STAGES - 1
                i_pg = gl.load(p_bt + gl.minimum(tile0 + j, last))
                i_ld = gl.load(p_bt + gl.minimum(tile0 + jn, last))
                b_sc = sc_rows.index(st).load(ROW)  # [PAGE]
                m_pg = (i_pg >= 0) & (i_pg < num_pages)
                o_t = c0 + j * PAGE + o_n
                if NP == 2:
                    b_s = warpgroup_mma_wait(1, deps=[t_r0])
                    _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
                # cp.async groups up to tile j + STAGES - 2
                _indexer_paged_gluon_landed(bars, j + 1, n_it, STAGES - 3, STAGES, TMA)
                cta_barrier()
                _indexer_paged_gluon_load(kv_ptr, k_desc, sc_desc, k_smem.index(jn % STAGES),
                                          sc_smem.index(jn % STAGES), bars.index(jn % STAGES), i_ld,
                                          jn < n_copy, num_pages, stride_page, page_rows, PAGE, D, TMA, L_K, L_SC)
                st_n = (j + 1) % STAGES
                if NP == 2:
                    if u < UNROLL - 1:
                        t_n0 = warpgroup_mma(k_smem.index(st_n), q_smem.index(0).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        b_s = warpgroup_mma_wait(1, deps=[t_r1])
                        _indexer_paged_gluon_row(b_s, b_w1, b_sc, o_t, vis1, m_pg, p_row1, c1)
                        t_n1 = warpgroup_mma(k_smem.index(st_n), q_smem.index(1).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        t_r0 = t_n0
                        t_r1 = t_n1
                    else:
                        b_s = warpgroup_mma_wait(0, deps=[t_r1])
                        _indexer_paged_gluon_row(b_s, b_w1, b_sc, o_t, vis1, m_pg, p_row1, c1)
                else:
                    # one row: tile j + 1's MMA runs during tile j's epilogue
                    if u < UNROLL - 1:
                        t_n0 = warpgroup_mma(k_smem.index(st_n), q_smem.index(0).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        b_s = warpgroup_mma_wait(1, deps=[t_r0])
                        _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
                        t_r0 = t_n0
                    else:
                        b_s = warpgroup_mma_wait(0, deps=[t_r0])
                        _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
        async_copy.wait_group(0)

        _indexer_paged_gluon_fill(p_row0, p_row1, c0 + n_tiles * PAGE, c1, NP, PAGE, NUM_WARPS)

    @gluon.jit
    def _indexer_paged_gluon_ws_loader(k_desc, sc_desc, bt_ptr, i_b, stride_bt, tile0, last, n_it, num_pages,
                                       page_rows, k_smem, sc_smem, full_bars, empty_bars,
                                       PAGE: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """Loader partition (one warp): TMA copies of every tile into the buffer the consumers released;
        the block-table entry of the next tile is read one tile ahead."""
        p_bt = bt_ptr + i_b.to(gl.int64) * stride_bt
        i_pg_nx = gl.load(p_bt + gl.minimum(tile0, last))
        for t in range(n_it):
            st = t % STAGES
            i_pg = i_pg_nx
            i_pg_nx = gl.load(p_bt + gl.minimum(tile0 + t + 1, last))
            i_pg = gl.where((i_pg >= 0) & (i_pg < num_pages), i_pg, 0)
            # wait until the consumers released this buffer (passes at once on its first use)
            mbarrier.wait(empty_bars.index(st), ((t // STAGES) & 1) ^ 1)
            bar = full_bars.index(st)
            mbarrier.expect(bar, PAGE * D + PAGE * 4)
            tma_load(k_desc, [i_pg * page_rows, 0], bar, k_smem.index(st))
            tma_load(sc_desc, [i_pg, 0], bar, sc_smem.index(st))

    @gluon.jit
    def _indexer_paged_gluon_ws_release(empty_bars, st):
        """Release buffer ``st`` to the loader: one arrival per consumer thread (no copy of its own is
        pending, so the arrival is immediate)."""
        async_copy.mbarrier_arrive(empty_bars.index(st), increment_count=False)

    @gluon.jit
    def _indexer_paged_gluon_ws_consumer(q_ptr, w_ptr, bt_ptr, out_ptr, i_b, H, next_n, stride_bt, stride_out,
                                         num_pages, tile0, last, c0, c1, vis0, vis1, n_it,
                                         k_smem, sc_smem, q_smem, full_bars, empty_bars,
                                         NP: gl.constexpr, D: gl.constexpr, HP: gl.constexpr, PAGE: gl.constexpr,
                                         STAGES: gl.constexpr, UNROLL: gl.constexpr, NUM_WARPS: gl.constexpr):
        """Compute partition (one warpgroup): ``q`` into shared memory, then per tile the MMAs of the rows
        and their epilogues, interleaved as in ``_indexer_paged_gluon_kernel``; each buffer is
        released as soon as its MMAs are complete and its scales read."""
        L_S: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, HP, 32])
        L_K: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        SC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        ROW: gl.constexpr = gl.SliceLayout(1, L_S)
        COL: gl.constexpr = gl.SliceLayout(0, L_S)
        sc_rows = _indexer_paged_gluon_as_rows(sc_smem, STAGES, PAGE, SC_SL)
        b_w0, b_w1, p_row0, p_row1 = _indexer_paged_gluon_rows(q_smem, q_ptr, w_ptr, out_ptr, i_b, next_n, H,
                                                               stride_out, NP, HP, D, L_K, COL)
        p_bt = bt_ptr + i_b.to(gl.int64) * stride_bt
        async_copy.wait_group(0)
        fence_async_shared()
        cta_barrier()

        b_zero = gl.zeros([PAGE, HP], gl.float32, layout=L_S)
        o_n = gl.arange(0, PAGE, layout=ROW)
        for i in range(n_it // UNROLL):
            j0 = i * UNROLL
            st = j0 % STAGES
            mbarrier.wait(full_bars.index(st), (j0 // STAGES) & 1)
            t_r0 = warpgroup_mma(k_smem.index(st), q_smem.index(0).permute((1, 0)), b_zero, use_acc=False,
                                 is_async=True)
            if NP == 2:
                t_r1 = warpgroup_mma(k_smem.index(st), q_smem.index(1).permute((1, 0)), b_zero, use_acc=False,
                                     is_async=True)
            for u in gl.static_range(UNROLL):
                j = j0 + u
                st = j % STAGES
                st_n = (j + 1) % STAGES
                i_pg = gl.load(p_bt + gl.minimum(tile0 + j, last))
                b_sc = sc_rows.index(st).load(ROW)  # [PAGE]
                m_pg = (i_pg >= 0) & (i_pg < num_pages)
                o_t = c0 + j * PAGE + o_n
                if NP == 2:
                    b_s = warpgroup_mma_wait(1, deps=[t_r0])
                    _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
                    if u < UNROLL - 1:
                        mbarrier.wait(full_bars.index(st_n), ((j + 1) // STAGES) & 1)
                        t_n0 = warpgroup_mma(k_smem.index(st_n), q_smem.index(0).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        b_s = warpgroup_mma_wait(1, deps=[t_r1])
                        _indexer_paged_gluon_ws_release(empty_bars, st)
                        _indexer_paged_gluon_row(b_s, b_w1, b_sc, o_t, vis1, m_pg, p_row1, c1)
                        t_n1 = warpgroup_mma(k_smem.index(st_n), q_smem.index(1).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        t_r0 = t_n0
                        t_r1 = t_n1
                    else:
                        b_s = warpgroup_mma_wait(0, deps=[t_r1])
                        _indexer_paged_gluon_ws_release(empty_bars, st)
                        _indexer_paged_gluon_row(b_s, b_w1, b_sc, o_t, vis1, m_pg, p_row1, c1)
                else:
                    if u < UNROLL - 1:
                        mbarrier.wait(full_bars.index(st_n), ((j + 1) // STAGES) & 1)
                        t_n0 = warpgroup_mma(k_smem.index(st_n), q_smem.index(0).permute((1, 0)), b_zero,
                                             use_acc=False, is_async=True)
                        b_s = warpgroup_mma_wait(1, deps=[t_r0])
                        _indexer_paged_gluon_ws_release(empty_bars, st)
                        _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
                        t_r0 = t_n0
                    else:
                        b_s = warpgroup_mma_wait(0, deps=[t_r0])
                        _indexer_paged_gluon_ws_release(empty_bars, st)
                        _indexer_paged_gluon_row(b_s, b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)

    @gluon.jit
    def _indexer_paged_gluon_ws_kernel(
        q_ptr, k_desc, sc_desc, w_ptr, ctx_ptr, bt_ptr, out_ptr,
        H, max_ctx, num_pages, max_blocks, stride_bt, page_rows, stride_out, next_n, chunk,
        NP: gl.constexpr, D: gl.constexpr, HP: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        UNROLL: gl.constexpr, CTX_2D: gl.constexpr, NUM_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
    ):
        """Warp-specialised: a one-warp TMA loader feeds the compute warpgroup through ``full`` /
        ``empty`` mbarriers of ``STAGES`` buffers (no CTA barrier per tile)."""
        gl.static_assert((NP == 1) | (NP == 2))
        KQ_SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        i_b = gl.program_id(0)
        i_c = gl.program_id(1)
        vis0, vis1, c0, c1, n_tiles = _indexer_paged_gluon_window(ctx_ptr, i_b, 0, NP - 1, i_c, next_n, max_ctx,
                                                                  max_blocks, chunk, PAGE, CTX_2D)
        n_it = gl.cdiv(n_tiles, UNROLL) * UNROLL  # tiles computed (padding tiles read a valid page)

        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D], KQ_SL)
        q_smem = gl.allocate_shared_memory(gl.float8e4nv, [NP, HP, D], KQ_SL)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, 1, PAGE], sc_desc.layout)
        full_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(full_bars.index(s), count=1)
            mbarrier.init(empty_bars.index(s), count=NUM_WARPS * 32)
        fence_async_shared()

        gl.warp_specialize([
            (_indexer_paged_gluon_ws_consumer, (q_ptr, w_ptr, bt_ptr, out_ptr, i_b, H, next_n, stride_bt, stride_out,
                                                num_pages, c0 // PAGE, max_blocks - 1, c0, c1, vis0, vis1, n_it,
                                                k_smem, sc_smem, q_smem, full_bars, empty_bars,
                                                NP, D, HP, PAGE, STAGES, UNROLL, NUM_WARPS)),
            (_indexer_paged_gluon_ws_loader, (k_desc, sc_desc, bt_ptr, i_b, stride_bt, c0 // PAGE, max_blocks - 1,
                                              n_it, num_pages, page_rows, k_smem, sc_smem, full_bars, empty_bars,
                                              PAGE, D, STAGES)),
        ], [1], [LOADER_REGS])

        p_row0 = out_ptr + i_b.to(gl.int64) * next_n * stride_out
        _indexer_paged_gluon_fill(p_row0, p_row0 + (NP - 1) * stride_out, c0 + n_tiles * PAGE, c1, NP, PAGE,
                                  NUM_WARPS)


def kernel(warp_specialize: bool = False):
    """The Gluon kernel (``warp_specialize``: the one with a loader partition); ``None`` when this
    Triton has no usable Gluon."""
    if not gluon_importable():
        return None
    return _indexer_paged_gluon_ws_kernel if warp_specialize else _indexer_paged_gluon_kernel


def copyable_pages(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The layouts the Gluon paged kernels copy 16 bytes at a time: contiguous, 16-byte aligned fp8 ``q`` of
    ``D`` 128, and a cache of pages of 64 rows of ``D + 4`` bytes whose pages and base are 16-byte aligned
    (``q`` 4-D; the caller checks the cache's rank)."""
    return (
        q.shape[-1] == HEAD_DIM
        and q.dtype == torch.float8_e4m3fn
        and q.is_contiguous()
        and q.data_ptr() % 16 == 0
        and kv_cache.dtype == torch.uint8
        and kv_cache.shape[1] == PAGE
        and kv_cache.shape[-1] == HEAD_DIM + 4
        and kv_cache.stride(-1) == 1
        and kv_cache.stride(1) == HEAD_DIM + 4
        and kv_cache.stride(0) % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
    )


def shape_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The calls the launcher routes to the kernel: ``D`` 128, pages of 64 keys, the head counts of
    ``configs.indexer.PAGED_GLUON_HEADS``, a ``next_n`` with a launch for the cache's copy engine
    (``configs.indexer.paged_gluon_config``), fp8 ``q`` and 16-byte aligned rows and pages (the
    copies move 16 bytes at a time: :func:`copyable_pages`)."""
    if q.dim() != 4 or kv_cache.dim() not in (3, 4):
        return False
    _, next_n, num_heads, _ = q.shape
    return (
        num_heads in cfgs.PAGED_GLUON_HEADS
        and copyable_pages(q, kv_cache)
        and cfgs.paged_gluon_config(next_n, tma_supported(kv_cache)) is not None
    )


def supported(q: torch.Tensor, kv_cache: torch.Tensor, arch: int | None) -> bool:
    """Whether the Gluon kernel takes this call: ``ENABLED``, :func:`shape_supported`, a real sm_90
    device and Gluon allowed (``nsa_backend.kernels._gluon``)."""
    return (
        ENABLED
        and shape_supported(q, kv_cache)
        and gluon_enabled(arch, GLUON_ARCHS)
        and q.is_cuda
        and _capability(q.device.index if q.device.index is not None else torch.cuda.current_device()) == (9, 0)
    )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``index`` (read once per device)."""
    return torch.cuda.get_device_capability(index)


def tma_supported(kv_cache: torch.Tensor) -> bool:
    """Whether the key pages can be copied by TMA: a page stride that is a multiple of 128 bytes (a page
    is then whole rows of a ``[*, 128]`` byte view of the cache) and a 16-byte aligned cache."""
    return kv_cache.stride(0) % 128 == 0 and kv_cache.data_ptr() % 16 == 0


def _tma_descriptors(kv_cache: torch.Tensor):
    """TMA descriptors of the key rows (``[rows, 128]`` fp8, one page = ``PAGE`` rows starting at row
    ``page * page_rows``) and of the scales (``[num_pages, PAGE]`` fp32), and ``page_rows``; built
    anew on every call (the ahead-of-time compile uses it; launches take :func:`_cached_descriptors`)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    num_pages, stride_page = kv_cache.shape[0], kv_cache.stride(0)
    rows = ((num_pages - 1) * stride_page + PAGE * HEAD_DIM) // HEAD_DIM
    offset = kv_cache.storage_offset()
    keys = kv_cache.as_strided((rows, HEAD_DIM), (HEAD_DIM, 1), offset).view(torch.float8_e4m3fn)
    scales = kv_cache.as_strided((num_pages, PAGE * 4), (stride_page, 1), offset + PAGE * HEAD_DIM)
    scales = scales.view(torch.float32)
    k_desc = TensorDescriptor(keys, [rows, HEAD_DIM], [HEAD_DIM, 1], [PAGE, HEAD_DIM],
                              gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2))
    sc_desc = TensorDescriptor(scales, [num_pages, PAGE], [stride_page // 4, 1], [1, PAGE],
                               gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    return k_desc, sc_desc, stride_page // HEAD_DIM


class _Address:
    """A descriptor's ``base`` in :func:`_cached_descriptors`: the start address and element type of
    the viewed tensor, which is all that Triton reads from it (the launcher encodes the descriptor
    from ``base.data_ptr()``, shape and strides; the kernel's signature names ``base.dtype``). Unlike
    the tensor, it does not keep the cache's memory alive."""

    __slots__ = ("_ptr", "dtype")

    def __init__(self, tensor: torch.Tensor):
        self._ptr = tensor.data_ptr()
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._ptr


# Descriptors of recently launched caches, least recently used first (see _cached_descriptors).
DESCRIPTOR_CACHE_SIZE = 128
_DESCRIPTORS: OrderedDict[tuple, tuple] = OrderedDict()
_DESCRIPTORS_LOCK = threading.Lock()


def _descriptor_key(kv_cache: torch.Tensor) -> tuple:
    return (kv_cache.device, kv_cache.data_ptr(), tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype,
            (PAGE, HEAD_DIM))


def _cached_descriptors(kv_cache: torch.Tensor):
    """:func:`_tma_descriptors` of ``kv_cache``, reused from the last ``DESCRIPTOR_CACHE_SIZE`` caches.

    A descriptor is a function of the key: the cache's device, start address, shape and strides (the
    page count and page stride), its dtype and the copied boxes. The cached descriptors hold only
    the address (:class:`_Address`), not the tensor, so a cache tensor can be freed while its entry
    remains; a later tensor at the same address with the same shape and strides then has the same
    key and exactly the same descriptors as a fresh build, so reusing them is correct (a tensor that
    differs in any of these has another key). The descriptors are encoded for the GPU at each
    launch from these fields, so a CUDA graph captures the same values as an uncached call."""
    key = _descriptor_key(kv_cache)
    with _DESCRIPTORS_LOCK:
        hit = _DESCRIPTORS.get(key)
        if hit is not None:
            _DESCRIPTORS.move_to_end(key)
            return hit
    k_desc, sc_desc, page_rows = _tma_descriptors(kv_cache)
    k_desc.base = _Address(k_desc.base)
    sc_desc.base = _Address(sc_desc.base)
    hit = (k_desc, sc_desc, page_rows)
    with _DESCRIPTORS_LOCK:
        _DESCRIPTORS[key] = hit
        while len(_DESCRIPTORS) > DESCRIPTOR_CACHE_SIZE:
            _DESCRIPTORS.popitem(last=False)
    return hit


# Launch used for a call that has no entry in the configuration tables (a direct call).
_FALLBACK = cfgs.PagedGluonConfig(num_stages=4, resident=4, tma=False)


def launch_config(next_n: int, kv_cache: torch.Tensor,
                  config: cfgs.PagedGluonConfig | None = None) -> cfgs.PagedGluonConfig:
    """The launch of a call: ``config`` or the table entry of the cache's copy engine, with TMA (and
    the loader partition) turned off where :func:`tma_supported` says no."""
    return _launch_config(next_n, tma_supported(kv_cache), config)


@functools.lru_cache(maxsize=64)
def _launch_config(next_n: int, tma_ok: bool, config: cfgs.PagedGluonConfig | None) -> cfgs.PagedGluonConfig:
    cfg = config or cfgs.paged_gluon_config(next_n, tma_ok) or cfgs.paged_gluon_config(next_n, False) or _FALLBACK
    if cfg.tma and not tma_ok:
        cfg = replace(cfg, tma=False, warp_specialize=False, max_regs=0)
    if cfg.warp_specialize and not cfg.tma:
        cfg = replace(cfg, warp_specialize=False, max_regs=0)
    return cfg


@functools.lru_cache(maxsize=256)
def _launch_plan(B: int, next_n: int, H: int, max_context_len: int, tma_ok: bool, ctx_2d: bool, num_sms: int,
                 config: cfgs.PagedGluonConfig | None, chunk: int | None):
    """``(config, chunk, grid, constexprs)`` of a launch: a function of the shapes, so it is computed
    once per shape."""
    cfg = _launch_config(next_n, tma_ok, config)
    chunk = chunk or cfgs.paged_chunk(B, max_context_len, num_sms, PAGE, cfg.resident)
    chunk = triton.cdiv(chunk, PAGE) * PAGE
    grid = (B, triton.cdiv(max_context_len, chunk))
    return cfg, chunk, grid, _constexprs(next_n, cfgs.padded_heads(H), cfg, ctx_2d)


def fp8_paged_mqa_logits_gluon(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    *,
    config: cfgs.PagedGluonConfig | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Gluon :func:`nsa_backend.fp8_paged_mqa_logits` (sm_90; see :func:`supported` for the coverage).

    Same parameters and result as ``nsa_backend.kernels.indexer.fp8_paged_mqa_logits_triton`` (the
    schedule metadata and ``clean_logits`` are not needed: the grid is a function of the shapes and
    every key a row does not see is ``-inf``). ``config`` and ``chunk`` (keys per program) override
    :func:`launch_config` and ``configs.indexer.paged_chunk``.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]`` ``float32``.
    """
    B, next_n, H, D = q.shape
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    if next_n not in NEXT_NS or D != HEAD_DIM or kv_cache.shape[1] != PAGE:
        raise ValueError(f"the Gluon paged kernel takes next_n in {NEXT_NS}, D {HEAD_DIM} and pages of {PAGE} "
                         f"keys, got next_n {next_n}, D {D}, pages of {kv_cache.shape[1]}")
    num_pages = kv_cache.shape[0]
    out = torch.empty(B * next_n, max_context_len, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if block_table.shape[1] == 0 or num_pages == 0:  # no page: no visible key
        return out.fill_(float("-inf"))
    cfg, chunk, grid, consts = _launch_plan(B, next_n, H, max_context_len, tma_supported(kv_cache),
                                            context_lens.dim() == 2, device_sms(q.device), config, chunk)
    k_desc, sc_desc, page_rows = _cached_descriptors(kv_cache) if cfg.tma else (None, None, 0)
    common = (H, max_context_len, num_pages, block_table.shape[1], block_table.stride(0))
    if cfg.warp_specialize:
        _indexer_paged_gluon_ws_kernel[grid](
            q, k_desc, sc_desc, weights, context_lens, block_table, out, *common, page_rows, out.stride(0),
            next_n, chunk, **consts, num_warps=NUM_WARPS, maxnreg=cfg.max_regs,
        )
    else:
        _indexer_paged_gluon_kernel[grid](
            q, kv_cache, k_desc, sc_desc, weights, context_lens, block_table, out, *common, kv_cache.stride(0),
            page_rows, out.stride(0), next_n, chunk, **consts, num_warps=NUM_WARPS,
            **({"maxnreg": cfg.max_regs} if cfg.max_regs else {}),
        )
    return out


def _constexprs(rows: int, hp: int, cfg: cfgs.PagedGluonConfig, ctx_2d: bool) -> dict:
    out = dict(NP=rows, D=HEAD_DIM, HP=hp, PAGE=PAGE, STAGES=cfg.num_stages, UNROLL=cfg.unroll, CTX_2D=ctx_2d,
               NUM_WARPS=NUM_WARPS)
    if cfg.warp_specialize:
        out["LOADER_REGS"] = cfg.loader_regs
    else:
        out["TMA"] = cfg.tma
    return out


def compile_for_sm90(config: cfgs.PagedGluonConfig | None = None, hp: int = 64, next_n: int = 2,
                     ctx_2d: bool = False, arch: int = 90):
    """Compile the kernel of ``config`` (default: the TMA table entry of ``next_n``) ahead of time for
    ``sm_<arch>`` (no GPU needed) with the runtime's argument specialisation (16-byte aligned
    pointers and strides); returns Triton's compiled kernel (``metadata.shared``: shared memory per
    program in bytes). Requires Gluon (``gluon_importable``)."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    cfg = config or cfgs.paged_gluon_config(next_n, True) or _FALLBACK
    fn = _indexer_paged_gluon_ws_kernel if cfg.warp_specialize else _indexer_paged_gluon_kernel
    names = fn.arg_names
    ptrs = {"q_ptr": "*fp8e4nv", "kv_ptr": "*u8", "w_ptr": "*fp32", "ctx_ptr": "*i32", "bt_ptr": "*i32",
            "out_ptr": "*fp32"}
    consts = _constexprs(next_n, hp, cfg, ctx_2d)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else "i32") for n in names}
    if cfg.tma:  # descriptors of a small cache on the host: only their types matter
        k_desc, sc_desc, _ = _tma_descriptors(torch.zeros(4, PAGE, 1, HEAD_DIM + 4, dtype=torch.uint8))
        sig["k_desc"], sig["sc_desc"] = mangle_type(k_desc), mangle_type(sc_desc)
    else:
        sig["k_desc"] = sig["sc_desc"] = "constexpr"
        consts = {**consts, "k_desc": None, "sc_desc": None}
    aligned = [n for n in [*ptrs, "stride_page", "stride_out"] if n in names]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    options = {"num_warps": NUM_WARPS, **({"maxnreg": cfg.max_regs} if cfg.max_regs else {})}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


__all__ = [
    "ENABLED", "GLUON_ARCHS", "compile_for_sm90", "fp8_paged_mqa_logits_gluon", "kernel", "launch_config",
    "shape_supported", "supported", "tma_supported",
]
