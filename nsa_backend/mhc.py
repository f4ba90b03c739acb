"""mHC (manifold-constrained hyper-connection) pre-norm GEMM of DeepSeek-V4.

Signature and semantics match DeepGEMM's ``tf32_hc_prenorm_gemm``: ``d = a @ b.T`` and
``sqr_sum = sum(a * a, -1)``, optionally split over K into partial sums the caller adds up.
"""

from __future__ import annotations

import torch

from nsa_backend._checks import check_int, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl

K_ALIGN = 64
N_ALIGN = 8
MAX_N = 128


@custom_op("nsa_backend::tf32_hc_prenorm_gemm", mutates_args=("d", "sqr_sum"))
def _hc_prenorm_op(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, sqr_sum: torch.Tensor,
                   num_splits: int | None, impl: str) -> None:
    get_impl("tf32_hc_prenorm_gemm", impl)(a, b, d, sqr_sum, num_splits)


@_hc_prenorm_op.register_fake
def _(a, b, d, sqr_sum, num_splits, impl):
    return None


def tf32_hc_prenorm_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    d: torch.Tensor,
    sqr_sum: torch.Tensor,
    num_splits: int | None = None,
    *,
    impl: str = "auto",
) -> None:
    """Fused ``d = a @ b.T`` and ``sqr_sum = sum(a^2, -1)`` (writes ``d`` and ``sqr_sum`` in place).

    Parameters
    ----------
    a : torch.Tensor
        ``[M, K]`` ``bfloat16``, contiguous; ``K % 64 == 0``.
    b : torch.Tensor
        ``[N, K]`` ``float32``, contiguous; ``N % 8 == 0``, ``N <= 128`` (DeepSeek-V4: ``N = 24``).
    d : torch.Tensor
        ``[M, N]`` ``float32``, or ``[S, M, N]`` with ``S = num_splits`` partial sums over K.
    sqr_sum : torch.Tensor
        ``[M]`` ``float32``, or ``[S, M]`` with ``num_splits``.
    num_splits : int, optional
        Number of K partitions (the 3-D form); ``None`` for the 2-D form.

    Notes
    -----
    The reference accumulates in float32; the Triton kernel multiplies with TF32 tensor cores or
    better (see its docstring for the measured error). Any K partition whose parts sum to the full
    result is valid, as in DeepGEMM.
    """
    dims: dict[str, int] = {}
    check_tensor(a, "a", dtype=torch.bfloat16, shape=("M", "K"), dims=dims, contiguous=True)
    dev = a.device
    check_tensor(b, "b", dtype=torch.float32, shape=("N", "K"), dims=dims, device=dev, contiguous=True)
    if dims["K"] % K_ALIGN:
        raise ValueError(f"a: expected K (a.shape[1]) to be a multiple of {K_ALIGN}, got {dims['K']}")
    if dims["N"] % N_ALIGN or not 0 < dims["N"] <= MAX_N:
        raise ValueError(f"b: expected N (b.shape[0]) to be a multiple of {N_ALIGN} in [8, {MAX_N}], got {dims['N']}")
    if num_splits is None:
        check_tensor(d, "d", dtype=torch.float32, shape=("M", "N"), dims=dims, device=dev, contiguous=True)
        check_tensor(sqr_sum, "sqr_sum", dtype=torch.float32, shape=("M",), dims=dims, device=dev, contiguous=True)
    else:
        check_int(num_splits, "num_splits", min_value=1, max_value=dims["K"] // K_ALIGN)
        dims["S"] = num_splits
        check_tensor(d, "d", dtype=torch.float32, shape=("S", "M", "N"), dims=dims, device=dev, contiguous=True)
        check_tensor(sqr_sum, "sqr_sum", dtype=torch.float32, shape=("S", "M"), dims=dims, device=dev,
                     contiguous=True)
    name = resolve_impl("tf32_hc_prenorm_gemm", impl, {"device": dev, "n": dims["N"], "k": dims["K"],
                                                       "m": dims["M"]})
    _hc_prenorm_op(a, b, d, sqr_sum, num_splits, name)
