"""Gluon paged indexer logits for the mma.sync archs with e4m3 (sm_89 / 120 / 121): two query rows per program.

:func:`fp8_paged_mqa_logits_mma_v2` computes :func:`nsa_backend.fp8_paged_mqa_logits` for ``D = 128`` and pages
of 64 keys; the launcher ``nsa_backend.kernels.indexer.fp8_paged_mqa_logits_triton`` calls it where
:func:`supported` says so (``configs.indexer.PAGED_MMA_V2_ARCHS`` / ``PAGED_MMA_V2_HEADS``: one row of 17..64
heads, two to four rows of 1..64) and keeps the ``tl`` kernel otherwise.

    logits[t] = k_scale[t] * sum_h relu(q[h] . k[t]) * w[h]

A program handles two rows of one request (one where ``next_n`` is 1; at odd ``next_n`` the last row alone,
computed twice) and one chunk of its keys, one page (64 keys) per tile, with four warps:

- each row's ``q`` ``[HP, 128]`` is loaded once into the registers of the MMA's ``B`` operand (``q^T``),
  where it stays for the whole chunk: no shared-memory read of ``q`` per tile (in the ``tl`` kernel ``q`` is
  read from shared memory by every tile's product);
- the key pages ``[64, 128]`` e4m3 and their 64 fp32 scales come by ``cp.async`` into a ring of
  ``STAGES`` swizzled buffers, ``STAGES - 1`` pages ahead;
- per page each warp takes 16 keys (``S^T = K q^T``, keys on the M side) and multiplies them with every
  row's ``q^T`` (``mma_v2``), so the head sum of ``relu(s) w`` stays inside each thread and its quad; the
  scale is applied after the sum, as in the reference.

Products (:func:`e4m3_products`): on a GPU whose ``mma.sync`` takes e4m3 (sm_89 / 120 / 121) keys and ``q``
enter the MMA as stored (m16n8k32). Elsewhere (an sm_90 GPU under the sm120 proxy, where ``ptxas`` would
convert both operands to fp16 at every MMA) the keys are converted to fp16 in registers and ``q^T`` is held in
fp16 (m16n8k16): twice the MMA instructions and twice the registers for ``q^T``, so two rows of 64 heads stay
in e4m3 there. Both are exact: every e4m3 value is an fp16 value, products and sums in fp32.

The window of a request (``context_lens`` 1-D or 2-D, the block table's length, ``max_context_len``), the
copies (a page id outside the cache reads page 0 and its keys are ``-inf``), the epilogue and the ``-inf``
fill of keys no row sees are those of the sm_90 kernel's ``cp.async`` path (:mod:`.sm90_gluon_paged`).

Only the archs of ``PAGED_MMA_V2_ARCHS`` with Triton's Gluon dialect (``nsa_backend.kernels._gluon``) run
this kernel; under the sm120 proxy an sm_90 GPU runs it for them. Launches go through
``nsa_backend.kernels._launch.cached_launcher``, so the eager replays of ``nsa_backend._replay`` cover them.
"""

from __future__ import annotations

import functools

import torch

from nsa_backend.configs import indexer as cfgs
from nsa_backend.kernels._arch import device_capability, device_sms
from nsa_backend.kernels._gluon import gluon_enabled, gluon_importable
from nsa_backend.kernels._launch import cached_launcher, cdiv
from nsa_backend.kernels.indexer import sm90_gluon_paged as sm90

PAGE = 64
HEAD_DIM = 128
NUM_WARPS = 4
# rows x padded heads of q^T that fit the registers in fp16 (one row of 64: 128 registers per thread)
FP16_Q_MAX_HEADS = 64

if gluon_importable():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2

    from nsa_backend.kernels._gluon import cta_barrier
else:  # pragma: no cover - the kernel is never launched without Gluon
    gluon = None


