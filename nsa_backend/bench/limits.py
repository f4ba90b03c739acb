"""What the GPU can do, measured with torch in the same process as the kernels.

Three rates, each timed with :func:`nsa_backend.bench.timing.bench_ms`:

- ``copy_gbps``: device-to-device ``Tensor.copy_`` of a large buffer, counting the bytes read
  plus the bytes written (the ceiling of a memory-bound kernel);
- ``bf16_tflops``: ``torch.matmul`` of two bf16 ``n x n`` matrices, ``2 n^3`` FLOPs;
- ``fp8_tflops``: ``torch._scaled_mm`` of two e4m3 ``n x n`` matrices with per-tensor scales and
  fast accumulation, bf16 output, ``2 n^3`` FLOPs (``None`` below compute capability 8.9 or
  where the op is missing).

Under the mma.sync proxy (:mod:`nsa_backend.bench.proxy`) the two matmul rates are those of a
plain Triton GEMM compiled under the same restriction (:mod:`nsa_backend.bench.triton_matmul`), the
ceiling of the proxied arch's kernels on this GPU, instead of cuBLAS's.

On CPU (always quick) the sizes are small and the fp8 rate is ``None``; the numbers only
exercise the harness.
"""

from __future__ import annotations

import warnings

import torch

from nsa_backend.bench import triton_matmul
from nsa_backend.bench.timing import bench_ms

LIMIT_KEYS: tuple[str, ...] = ("copy_gbps", "bf16_tflops", "fp8_tflops")


def limit_sizes(device: str | torch.device, quick: bool) -> dict[str, int]:
    """Problem sizes used by :func:`measure_limits`: copy bytes and the matmul edge ``n``."""
    if torch.device(device).type != "cuda":
        return {"copy_bytes": 32 * 2**20, "matmul_n": 256}
    if quick:
        return {"copy_bytes": 512 * 2**20, "matmul_n": 4096}
    return {"copy_bytes": 2 * 2**30, "matmul_n": 8192}


def copy_gbps(device: torch.device, nbytes: int, warmup: float = 25.0, rep: float = 100.0) -> float:
    """Device-to-device copy rate of ``nbytes`` (bytes read plus written per second, in GB/s)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup, rep, device=device)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def _bf16_tflops(device: torch.device, n: int, warmup: float, rep: float) -> float:
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: torch.matmul(a, b), warmup, rep, device=device)
    return 2 * n**3 / ms / 1e9


def _fp8_tflops(device: torch.device, n: int, warmup: float, rep: float) -> float | None:
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return None
    if not hasattr(torch, "_scaled_mm"):
        return None
    fp8 = torch.float8_e4m3fn
    a = torch.randn(n, n, device=device).to(fp8)
    b = torch.randn(n, n, device=device).to(fp8).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device=device, dtype=torch.float32)

    def mm() -> torch.Tensor:
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)

    mm()
    ms = bench_ms(mm, warmup, rep, device=device)
    return 2 * n**3 / ms / 1e9


def measure_limits(device: str | torch.device, quick: bool,
                   mma_sync_smem: int | None = None) -> dict[str, float | None]:
    """Measure ``{"copy_gbps", "bf16_tflops", "fp8_tflops"}`` on ``device``.

    With ``mma_sync_smem`` (bytes of shared memory per block, set by the proxy) the matmul rates are
    the best of the Triton GEMM's configurations that fit it.

    A rate that cannot be measured here (no fp8 matmul, an error) is ``None`` and a warning says
    why; benchmark modules then leave out the ratio against it.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    sizes = limit_sizes(dev, quick)
    warmup, rep = (5.0, 20.0) if dev.type != "cuda" else (25.0, 100.0)
    out: dict[str, float | None] = dict.fromkeys(LIMIT_KEYS)
    n = sizes["matmul_n"]
    if mma_sync_smem is not None and dev.type == "cuda":
        def bf16() -> float:
            return triton_matmul.best_tflops(n, torch.bfloat16, dev, mma_sync_smem, warmup, rep)[0]

        def fp8() -> float:
            return triton_matmul.best_tflops(n, torch.float8_e4m3fn, dev, mma_sync_smem, warmup, rep)[0]
    else:
        def bf16() -> float:
            return _bf16_tflops(dev, n, warmup, rep)

        def fp8() -> float | None:
            return _fp8_tflops(dev, n, warmup, rep)
    steps = (
        ("copy_gbps", lambda: copy_gbps(dev, sizes["copy_bytes"], warmup, rep)),
        ("bf16_tflops", bf16),
        ("fp8_tflops", fp8),
    )
    for key, measure in steps:
        try:
            out[key] = measure()
        except (RuntimeError, TypeError, NotImplementedError) as exc:
            warnings.warn(f"limits: {key} not measured on {dev}: {exc}", RuntimeWarning, stacklevel=2)
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    return out
