"""Shared-memory bank conflicts of the mma.sync sparse MLA tile's own accesses (CPU: layouts only, no GPU).

The tile's score exchange (``sparse_mla_prefill/sm80_gluon.py``) and the fp8 decode's key conversion
(``sparse_mla_decode/sm89_gluon.py``) were measured 1.03-1.12x faster under the sm120 proxy once their shared
accesses stopped conflicting (``bench/results/h100-proxy-sm120/README.md``, ``score-exchange/`` and
``fp8-dequant-stores/``). These tests count the wavefronts of those accesses with the kernels' own layouts
(``tests/ops/_banks.py``; the model agrees with Triton's ``gl.bank_conflicts`` where that applies), so that a
layout change that brings the conflicts back fails here.
"""

from __future__ import annotations

import pytest

from tests.ops._gluon import gluon_available

pytestmark = pytest.mark.skipif(not gluon_available(), reason="needs a Triton with the Gluon dialect")


def _layouts():
    from triton.experimental.gluon import language as gl

    from nsa_backend.kernels.sparse_mla_decode import sm89_gluon as fp8
    from nsa_backend.kernels.sparse_mla_prefill import sm80_gluon as tile

    mma = tile.mma_v2_tile_layout()
    return dict(
        gl=gl,
        mma=mma,
        op_a=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),  # as mma_v2_attend_tile reads P's scores
        scores=tile.mma_v2_scores_layout(tile.BLOCK_H, tile.BLOCK_N),
        keys=tile.mma_v2_keys_layout(),
        dequant=fp8.mma_v2_dequant_layout(fp8.NUM_WARPS),
        raw=gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]),
        block=[tile.BLOCK_H, tile.BLOCK_N],
        warps=tile.NUM_WARPS,
    )


def test_model_agrees_with_triton_on_swizzled_layouts():
    """The model's worst phase equals ``gl.bank_conflicts`` on layouts Triton can count, conflicting or not: the
    exchange's rows unswizzled (4-way), XORed in 8-byte groups (still 4-way), the conversion of 16 and of 8 bytes a
    thread into the key rows (2-way / none), and the raw bytes read by the conversion."""
    from tests.ops._banks import phase_excess, triton_bank_conflicts

    t = _layouts()
    gl = t["gl"]
    old_dequant = gl.BlockedLayout([1, 16], [4, 8], [t["warps"], 1], [1, 0])
    cases = [
        (t["mma"], t["raw"], t["block"], gl.float32, 4, 3),
        (t["op_a"], t["raw"], t["block"], gl.float32, 4, 3),
        (t["mma"], gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]), t["block"], gl.float32, 4,
         3),
        (old_dequant, t["keys"], [32, 128], gl.bfloat16, 2, 1),
        (t["dequant"], t["keys"], [32, 128], gl.bfloat16, 2, 0),
        (t["dequant"], t["raw"], [32, 128], gl.uint8, 1, 0),
    ]
    for reg, smem, shape, dtype, nbytes, want in cases:
        got = max(phase_excess(reg, smem, shape, nbytes, t["warps"]))
        assert got == triton_bank_conflicts(reg, smem, shape, dtype, t["warps"]) == want, (reg, smem, got)


def test_score_exchange_is_conflict_free():
    """Every warp's stores of its scores (the MMA accumulator) and its loads of the head group's scores (the ``A``
    operand of ``P V``) take one wavefront per phase in the padded rows."""
    from tests.ops._banks import phase_excess

    t = _layouts()
    for reg in (t["mma"], t["op_a"]):
        excess = phase_excess(reg, t["scores"], t["block"], 4, t["warps"])
        assert excess and not any(excess), (reg, excess)


def test_fp8_key_conversion_is_conflict_free():
    """The fp8 decode's conversion reads each latent group's raw bytes (``[32, 128]`` of the ``[32, 512]`` rows) and
    stores the bf16 keys into the swizzled ``[32, 128]`` rows, one wavefront per phase both ways."""
    from tests.ops._banks import phase_excess

    t = _layouts()
    for group in range(4):
        raw = phase_excess(t["dequant"], t["raw"], [32, 128], 1, t["warps"], buffer=[32, 512], col0=group * 128)
        assert raw and not any(raw), (group, raw)
    keys = phase_excess(t["dequant"], t["keys"], [32, 128], 2, t["warps"])
    assert keys and not any(keys), keys
