"""Shared-memory wavefronts of a register layout stored to / loaded from a shared layout (CPU, no GPU).

A warp's ``ld.shared`` / ``st.shared`` of ``b`` bytes a thread is served in phases of ``128 / b`` threads (32 for
four bytes or fewer); a phase takes as many wavefronts as the largest number of distinct 4-byte words that fall in
one of the 32 banks. :func:`phase_excess` gives the wavefronts above one of each phase of every instruction of
every warp; Triton's ``gl.bank_conflicts`` gives the largest of them for the layouts it can (it aborts on padded
shared layouts, which this model handles). Register layouts come from Triton itself (``gl.to_linear_layout`` in a probe
that is only lowered to IR), each thread's registers grouped into the widest vector (up to 16 bytes) that is
contiguous in shared memory, as Triton vectorises those accesses.
"""

from __future__ import annotations

import triton
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

_SEEN: dict[str, object] = {}


@triton.constexpr_function
def _record(key, value):
    _SEEN[key] = value
    return 0


@gluon.jit
def _probe(x_ptr, REG: gl.constexpr, SMEM: gl.constexpr, M: gl.constexpr, N: gl.constexpr, DT: gl.constexpr,
           TRITON_COUNT: gl.constexpr):
    _record("linear", gl.to_linear_layout(REG, [M, N]))
    if TRITON_COUNT:
        s = gl.allocate_shared_memory(DT, [M, N], SMEM)
        _record("triton", gl.bank_conflicts(gl.full([M, N], 0, DT, layout=REG).type, s.type))


def _lower(reg, smem, shape: list[int], dtype, num_warps: int, triton_count: bool) -> dict[str, object]:
    _SEEN.clear()
    src = GluonASTSource(fn=_probe, signature={"x_ptr": "*fp32", "REG": "constexpr", "SMEM": "constexpr",
                                               "M": "constexpr", "N": "constexpr", "DT": "constexpr",
                                               "TRITON_COUNT": "constexpr"},
                         constexprs={"REG": reg, "SMEM": smem, "M": shape[0], "N": shape[1], "DT": dtype,
                                     "TRITON_COUNT": triton_count})
    target = GPUTarget("cuda", 120, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": num_warps})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)
    return dict(_SEEN)


def linear_layout(reg, shape: list[int], num_warps: int):
    """Triton's ``DistributedLinearLayout`` of register layout ``reg`` over ``shape``."""
    return _lower(reg, gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]), shape, gl.float32, num_warps, False)["linear"]


def triton_bank_conflicts(reg, smem, shape: list[int], dtype, num_warps: int) -> int:
    """``gl.bank_conflicts`` of the pair (swizzled shared layouts only)."""
    return _lower(reg, smem, shape, dtype, num_warps, True)["triton"]


def _coordinate(bases: list[list[int]], index: int) -> tuple[int, int]:
    row = col = 0
    for bit, (r, c) in enumerate(bases):
        if index >> bit & 1:
            row, col = row ^ r, col ^ c
    return row, col


def shared_offset(smem, buffer: list[int]):
    """The element offset of ``(row, col)`` in a ``buffer``-shaped allocation of ``smem`` (row-major swizzled or padded
    layouts)."""
    rows, cols = buffer
    if isinstance(smem, gl.SwizzledSharedLayout):
        assert list(smem.order) == [1, 0], smem

        def swizzled(row: int, col: int) -> int:
            phase = (row // smem.per_phase) % smem.max_phase
            return row * cols + ((col // smem.vec) ^ phase) * smem.vec + col % smem.vec

        return swizzled
    if isinstance(smem, gl.PaddedSharedLayout):
        offsets = {_coordinate(smem.offset_bases, i): i for i in range(rows * cols)}

        def padded(row: int, col: int) -> int:
            linear = offsets[(row, col)]
            return linear + sum((linear // interval) * pad for interval, pad in smem.interval_padding_pairs)

        return padded
    raise TypeError(f"no address model for {type(smem).__name__}")


def phase_excess(reg, smem, shape: list[int], elem_bytes: int, num_warps: int, buffer: list[int] | None = None,
                 col0: int = 0) -> list[int]:
    """Per phase of every instruction of every warp that moves a ``shape`` tensor in register layout ``reg`` to or
    from columns ``col0 ..`` of a ``buffer``-shaped (default ``shape``) allocation of shared layout ``smem``: its
    wavefronts above one."""
    ll = linear_layout(reg, shape, num_warps)
    offset = shared_offset(smem, buffer or shape)
    regs = 1 << len(ll.reg_bases)

    def address(reg_i: int, lane: int, warp: int) -> int:
        r0, c0 = _coordinate(ll.reg_bases, reg_i)
        r1, c1 = _coordinate(ll.lane_bases, lane)
        r2, c2 = _coordinate(ll.warp_bases, warp)
        return offset(r0 ^ r1 ^ r2, (c0 ^ c1 ^ c2) + col0)

    vec = 1
    while (vec * 2 <= regs and vec * 2 * elem_bytes <= 16 and all(
            address(base + i, lane, warp) == address(base, lane, warp) + i
            for base in range(0, regs, vec * 2) for i in range(vec * 2)
            for lane in range(32) for warp in range(num_warps))):
        vec *= 2
    width = vec * elem_bytes
    per_phase = 32 if width <= 4 else 128 // width
    out = []
    for warp in range(num_warps):
        for base in range(0, regs, vec):
            for first in range(0, 32, per_phase):
                banks: dict[int, set[int]] = {}
                for lane in range(first, first + per_phase):
                    start = address(base, lane, warp) * elem_bytes
                    for word in range(start // 4, (start + width - 1) // 4 + 1):
                        banks.setdefault(word % 32, set()).add(word)
                out.append(max(len(words) for words in banks.values()) - 1)
    return out