if gluon is not None:

    @gluon.jit
    def _indexer_paged_mma_v2_q(q_ptr, q_smem, o_q, H, HP: gl.constexpr, D: gl.constexpr, L_K: gl.constexpr,
                                OP_B: gl.constexpr, E4M3: gl.constexpr):
        """One row's ``q^T`` ``[D, HP]`` (``q`` from element ``o_q``, heads past ``H`` zero) in the registers of
        the MMA's ``B`` operand, through ``q_smem``: e4m3 as stored, or converted to fp16."""
        o_h = gl.arange(0, HP, layout=gl.SliceLayout(1, L_K))
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, L_K))
        p_q = q_ptr + o_q + gl.expand_dims(o_h * D, 1) + gl.expand_dims(o_d, 0)
        b_q = gl.load(p_q, mask=gl.expand_dims(o_h < H, 1) & gl.expand_dims(o_d < D, 0), other=0.0)
        cta_barrier()  # every thread is done with the previous row's q^T
        if E4M3:
            q_smem.store(b_q)
        else:
            q_smem.store(b_q.to(gl.float16))
        cta_barrier()
        return q_smem.permute((1, 0)).load(OP_B)

    @gluon.jit
    def _indexer_paged_mma_v2_kernel(
        q_ptr, kv_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
        H, max_ctx, num_pages, max_blocks, stride_bt, stride_page, stride_out, next_n, groups, chunk,
        NP: gl.constexpr, D: gl.constexpr, HP: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        CTX_2D: gl.constexpr, E4M3: gl.constexpr, NUM_WARPS: gl.constexpr,
    ):
        gl.static_assert(STAGES >= 2)
        gl.static_assert((NP == 1) | (NP == 2))
        # S^T [PAGE, HP] per row: 16 keys per warp on the M side, the heads on N inside each warp. An MMA takes
        # 32 bits of K per register: 4 e4m3 or 2 fp16 values.
        MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                      instr_shape=[16, 8])
        K_WIDTH: gl.constexpr = 4 if E4M3 else 2
        OP_A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=K_WIDTH)
        OP_B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=K_WIDTH)
        L_K: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])
        L_SC: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        # rows of 128 bytes (keys, e4m3 q) or 256 bytes (fp16 q) in 16-byte vectors, swizzled over the eight
        # 16-byte bank groups
        K_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8, order=[1, 0])
        Q_VEC: gl.constexpr = 16 if E4M3 else 8
        Q_SL: gl.constexpr = gl.SwizzledSharedLayout(vec=Q_VEC, per_phase=1, max_phase=8, order=[1, 0])
        Q_TYPE: gl.constexpr = gl.float8e4nv if E4M3 else gl.float16
        SC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        ROW: gl.constexpr = gl.SliceLayout(1, MMA)
        COL: gl.constexpr = gl.SliceLayout(0, MMA)

        # program (request i_b, group of NP rows from row0; a last group of one row takes it twice), chunk i_c
        i_b = gl.program_id(0) // groups
        row0 = gl.program_id(0) % groups * NP
        row1 = gl.minimum(row0 + NP - 1, next_n - 1)
        i_c = gl.program_id(1)
        vis0, vis1, c0, c1, n_tiles = sm90._indexer_paged_gluon_window(ctx_ptr, i_b, row0, row1, i_c, next_n,
                                                                       max_ctx, max_blocks, chunk, PAGE, CTX_2D)

        k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, PAGE, D], K_SL)
        sc_smem = gl.allocate_shared_memory(gl.float32, [STAGES, PAGE], SC_SL)
        p_bt = bt_ptr + i_b.to(gl.int64) * stride_bt
        tile0 = c0 // PAGE
        last = max_blocks - 1
        # the first STAGES - 1 pages in flight (one cp.async group each; pages past the chunk read nothing)
        for t in gl.static_range(STAGES - 1):
            i_pg = gl.load(p_bt + gl.minimum(tile0 + t, last))
            sm90._indexer_paged_gluon_load(kv_ptr, None, None, k_smem.index(t), sc_smem.index(t), None, i_pg,
                                           t < n_tiles, num_pages, stride_page, 0, PAGE, D, False, L_K, L_SC)

        # each row's q^T [D, HP] in the B operand's registers for the whole chunk, its weights [HP]
        q_smem = gl.allocate_shared_memory(Q_TYPE, [HP, D], Q_SL)
        i_row0 = i_b.to(gl.int64) * next_n + row0  # rows of q, the weights and the output
        i_row1 = i_b.to(gl.int64) * next_n + row1
        b_qt0 = _indexer_paged_mma_v2_q(q_ptr, q_smem, i_row0 * H * D, H, HP, D, L_K, OP_B, E4M3)
        o_w = gl.arange(0, HP, layout=COL)
        b_w0 = gl.load(w_ptr + i_row0 * H + o_w, mask=o_w < H, other=0.0)
        p_row0 = out_ptr + i_row0 * stride_out
        if NP == 2:
            b_qt1 = _indexer_paged_mma_v2_q(q_ptr, q_smem, i_row1 * H * D, H, HP, D, L_K, OP_B, E4M3)
            b_w1 = gl.load(w_ptr + i_row1 * H + o_w, mask=o_w < H, other=0.0)
            p_row1 = out_ptr + i_row1 * stride_out
        else:
            b_qt1 = b_qt0
            b_w1 = b_w0
            p_row1 = p_row0

        o_n = gl.arange(0, PAGE, layout=ROW)
        b_zero = gl.zeros([PAGE, HP], gl.float32, layout=MMA)
        for j in range(n_tiles):
            # page j has landed for every thread, and every thread is done with the buffer refilled next
            async_copy.wait_group(STAGES - 2)
            cta_barrier()
            jn = j + STAGES - 1
            i_ld = gl.load(p_bt + gl.minimum(tile0 + jn, last))
            sm90._indexer_paged_gluon_load(kv_ptr, None, None, k_smem.index(jn % STAGES), sc_smem.index(jn % STAGES),
                                           None, i_ld, jn < n_tiles, num_pages, stride_page, 0, PAGE, D, False, L_K,
                                           L_SC)
            st = j % STAGES
            i_pg = gl.load(p_bt + gl.minimum(tile0 + j, last))
            m_pg = (i_pg >= 0) & (i_pg < num_pages)
            if E4M3:
                b_k = k_smem.index(st).load(OP_A)
            else:
                b_k = k_smem.index(st).load(OP_A).to(gl.float16)
            b_sc = sc_smem.index(st).load(ROW)  # [PAGE]
            o_t = c0 + j * PAGE + o_n
            sm90._indexer_paged_gluon_row(mma_v2(b_k, b_qt0, b_zero), b_w0, b_sc, o_t, vis0, m_pg, p_row0, c1)
            if NP == 2:
                sm90._indexer_paged_gluon_row(mma_v2(b_k, b_qt1, b_zero), b_w1, b_sc, o_t, vis1, m_pg, p_row1, c1)
        async_copy.wait_group(0)

        sm90._indexer_paged_gluon_fill(p_row0, p_row1, c0 + n_tiles * PAGE, c1, NP, PAGE, NUM_WARPS)


