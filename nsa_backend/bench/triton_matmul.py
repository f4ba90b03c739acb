"""A plain Triton matmul: the compute ceiling of the mma.sync proxy.

Under the proxy (``DISABLE_MMA_V3=1``) ``tl.dot`` lowers to mma.sync, and cuBLAS's rates (wgmma)
no longer bound our kernels. The ceiling is then what a straightforward Triton GEMM reaches under
the same restriction: ``C = A @ B`` with bf16 or e4m3 inputs, fp32 accumulation and a bf16 output,
timed over a few tile configurations that fit the proxied shared-memory budget; the best counts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from nsa_backend.bench.timing import bench_ms

# (BLOCK_M, BLOCK_N, BLOCK_K in bytes of the input dtype / element size, stages, warps) per input width.
CONFIGS: dict[int, tuple[tuple[int, int, int, int, int], ...]] = {
    2: ((128, 128, 32, 4, 4), (128, 128, 64, 3, 8), (128, 256, 32, 3, 8), (256, 128, 32, 3, 8), (128, 64, 64, 4, 4)),
    1: ((128, 128, 64, 4, 4), (128, 128, 128, 3, 8), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8), (128, 64, 128, 4, 4)),
}


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   STAGES: tl.constexpr):
    # Grouped launch order so consecutive blocks share rows of A in L2.
    pid = tl.program_id(0)
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # B stored [N, K]: K-major, as mma wants
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in tl.range(0, tl.cdiv(K, BLOCK_K), num_stages=STAGES):
        acc = tl.dot(tl.load(a_ptrs), tl.load(b_ptrs), acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(tl.bfloat16))


def matmul(a: torch.Tensor, b: torch.Tensor, config: tuple[int, int, int, int, int]) -> torch.Tensor:
    """``a @ b.T`` in bf16 with fp32 accumulation.

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K]`` bf16 or float8_e4m3fn, contiguous.
    b : torch.Tensor
        ``[N, K]`` same dtype, contiguous.
    config : tuple
        ``(BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)``; M, N and K must be multiples of the blocks.
    """
    (m, k), n = a.shape, b.shape[0]
    bm, bn, bk, stages, warps = config
    if m % bm or n % bn or k % bk:
        raise ValueError(f"matmul: M, N, K = {m}, {n}, {k} must be multiples of the block {bm} x {bn} x {bk}")
    c = torch.empty(m, n, device=a.device, dtype=torch.bfloat16)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _matmul_kernel[grid](a, b, c, m, n, k, a.stride(0), b.stride(0), c.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=bk, GROUP_M=8, STAGES=stages, num_warps=warps)
    return c


def best_tflops(n: int, dtype: torch.dtype, device: torch.device, shared_memory_limit: int,
                warmup: float = 25.0, rep: float = 100.0) -> tuple[float, tuple[int, int, int, int, int]]:
    """Best useful TFLOP/s of an ``n x n x n`` matmul over :data:`CONFIGS` whose pipelined tiles fit
    ``shared_memory_limit``, and the configuration that reached it."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    size = a.element_size()
    best: tuple[float, tuple[int, int, int, int, int]] | None = None
    for cfg in CONFIGS[size]:
        bm, bn, bk, stages, _ = cfg
        if (bm + bn) * bk * size * stages > shared_memory_limit:
            continue
        try:
            ms = bench_ms(lambda c=cfg: matmul(a, b, c), warmup, rep, device=device)
        except (RuntimeError, ValueError, CompilationError, OutOfResources):
            continue
        rate = 2 * n**3 / ms / 1e9
        if best is None or rate > best[0]:
            best = (rate, cfg)
    if best is None:
        raise RuntimeError(f"no Triton matmul configuration ran for {dtype} within {shared_memory_limit} B")
    return best
