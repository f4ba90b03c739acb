"""Time of the split merge alone (CUDA graph), by rows, heads and split count: the tree's and a chunked one."""
import json

import torch
import triton
import triton.language as tl

from nsa_backend.bench.timing import bench_ms
from nsa_backend.kernels.sparse_mla_decode.merge import merge_splits
from nsa_backend.kernels.sparse_mla_prefill.portable import _sparse_mla_bf16


@triton.jit(do_not_specialize=["h_q", "s_q", "num_splits"])
def _merge_chunked(part_o_ptr, part_lse_ptr, out_ptr, lse_ptr, h_q, s_q, num_splits,
                   D_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, MAX_S: tl.constexpr,
                   CHUNK: tl.constexpr):
    i_r = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1)
    i_d = tl.program_id(2)
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < h_q
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    base = i_r * num_splits * h_q
    o_s = tl.arange(0, MAX_S)
    lse = tl.load(part_lse_ptr + base + o_s[:, None] * h_q + o_h[None, :],
                  mask=(o_s[:, None] < num_splits) & m_h[None, :], other=float("-inf"))
    b_m = tl.max(lse, 0)
    m_empty = b_m == float("-inf")
    b_m_use = tl.where(m_empty, 0.0, b_m)
    b_w_sum = tl.sum(tl.math.exp2(lse - b_m_use[None, :]), 0)
    b_acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    o_c = tl.arange(0, CHUNK)
    for s0 in range(0, num_splits, CHUNK):
        m_c = (s0 + o_c) < num_splits
        l_c = tl.load(part_lse_ptr + base + (s0 + o_c)[:, None] * h_q + o_h[None, :],
                      mask=m_c[:, None] & m_h[None, :], other=float("-inf"))
        w = tl.math.exp2(l_c - b_m_use[None, :])
        rows = (base + (s0 + o_c)[:, None] * h_q + o_h[None, :]).to(tl.int64) * D_V
        o = tl.load(part_o_ptr + rows[:, :, None] + o_d[None, None, :],
                    mask=(m_c[:, None] & m_h[None, :])[:, :, None], other=0.0)
        b_acc += tl.sum(w[:, :, None] * o, 0)
    b_o = b_acc / tl.where(m_empty, 1.0, b_w_sum)[:, None]
    b_lse2 = b_m_use + tl.math.log2(tl.where(m_empty, 1.0, b_w_sum))
    b_lse = tl.where(m_empty, float("inf"), b_lse2 * 0.6931471805599453)
    p_out = out_ptr + ((i_r * h_q + o_h.to(tl.int64)) * D_V)[:, None] + o_d[None, :]
    tl.store(p_out, _sparse_mla_bf16(b_o), mask=m_h[:, None])
    i_b = i_r // s_q
    i_q = i_r % s_q
    if i_d == 0:
        tl.store(lse_ptr + i_b * h_q * s_q + o_h * s_q + i_q, b_lse, mask=m_h)


def merge_chunked(po, pl, out, lse, block_d, chunk):
    R, s, h, d = po.shape
    _merge_chunked[(R, triton.cdiv(h, 16), d // block_d)](po, pl, out, lse, h, 1, s, D_V=d, BLOCK_H=16,
                                                          BLOCK_D=block_d, MAX_S=64, CHUNK=chunk, num_warps=4)


dev = torch.device("cuda")
for R in (1, 4, 16, 64):
    for h in (32, 128):
        for s in (2, 8, 16, 32, 64):
            po = torch.randn(R, s, h, 512, device=dev)
            pl = torch.randn(R, s, h, device=dev)
            out = torch.empty(R, 1, h, 512, device=dev, dtype=torch.bfloat16)
            lse = torch.empty(R, h, 1, device=dev)
            row = {"R": R, "h_q": h, "splits": s}
            merge_splits(po, pl, None, out, lse)
            ref = out.float().clone()
            tree = lambda po=po, pl=pl, out=out, lse=lse: merge_splits(po, pl, None, out, lse)
            row["tree_us"] = round(bench_ms(tree, 10, 60, graph=True) * 1e3, 2)
            for bd, ch in ((64, 8), (32, 8), (64, 4)):
                merge_chunked(po, pl, out, lse, bd, ch)
                err = (out.float() - ref).abs().max().item()
                run = lambda po=po, pl=pl, out=out, lse=lse, bd=bd, ch=ch: merge_chunked(po, pl, out, lse, bd, ch)
                row[f"c{bd}x{ch}_us"] = round(bench_ms(run, 10, 60, graph=True) * 1e3, 2)
                row[f"c{bd}x{ch}_err"] = err
            print(json.dumps(row), flush=True)