def supported(q: torch.Tensor, kv_cache: torch.Tensor, arch: int | None) -> bool:
    """Whether this kernel takes the call: ``D`` 128, a ``next_n`` and head count of ``PAGED_MMA_V2_HEADS``,
    pages of 64 keys in 16-byte aligned rows (the copies move 16 bytes), fp8 ``q``, an arch of
    ``PAGED_MMA_V2_ARCHS`` with Gluon allowed, on CUDA. The arch is checked first: on the others (every decode
    step on sm_90) nothing else is looked at."""
    if not gluon_enabled(arch, cfgs.PAGED_MMA_V2_ARCHS):
        return False
    if q.dim() != 4 or kv_cache.dim() != 4 or not q.is_cuda:
        return False
    _, next_n, num_heads, _ = q.shape
    return num_heads in cfgs.PAGED_MMA_V2_HEADS.get(next_n, ()) and sm90.copyable_pages(q, kv_cache)


def e4m3_products(device: torch.device, rows: int, padded_heads: int) -> bool:
    """Whether the kernel multiplies in e4m3: where the GPU's own ``mma.sync`` takes e4m3 (sm_89 / 120 / 121),
    and where ``q^T`` in fp16 would not fit the registers (two rows of 64 heads: 256 per thread).

    Elsewhere (an sm_90 GPU under the sm120 proxy, where ``ptxas`` converts both operands of an e4m3 MMA to fp16
    at every MMA) the kernel converts the keys itself and holds ``q^T`` in fp16."""
    return device_capability(device) in cfgs.PAGED_MMA_V2_ARCHS or rows * padded_heads > FP16_Q_MAX_HEADS


