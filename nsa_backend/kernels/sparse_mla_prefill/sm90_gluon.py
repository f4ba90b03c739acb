"""Gluon sparse MLA prefill for sm_90 (Hopper): q in shared memory, asynchronous key gathers, wgmma.

:func:`flash_mla_sparse_fwd_gluon` computes :func:`nsa_backend.flash_mla_sparse_fwd` for bf16 ``q`` /
``kv`` with ``d_qk`` 576 (512 latent + 64 rope), ``d_v`` 512 and ``h_q`` a multiple of 64 (other head
counts run on tiles padded to 64 heads, used from ``PADDED_MIN_HEADS`` heads on); the launcher in
``nsa_backend.kernels.sparse_mla_prefill`` calls it when :func:`supported` says so (16-byte aligned
rows for ``cp.async``) and takes the ``tl`` kernel otherwise. Calls with up to 32 heads go first to
the few-head kernel of ``nsa_backend.kernels.sparse_mla_prefill.sm90_gluon_fewhead`` (where it is
``ENABLED``), so in practice this kernel serves 33 heads and more.

One program of ``_sparse_mla_prefill_gluon_kernel`` (8 warps: two warpgroups) handles one query row and
``BLOCK_H = 64`` heads:

- the ``q`` tile ``[64, 576]`` is copied once into NVMMA-swizzled shared memory (latent ``[64, 512]``
  and rope ``[64, 64]`` buffers: Gluon shapes are powers of two) and stays there;
- the row's key list is walked ``BLOCK_N = 64`` keys at a time. The rows of a tile are gathered with
  ``cp.async`` (per-row addresses, invalid slots zero-filled and never dereferenced) into one of two
  key buffers (``[64, 512]`` + ``[64, 64]``): the copy of tile ``j + 1`` runs while tile ``j`` is
  computed;
- ``S = q K^T`` (``[64 heads, 64 keys]``, K-dim 512 + 64) and ``O += P V`` (``V`` the latent part of
  the same key buffer) are warpgroup MMAs with both operands in shared memory. The MMA layouts put
  the two warpgroups side by side along N: each computes the scores of 32 of the 64 keys and owns
  256 of the 512 output columns (a ``[64, 256]`` fp32 accumulator, 128 registers per thread). ``P``
  (bf16) goes through a ``[64, 64]`` shared-memory tile so that both warpgroups read all 64 keys;
- online softmax in base 2 (``qk_scale = sm_scale * log2(e)``); row sums are kept per key column and
  reduced once after the loop.

The loop is warp-specialised: a 4-warp loader partition (48 registers) copies ``q`` and every key
tile as soon as the compute warpgroups release a buffer, signalling through ``full`` (``cp.async``
arrivals, one per loader thread) / ``empty`` mbarriers.

H200 (s_q 4096, s_kv 32768, topk 2048; same process): 5.34 / 2.75 ms at h_q 128 / 64 (437 / 426
TFLOP/s, 0.74x / 0.76x FlashMLA, 2.2x the ``tl`` kernel). Tried without gain: one software-pipelined
loop in all 8 warps without a loader partition (5.79 / 3.00 ms; removed), leaving each ``P V``
product in flight behind the next scores (6.48 / 3.30 ms; ptxas serialises the wgmmas) and a
persistent kernel (one program per SM: 5.51 / 2.77 ms).
Heads are padded to 64 (masked) for other head counts: h_q 32 takes 2.60 ms against 3.63 ms for the
``tl`` kernel, h_q 16 2.50 against 2.37 ms, hence ``PADDED_MIN_HEADS = 17``.

Outputs follow the op exactly: natural-log ``lse`` (``+inf`` and ``out = 0`` for a row without a
valid key), ``max_logits`` (``-inf`` then), ``attn_sink`` scaling by ``1 / (1 + exp(sink - lse))``,
``topk_length`` (``[s_q]``) truncating each row's list.

Shared memory: ``q`` 72 KiB + two key buffers 144 KiB + ``P`` 8 KiB = 224 KiB (sm_90 allows 227).
"""

from __future__ import annotations

import torch
import triton

from nsa_backend.kernels._arch import device_capability
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable
from nsa_backend.kernels.sparse_mla_prefill.common import gluon_rows_supported, prefill_outputs, prefill_rows

