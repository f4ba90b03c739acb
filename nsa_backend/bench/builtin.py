"""Built-in tiny cases, one per family, used in quick mode when a family has no benchmark module.

They keep the whole harness exercised (timing, ratios, JSON, table, plots) on any machine: each
times the public op with ``impl="reference"``, a plain-torch baseline (``impl="torch"``), and on
CUDA the Triton kernel when it is installed. The shapes are small on purpose; the real shape
sets live in ``nsa_backend/bench/<family>.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import nsa_backend
from nsa_backend._dispatch import available_impls
from nsa_backend.bench.timing import bench_ms, gbps, tflops

FP8 = torch.float8_e4m3fn


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _impls(op: str, device: torch.device) -> list[str]:
    names = ["reference"]
    if device.type == "cuda" and "triton" in available_impls(op):
        names.append("triton")
    return names


def _rows(family: str, op: str, shape: dict[str, int], calls: dict[str, Callable[[], Any]],
          flops: float | None, nbytes: float | None, device: torch.device) -> list[dict[str, Any]]:
    warmup, rep = (2.0, 10.0) if device.type != "cuda" else (10.0, 50.0)
    rows = []
    for impl, fn in calls.items():
        row: dict[str, Any] = {"family": family, "op": op, "shape": shape, "impl": impl, "ms": None,
                               "tflops": None, "gbps": None, "ratios": {}}
        try:
            ms = bench_ms(fn, warmup, rep, device=device)
        except Exception as exc:  # a failing implementation is reported, the others still run
            row["note"] = f"{type(exc).__name__}: {exc}"
        else:
            row.update(ms=ms, tflops=tflops(flops, ms), gbps=gbps(nbytes, ms))
        rows.append(row)
    return rows


def _indexer(device: torch.device) -> list[dict[str, Any]]:
    S, N, H, D = 32, 256, 8, 64
    q = torch.randn(S, H, D, device=device).to(FP8)
    k = torch.randn(N, D, device=device).to(FP8)
    k_scale = torch.rand(N, device=device) + 0.5
    w = torch.randn(S, H, device=device)
    ke = torch.arange(N - S + 1, N + 1, device=device, dtype=torch.int32)  # causal rows
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    pairs = float((ke - ks).sum())

    def torch_logits() -> torch.Tensor:
        s = torch.einsum("shd,nd->shn", q.float(), k.float()).relu_()
        out = torch.einsum("shn,sh->sn", s, w) * k_scale[None, :]
        cols = torch.arange(N, device=device)[None, :]
        return out.masked_fill_((cols < ks[:, None]) | (cols >= ke[:, None]), float("-inf"))

    calls = {impl: (lambda impl=impl: nsa_backend.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, impl=impl))
             for impl in _impls("fp8_mqa_logits", device)}
    calls["torch"] = torch_logits
    nbytes = S * H * D + N * (D + 4) + S * H * 4 + S * N * 4
    return _rows("indexer", "fp8_mqa_logits", {"S": S, "N": N, "H": H, "D": D}, calls,
                 2.0 * H * D * pairs, nbytes, device)


def _topk(device: torch.device) -> list[dict[str, Any]]:
    R, N, K = 16, 2048, 128
    logits = torch.randn(R, N, device=device)
    calls = {impl: (lambda impl=impl: nsa_backend.topk_indices(logits, K, impl=impl))
             for impl in _impls("topk_indices", device)}
    calls["torch"] = lambda: torch.topk(logits, K, dim=1).indices.int()
    return _rows("topk", "topk_indices", {"R": R, "N": N, "topk": K}, calls, None, R * N * 4 + R * K * 4, device)


def _sparse_mla(device: torch.device) -> list[dict[str, Any]]:
    s_q, s_kv, h_q, d_qk, d_v, topk = 8, 256, 16, 576, 512, 64
    q = torch.randn(s_q, h_q, d_qk, device=device, dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 1, d_qk, device=device, dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, device=device)[:topk] for _ in range(s_q)]).int()[:, None, :]
    scale = d_qk ** -0.5

    def torch_attn() -> torch.Tensor:
        k = kv[:, 0][idx[:, 0].long()].float()  # [s_q, topk, d_qk]
        p = torch.einsum("thd,tkd->thk", q.float(), k) * scale
        return torch.einsum("thk,tkd->thd", p.softmax(-1), k[..., :d_v]).to(torch.bfloat16)

    calls = {impl: (lambda impl=impl: nsa_backend.flash_mla_sparse_fwd(q, kv, idx, scale, d_v, impl=impl))
             for impl in _impls("flash_mla_sparse_fwd", device)}
    calls["torch"] = torch_attn
    flops = 2.0 * s_q * h_q * topk * (d_qk + d_v)
    nbytes = 2 * (s_q * h_q * d_qk + s_q * topk * d_qk + s_q * h_q * d_v) + 4 * s_q * topk
    shape = {"s_q": s_q, "s_kv": s_kv, "h_q": h_q, "d_qk": d_qk, "topk": topk}
    return _rows("sparse_mla", "flash_mla_sparse_fwd", shape, calls, flops, nbytes, device)


def _mhc(device: torch.device) -> list[dict[str, Any]]:
    M, K, N = 64, 1024, 24
    a = torch.randn(M, K, device=device, dtype=torch.bfloat16)
    b = torch.randn(N, K, device=device)
    d = torch.empty(M, N, device=device)
    sq = torch.empty(M, device=device)

    def torch_gemm() -> None:
        af = a.float()
        torch.matmul(af, b.T, out=d)
        torch.sum(af * af, dim=-1, out=sq)

    calls = {impl: (lambda impl=impl: nsa_backend.tf32_hc_prenorm_gemm(a, b, d, sq, impl=impl))
             for impl in _impls("tf32_hc_prenorm_gemm", device)}
    calls["torch"] = torch_gemm
    flops = 2.0 * M * N * K + 2.0 * M * K
    nbytes = 2 * M * K + 4 * N * K + 4 * M * N + 4 * M
    return _rows("mhc", "tf32_hc_prenorm_gemm", {"M": M, "K": K, "N": N}, calls, flops, nbytes, device)


CASES: dict[str, Callable[[torch.device], list[dict[str, Any]]]] = {
    "indexer": _indexer,
    "topk": _topk,
    "sparse_mla": _sparse_mla,
    "mhc": _mhc,
}


def run(family: str, quick: bool, limits: dict[str, float | None]) -> list[dict[str, Any]]:
    """Rows of the built-in tiny case of ``family`` (same interface as a family module's ``run``)."""
    return CASES[family](_device())