@functools.lru_cache(maxsize=256)
def _launch_plan(B: int, next_n: int, H: int, max_context_len: int, num_sms: int, chunk: int | None
                 ) -> tuple[int, int, int, tuple[int, int], int]:
    """``(rows per program, row groups per request, chunk, grid, padded heads)`` of a launch, computed once per
    shape: rows go two to a program (one where ``next_n`` is 1)."""
    rows = min(next_n, 2)
    groups = cdiv(next_n, rows)
    chunk = chunk or cfgs.paged_chunk(B * groups, max_context_len, num_sms, PAGE, cfgs.PAGED_MMA_V2.resident)
    chunk = cdiv(chunk, PAGE) * PAGE
    return rows, groups, chunk, (B * groups, cdiv(max_context_len, chunk)), cfgs.padded_heads(H)


def fp8_paged_mqa_logits_mma_v2(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    *,
    chunk: int | None = None,
    e4m3: bool | None = None,
) -> torch.Tensor:
    """Gluon :func:`nsa_backend.fp8_paged_mqa_logits` for the mma.sync archs (see :func:`supported`).

    Same parameters and result as ``nsa_backend.kernels.indexer.fp8_paged_mqa_logits_triton`` (``kv_cache``
    4-D). ``chunk`` (keys per program) overrides ``configs.indexer.paged_chunk``;
    ``e4m3`` (products in e4m3 rather than fp16) overrides :func:`e4m3_products`.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]`` ``float32``.
    """
    B, next_n, H, D = q.shape
    if next_n < 1 or D != HEAD_DIM or kv_cache.shape[1] != PAGE:
        raise ValueError(f"the mma_v2 paged kernel takes next_n >= 1, D {HEAD_DIM} and pages of {PAGE} keys, "
                         f"got next_n {next_n}, D {D}, pages of {kv_cache.shape[1]}")
    num_pages = kv_cache.shape[0]
    out = torch.empty(B * next_n, max_context_len, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out
    if block_table.shape[1] == 0 or num_pages == 0:  # no page: no visible key
        return out.fill_(float("-inf"))
    rows, groups, chunk, grid, hp = _launch_plan(B, next_n, H, max_context_len, device_sms(q.device), chunk)
    cached_launcher(_indexer_paged_mma_v2_kernel)[grid](
        q, kv_cache, weights, context_lens, block_table, out, H, max_context_len, num_pages, block_table.shape[1],
        block_table.stride(0), kv_cache.stride(0), out.stride(0), next_n, groups, chunk,
        NP=rows, D=HEAD_DIM, HP=hp, PAGE=PAGE, STAGES=cfgs.PAGED_MMA_V2.num_stages,
        CTX_2D=context_lens.dim() == 2, E4M3=e4m3_products(q.device, rows, hp) if e4m3 is None else e4m3,
        NUM_WARPS=NUM_WARPS, num_warps=NUM_WARPS,
    )
    return out


def kernel():
    """The Gluon kernel (requires :func:`nsa_backend.kernels._gluon.gluon_importable`)."""
    return _indexer_paged_mma_v2_kernel


__all__ = ["HEAD_DIM", "PAGE", "e4m3_products", "fp8_paged_mqa_logits_mma_v2", "kernel", "supported"]
