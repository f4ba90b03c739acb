"""Host-side pieces shared by the sparse MLA prefill variants (and decode): constants, output buffers
and the e4m3 decoding switch (heads per program: :func:`nsa_backend.configs.sparse_mla.heads_per_program`)."""

from __future__ import annotations

import torch

from nsa_backend.kernels.aot import FP8_NATIVE_MIN_ARCH

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def pow2_dequant_ptx(product: str) -> str:
    """PTX of the power-of-two dequantisation of four e4m3 bytes (``$2``) into four bf16 (``$0``, ``$1``) with
    their ``bf16(scale * 2^120)`` pairs (``$3``, ``$4``), for ``inline_asm_elementwise(..., pack=4)``.

    Per byte ``b`` the bf16 bits ``(b & 0x80) << 8 | (b & 0x7f) << 4`` are ``e4m3(b) * 2^-120`` exactly
    (subnormals and signed zeros included), so one bf16 product with ``bf16(scale * 2^120)`` is
    ``bf16(e4m3 * scale)`` for a power-of-two scale below ``2^8`` (from ``2^8`` on the factor overflows bf16).
    The bits come two bytes per 32-bit register: ``prmt`` with sign replication makes each 16-bit half
    ``int16(int8(b))``, then ``(x << 4) & 0x87f0`` keeps the sign at bit 15 and the 7 magnitude bits at 4-10
    (what the shift carries from the low half into the high one lands in bits 16-19, which the mask clears).
    ``product``: ``"mul"`` (``mul.rn.bf16x2``, sm_90+) or ``"fma"`` (``fma.rn.bf16x2`` with ``-0.0``, sm_80+).
    """
    if product not in ("mul", "fma"):
        raise ValueError(f"product: expected 'mul' or 'fma', got {product!r}")
    if product == "mul":
        regs, tail = "a, b", "mul.rn.bf16x2 $0, a, $3;\nmul.rn.bf16x2 $1, b, $4;"
    else:
        regs, tail = ("a, b, z", "mov.b32 z, 0x80008000;\nfma.rn.bf16x2 $0, a, $3, z;\nfma.rn.bf16x2 $1, b, $4, z;")
    return ("{\n.reg .b32 " + regs + ";\n"
            "prmt.b32 a, $2, 0, 0x9180;\nprmt.b32 b, $2, 0, 0xB3A2;\n"
            "shl.b32 a, a, 4;\nshl.b32 b, b, 4;\n"
            "and.b32 a, a, 0x87F087F0;\nand.b32 b, b, 0x87F087F0;\n" + tail + "\n}")


def e4m3_f16_dequant_ptx() -> str:
    """PTX of the exact dequantisation of four e4m3 bytes (``$2``) with their fp32 ``scale * 2^8`` (``$3`` .. ``$6``)
    into four bf16 (``$0``, ``$1``) without the fp8 conversions (sm_80 / 86), for ``inline_asm_elementwise(...,
    pack=4)``.

    Per byte ``b`` the fp16 bits ``(b & 0x80) << 8 | (b & 0x7f) << 7`` are ``e4m3(b) * 2^-8`` exactly (subnormals and
    signed zeros included; the NaN code 0x7f decodes as 480 * 2^-8), so the fp32 product with ``scale * 2^8`` rounded
    to bf16 is ``bf16(e4m3 * scale)`` for any scale. As in :func:`pow2_dequant_ptx`, ``prmt`` with sign replication
    makes each 16-bit half ``int16(int8(b))``; ``(x << 7) & 0xbf80`` keeps the sign at bit 15 and the 7 magnitude bits
    at 7-13 (the bits shifted from the low half into the high one land in bits 16-22, which the mask clears).
    """
    halves = "".join(f"cvt.f32.f16 f{i}, h{i};\nmul.rn.f32 f{i}, f{i}, ${3 + i};\n" for i in range(4))
    return ("{\n.reg .b32 a, b;\n.reg .b16 h0, h1, h2, h3;\n.reg .f32 f0, f1, f2, f3;\n"
            "prmt.b32 a, $2, 0, 0x9180;\nprmt.b32 b, $2, 0, 0xB3A2;\n"
            "shl.b32 a, a, 7;\nshl.b32 b, b, 7;\n"
            "and.b32 a, a, 0xBF80BF80;\nand.b32 b, b, 0xBF80BF80;\n"
            "mov.b32 {h0, h1}, a;\nmov.b32 {h2, h3}, b;\n" + halves
            + "cvt.rn.bf16x2.f32 $0, f1, f0;\ncvt.rn.bf16x2.f32 $1, f3, f2;\n}")


def gluon_rows_supported(q: torch.Tensor, kv: torch.Tensor, d_v: int) -> bool:
    """What the Gluon prefill kernels need of a call's tensors: bf16 ``q`` and ``kv`` with ``d_qk`` 576 and ``d_v``
    512, ``q`` rows and heads 16-byte aligned and ``kv`` contiguous and aligned (``cp.async`` copies 16 bytes)."""
    return (
        q.shape[-1] == 576
        and d_v == 512
        and q.dtype == torch.bfloat16
        and kv.dtype == torch.bfloat16
        and q.stride(2) == 1
        and q.stride(0) % 8 == 0
        and q.stride(1) % 8 == 0
        and q.data_ptr() % 16 == 0
        and kv.is_contiguous()
        and kv.data_ptr() % 16 == 0
    )


def prefill_rows(kv: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv [s_kv, 1, d_qk]`` as rows ``[s_kv, d_qk]`` and ``indices [s_q, 1, topk]`` as ``[s_q, topk]`` with unit
    stride along the list (the Gluon prefills read both by pointer)."""
    idx = indices.view(indices.shape[0], indices.shape[-1])
    return kv.view(kv.shape[0], kv.shape[-1]), (idx if idx.stride(-1) == 1 else idx.contiguous())


def fp8_native(arch: int | None) -> bool:
    """Whether kernels use Triton's e4m3 type on ``sm_<arch>`` (``None``: the interpreter, yes)."""
    return arch is None or arch >= FP8_NATIVE_MIN_ARCH


def prefill_outputs(q: torch.Tensor, d_v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uninitialised results of a prefill launch on ``q``'s device: ``out [s_q, h_q, d_v]`` bfloat16,
    ``max_logits`` and ``lse [s_q, h_q]`` float32 (the order the op returns them in)."""
    s_q, h_q, _ = q.shape
    out = torch.empty(s_q, h_q, d_v, dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h_q, dtype=torch.float32, device=q.device)
    return out, max_logits, lse