# Whether the prefill launcher takes this kernel where :func:`supported` allows it.
ENABLED = True
# Capabilities the kernel is written for (wgmma, 227 KiB of shared memory per block).
GLUON_ARCHS: tuple[int, ...] = (90,)
BLOCK_H = 64
BLOCK_N = 64
D_QK = 576
D_V = 512
NUM_WARPS = 8
# Head counts that are not a multiple of 64 run on tiles padded to 64 heads (masked) from this many heads
# on; ``None``: only multiples of 64 take the Gluon kernel.
PADDED_MIN_HEADS: int | None = 17
LOG2E = 1.4426950408889634

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

    from nsa_backend.kernels._gluon import cp_async, cta_barrier

    @gluon.jit
    def _sparse_mla_gather_tile(dst_v, dst_r, kv_ptr, b_idx, s_kv, stride_kv,
                                D_V: gl.constexpr, D_ROPE: gl.constexpr, layout: gl.constexpr):
        """Issue the ``cp.async`` copies of the key rows ``b_idx`` [BN]: the first ``D_V`` columns into
        ``dst_v`` [BN, D_V], the ``D_ROPE`` rope columns into ``dst_r`` [BN, D_ROPE]."""
        m_n = (b_idx >= 0) & (b_idx < s_kv)
        # [BN] row addresses (int64); invalid rows point at row 0 and are zero-filled
        p_row = kv_ptr + gl.where(m_n, b_idx, 0).to(gl.int64) * stride_kv
        o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        p_2d = gl.expand_dims(p_row, 1) + gl.expand_dims(o_c, 0)
        m_2d = gl.expand_dims(m_n, 1) & gl.expand_dims(o_c < 64, 0)
        for c in gl.static_range(D_V // 64):
            cp_async(dst_v.slice(c * 64, 64, dim=1), p_2d + c * 64, mask=m_2d)
        cp_async(dst_r, p_2d + D_V, mask=m_2d)

    @gluon.jit
    def _sparse_mla_copy_q(q_smem, qr_smem, q_ptr, i_r, i_h, h_q, stride_q_row, stride_q_head,
                           D_V: gl.constexpr, BLOCK_H: gl.constexpr, layout: gl.constexpr):
        """Issue the ``cp.async`` copies of the ``q`` tile (heads past ``h_q`` zero-filled)."""
        o_h = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
        o_c = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        p_row = q_ptr + i_r * stride_q_row + o_h.to(gl.int64) * stride_q_head
        p_q2d = gl.expand_dims(p_row, 1) + gl.expand_dims(o_c, 0)
        m_q2d = gl.expand_dims(o_h < h_q, 1) & gl.expand_dims(o_c < 64, 0)
        for c in gl.static_range(D_V // 64):
            cp_async(q_smem.slice(c * 64, 64, dim=1), p_q2d + c * 64, mask=m_q2d)
        cp_async(qr_smem, p_q2d + D_V, mask=m_q2d)

    @gluon.jit
    def _sparse_mla_epilogue(b_acc, b_l2, b_m, sink_ptr, out_ptr, lse_ptr, max_ptr, i_r, i_h, h_q,
                             stride_o_row, stride_o_head, stride_l_row,
                             D_V: gl.constexpr, BLOCK_H: gl.constexpr, HAS_SINK: gl.constexpr,
                             s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Normalise and write ``out`` (bf16), the natural-log ``lse`` and ``max_logits`` of 64 heads."""
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        col_o: gl.constexpr = gl.SliceLayout(0, o_layout)
        b_l = gl.sum(b_l2, axis=1)
        m_empty = b_l == 0.0
        b_inv = 1.0 / gl.where(m_empty, 1.0, b_l)
        b_lse2 = b_m + gl.log2(gl.where(m_empty, 1.0, b_l))
        b_lse = gl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
        o_hs = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_s)
        m_hs = o_hs < h_q
        if HAS_SINK:
            b_sink = gl.load(sink_ptr + o_hs, mask=m_hs, other=0.0)
            # exp(lse) / (exp(lse) + exp(sink)); empty rows have out = 0 already
            b_inv = b_inv / (1.0 + gl.exp(b_sink - gl.where(m_empty, 0.0, b_lse)))
        o_l = i_r * stride_l_row + o_hs
        gl.store(lse_ptr + o_l, b_lse, mask=m_hs)
        gl.store(max_ptr + o_l, b_m * 0.6931471805599453, mask=m_hs)
        b_o = (b_acc * gl.expand_dims(gl.convert_layout(b_inv, row_o), 1)).to(gl.bfloat16)
        o_ho = i_h * BLOCK_H + gl.arange(0, BLOCK_H, layout=row_o)
        o_co = gl.arange(0, D_V, layout=col_o)
        p_o = (out_ptr + i_r * stride_o_row + gl.expand_dims(o_ho.to(gl.int64) * stride_o_head, 1)
               + gl.expand_dims(o_co, 0))
        gl.store(p_o, b_o, mask=gl.expand_dims(o_ho < h_q, 1) & gl.expand_dims(o_co < D_V, 0))

    @gluon.jit
    def _sparse_mla_ws_producer(q_ptr, kv_ptr, idx_ptr, i_r, i_h, h_q, n_end, n_tiles, s_kv,
                                stride_q_row, stride_q_head, stride_idx_row, stride_kv,
                                q_smem, qr_smem, k_smem, kr_smem, q_bar, full_bars, empty_bars,
                                D_V: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr):
        """Loader partition (4 warps): ``q`` once, then every key tile into the buffer the consumers
        released; each copy arrives on the buffer's ``full`` barrier when it lands."""
        g_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_g: gl.constexpr = gl.SliceLayout(1, g_layout)
        _sparse_mla_copy_q(q_smem, qr_smem, q_ptr, i_r, i_h, h_q, stride_q_row, stride_q_head, D_V, BLOCK_H,
                           g_layout)
        async_copy.mbarrier_arrive(q_bar, increment_count=False)
        p_idx = idx_ptr + i_r * stride_idx_row
        o_n = gl.arange(0, BLOCK_N, layout=row_g)
        b_idx = gl.load(p_idx + o_n, mask=o_n < n_end, other=-1)
        for j in range(n_tiles):
            stage = j % 2
            # wait until the consumers released this buffer (passes at once on its first use)
            mbarrier.wait(empty_bars.index(stage), ((j // 2) & 1) ^ 1)
            _sparse_mla_gather_tile(k_smem.index(stage), kr_smem.index(stage), kv_ptr, b_idx, s_kv, stride_kv,
                                    D_V, 64, g_layout)
            async_copy.mbarrier_arrive(full_bars.index(stage), increment_count=False)
            n1 = (j + 1) * BLOCK_N
            b_idx = gl.load(p_idx + n1 + o_n, mask=n1 + o_n < n_end, other=-1)

    @gluon.jit
    def _sparse_mla_ws_consumer(idx_ptr, i_r, n_end, n_tiles, s_kv, qk_scale, stride_idx_row,
                                q_smem, qr_smem, k_smem, kr_smem, p_smem, q_bar, full_bars, empty_bars,
                                D_V: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
                                s_layout: gl.constexpr, o_layout: gl.constexpr):
        """Compute partition (the 8 warps of the two warpgroups): scores, softmax, ``P V``."""
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        p_idx = idx_ptr + i_r * stride_idx_row
        o_ns = gl.arange(0, BLOCK_N, layout=col_s)
        b_idx_s = gl.load(p_idx + o_ns, mask=o_ns < n_end, other=-1)
        b_m = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=row_s)
        b_l2 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
        b_acc = gl.zeros([BLOCK_H, D_V], gl.float32, layout=o_layout)
        mbarrier.wait(q_bar, 0)
        for j in range(n_tiles):
            stage = j % 2
            k_tile = k_smem.index(stage)
            mbarrier.wait(full_bars.index(stage), (j // 2) & 1)
            fence_async_shared()
            m_ns = (b_idx_s >= 0) & (b_idx_s < s_kv)
            n1 = (j + 1) * BLOCK_N
            b_idx_s = gl.load(p_idx + n1 + o_ns, mask=n1 + o_ns < n_end, other=-1)
            b_s = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=s_layout)
            b_s = warpgroup_mma(q_smem, k_tile.permute((1, 0)), b_s, use_acc=False, is_async=True)
            b_s = warpgroup_mma(qr_smem, kr_smem.index(stage).permute((1, 0)), b_s, is_async=True)
            b_s = warpgroup_mma_wait(0, deps=[b_s])
            b_s = gl.where(gl.expand_dims(m_ns, 0), b_s * qk_scale, float("-inf"))
            b_m_new = gl.maximum(b_m, gl.max(b_s, axis=1))
            b_m_use = gl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = gl.exp2(b_s - gl.expand_dims(b_m_use, 1))
            b_alpha = gl.exp2(b_m - b_m_use)
            b_l2 = b_l2 * gl.expand_dims(b_alpha, 1) + b_p
            b_m = b_m_new
            p_smem.store(b_p.to(gl.bfloat16))
            fence_async_shared()
            cta_barrier()
            b_acc = b_acc * gl.expand_dims(gl.convert_layout(b_alpha, row_o), 1)
            b_acc = warpgroup_mma(p_smem, k_tile, b_acc, is_async=True)
            b_acc = warpgroup_mma_wait(0, deps=[b_acc])
            # both warpgroups are done with the buffer (and with P): release it to the loader
            cta_barrier()
            mbarrier.arrive(empty_bars.index(stage))
        return b_acc, b_l2, b_m

    @gluon.jit
    def _sparse_mla_prefill_gluon_ws_kernel(
        q_ptr, kv_ptr, idx_ptr, sink_ptr, topk_len_ptr,
        out_ptr, lse_ptr, max_ptr,
        qk_scale,
        h_q, topk, s_kv,
        stride_q_row, stride_q_head, stride_idx_row, stride_kv,
        stride_o_row, stride_o_head, stride_l_row,
        D_QK: gl.constexpr, D_V: gl.constexpr,
        BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr,
        HAS_SINK: gl.constexpr, HAS_TOPK_LEN: gl.constexpr,
    ):
        """Warp-specialised: a 4-warp loader partition feeds the two compute warpgroups through
        ``full`` / ``empty`` mbarriers of the two key buffers."""
        gl.static_assert(BLOCK_H == 64)
        gl.static_assert(D_QK - D_V == 64)
        D_ROPE: gl.constexpr = D_QK - D_V
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, D_V // 2, 16])
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        n_hb = gl.cdiv(h_q, BLOCK_H)
        i_r = (gl.program_id(0) // n_hb).to(gl.int64)
        i_h = gl.program_id(0) % n_hb
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], smem_layout)
        qr_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_ROPE], smem_layout)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_V], smem_layout)
        kr_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_N, D_ROPE], smem_layout)
        p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_N], smem_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        full_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        # loader arrivals: one per loader thread (128) when its copies land; release: one per tile
        mbarrier.init(q_bar, count=128)
        for i in gl.static_range(2):
            mbarrier.init(full_bars.index(i), count=128)
            mbarrier.init(empty_bars.index(i), count=1)
        fence_async_shared()

        n_end = topk
        if HAS_TOPK_LEN:
            n_end = gl.minimum(gl.maximum(gl.load(topk_len_ptr + i_r), 0), topk)
        n_tiles = gl.cdiv(n_end, BLOCK_N)
        b_acc, b_l2, b_m = gl.warp_specialize([
            (_sparse_mla_ws_consumer, (idx_ptr, i_r, n_end, n_tiles, s_kv, qk_scale, stride_idx_row,
                                       q_smem, qr_smem, k_smem, kr_smem, p_smem, q_bar, full_bars, empty_bars,
                                       D_V, BLOCK_H, BLOCK_N, s_layout, o_layout)),
            (_sparse_mla_ws_producer, (q_ptr, kv_ptr, idx_ptr, i_r, i_h, h_q, n_end, n_tiles, s_kv,
                                       stride_q_row, stride_q_head, stride_idx_row, stride_kv,
                                       q_smem, qr_smem, k_smem, kr_smem, q_bar, full_bars, empty_bars,
                                       D_V, BLOCK_H, BLOCK_N)),
        ], [4], [48])
        _sparse_mla_epilogue(b_acc, b_l2, b_m, sink_ptr, out_ptr, lse_ptr, max_ptr, i_r, i_h, h_q,
                             stride_o_row, stride_o_head, stride_l_row, D_V, BLOCK_H, HAS_SINK,
                             s_layout, o_layout)


def kernel():
    """The Gluon kernel; ``None`` when this Triton has no usable Gluon."""
    if not gluon_importable():
        return None
    return _sparse_mla_prefill_gluon_ws_kernel


def supported(q: torch.Tensor, kv: torch.Tensor, d_v: int, arch: int | None) -> bool:
    """Whether the Gluon kernel takes this call: ``ENABLED``, the shapes and dtypes it covers, a launch
    tuned for sm_90 on a real sm_90 device, and Gluon allowed (``nsa_backend.kernels._gluon``)."""
    h_q = q.shape[1]
    return (
        ENABLED
        and (h_q % BLOCK_H == 0 or (PADDED_MIN_HEADS is not None and h_q >= PADDED_MIN_HEADS))
        and rows_supported(q, kv, d_v, arch)
    )


def rows_supported(q: torch.Tensor, kv: torch.Tensor, d_v: int, arch: int | None) -> bool:
    """What the Gluon prefill kernels (this one and the few-head one) need of a call, whatever its head
    count: bf16 ``q`` and ``kv`` with ``d_qk`` 576 and ``d_v`` 512, rows 16-byte aligned for ``cp.async``,
    a real sm_90 device and Gluon allowed (``nsa_backend.kernels._gluon``). Stand-ins off CUDA (a planner's
    question for ``arch``) count as that device."""
    return (
        gluon_rows_supported(q, kv, d_v)
        and gluon_enabled(arch, GLUON_ARCHS)
        and device_capability(q.device) in (None, 90)
    )


def flash_mla_sparse_fwd_gluon(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gluon :func:`nsa_backend.flash_mla_sparse_fwd` (sm_90; see :func:`supported` for the coverage).

    Same parameters and results as ``nsa_backend.kernels.sparse_mla_prefill.flash_mla_sparse_fwd_triton``.
    """
    s_q, h_q, d_qk = q.shape
    s_kv = kv.shape[0]
    topk = indices.shape[-1]
    out, max_logits, lse = prefill_outputs(q, d_v)
    if s_q == 0:
        return out, max_logits, lse
    kv2, idx = prefill_rows(kv, indices)
    grid = (s_q * triton.cdiv(h_q, BLOCK_H),)
    kernel()[grid](
        q, kv2, idx,
        attn_sink if attn_sink is not None else lse,
        topk_length if topk_length is not None else idx,
        out, lse, max_logits,
        sm_scale * LOG2E,
        h_q, topk, s_kv,
        q.stride(0), q.stride(1), idx.stride(0), kv2.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        **_constexprs(d_qk, d_v, attn_sink is not None, topk_length is not None),
        num_warps=NUM_WARPS,
    )
    return out, max_logits, lse


def _constexprs(d_qk: int, d_v: int, has_sink: bool, has_topk_len: bool) -> dict:
    return dict(D_QK=d_qk, D_V=d_v, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, HAS_SINK=has_sink,
                HAS_TOPK_LEN=has_topk_len)


def compile_for_sm90(arch: int = 90):
    """Compile the kernel ahead of time for ``sm_<arch>`` (no GPU needed) with the runtime's
    argument specialisation (16-byte aligned pointers and strides); returns Triton's compiled kernel, whose
    ``metadata.shared`` is the shared memory per program in bytes. Requires Gluon (``gluon_importable``).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = kernel()
    names = fn.arg_names
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32",
            "topk_len_ptr": "*i32", "out_ptr": "*bf16", "lse_ptr": "*fp32", "max_ptr": "*fp32"}
    consts = _constexprs(D_QK, D_V, True, True)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else ("fp32" if n == "qk_scale" else "i32"))
           for n in names}
    aligned = [n for n in names if n in ptrs or n.startswith("stride")]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = GluonASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": NUM_WARPS})


__all__ = [
    "GLUON_ARCHS", "compile_for_sm90", "flash_mla_sparse_fwd_gluon", "gluon_importable", "kernel",
    "supported",
]
