"""Every public op is a torch custom op with a fake implementation: it traces under torch.compile.

``fullgraph=True`` fails on any graph break, so a passing test means the op (validation and
routing included) is captured as one opaque node, as vLLM and SGLang need for compiled models and
CUDA graphs. ``torch.library.opcheck`` checks the schema, the fake implementation and aliasing.
"""

from __future__ import annotations

import pytest
import torch

import nsa_backend as nb
from tests.ops import _inputs as mk

# torch.compile needs a C++ toolchain for inductor; aot_eager traces through the fake kernels.
BACKEND = "aot_eager"


def _close(a, b):
    if isinstance(a, tuple):
        for x, y in zip(a, b):
            _close(x, y)
        return
    torch.testing.assert_close(a, b, equal_nan=True, atol=0, rtol=0)


def _compiled_matches(fn, *args):
    torch._dynamo.reset()
    eager = fn(*args)
    compiled = torch.compile(fn, fullgraph=True, backend=BACKEND)(*args)
    _close(eager, compiled)


def test_compile_indexer_ops():
    a = mk.ragged_logits_args()
    p = mk.paged_logits_args()

    def ragged(q, k, s, w, ks, ke):
        return nb.fp8_mqa_logits(q, (k, s), w, ks, ke, max_seqlen_k=0).relu()

    def compressed(q, k, s, w, ks, ke):
        return nb.fp8_mqa_logits(q, (k, s), w, ks, ke, clean_logits=False, max_seqlen_k=6)

    def paged(q, cache, w, ctx, bt):
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 4)
        return nb.fp8_paged_mqa_logits(q, cache, w, ctx, bt, meta, 80)

    ra = (a["q"], a["kv"][0], a["kv"][1], a["weights"], a["cu_seq_len_k_start"], a["cu_seq_len_k_end"])
    _compiled_matches(ragged, *ra)
    _compiled_matches(compressed, *ra)
    _compiled_matches(paged, p["q"], p["kv_cache"], p["weights"], p["context_lens"], p["block_table"])
    _compiled_matches(lambda k: nb.pack_indexer_k_cache(k, 64), torch.randn(70, 64))


def test_compile_indexer_fp4_ops():
    from nsa_backend.reference import quantize_mxfp4

    q8 = torch.randn(3, 5, 128).to(torch.float8_e4m3fn)
    q4, q4s = quantize_mxfp4(torch.randn(3, 5, 128))
    k, ks_ = quantize_mxfp4(torch.randn(20, 128))
    k_scale = ks_.view(torch.int32).reshape(20)
    w = torch.randn(3, 5)
    ks = torch.tensor([0, 4, 19], dtype=torch.int32)
    ke = torch.tensor([20, 9, 19], dtype=torch.int32)

    def ragged(q, qs, k, s, w, ks, ke):
        return nb.fp8_fp4_mqa_logits((q, qs), (k, s), w, ks, ke, 6, torch.bfloat16)

    _compiled_matches(lambda q, k, s, w, ks, ke: nb.fp8_fp4_mqa_logits(q, (k, s), w, ks, ke), q8, k, k_scale, w, ks,
                      ke)
    _compiled_matches(ragged, q4, q4s.view(torch.int32).reshape(3, 5), k, k_scale, w, ks, ke)
    cache = nb.pack_indexer_k_cache_fp4(torch.randn(100, 128), 64)
    _compiled_matches(lambda x: nb.pack_indexer_k_cache_fp4(x, 64), torch.randn(100, 128))
    ctx = torch.tensor([[60, 61], [0, 1]], dtype=torch.int32)
    bt = torch.tensor([[1], [0]], dtype=torch.int32)

    def paged(q, cache, w, ctx, bt):
        meta = nb.get_paged_mqa_logits_metadata(ctx, 64, 4)
        return nb.fp8_fp4_paged_mqa_logits(q, cache, w, ctx, bt, meta, 70)

    _compiled_matches(paged, q8.reshape(3, 1, 5, 128)[:2].expand(2, 2, 5, 128).contiguous(), cache,
                      torch.randn(4, 5), ctx, bt)


def test_compile_topk_ops():
    t = mk.topk_args()
    g = mk.l2g_args()

    def select(logits, starts, ends, bt, req):
        idx = nb.topk_indices(logits, 4, starts, ends)
        return nb.logical_to_global_indices(idx, bt, req, 64)

    R = t["logits"].shape[0]
    starts = torch.zeros(R, dtype=torch.int32)
    ends = torch.full((R,), 15, dtype=torch.int32)
    _compiled_matches(select, t["logits"], starts, ends, g["block_table"], torch.tensor([0, 1, 1], dtype=torch.int32))


def test_compile_sparse_mla_ops():
    p = mk.prefill_args()
    d = mk.decode_args()
    sink = torch.randn(p["q"].shape[1])

    def prefill(q, kv, idx, sink):
        return nb.flash_mla_sparse_fwd(q, kv, idx, 0.05, attn_sink=sink)

    def decode(q, cache, idx):
        return nb.sparse_mla_decode(q, cache, idx, 0.05)

    _compiled_matches(prefill, p["q"], p["kv"], p["indices"], sink)
    _compiled_matches(decode, d["q"], d["kv_cache"], d["indices"])


def test_compile_sparse_mla_v4_decode():
    main = mk.decode_args(kv_format="fp8_ds_mla_v4")
    extra = mk.decode_args(kv_format="fp8_ds_mla_v4", num_blocks=3, page=8)
    sink = torch.randn(main["q"].shape[2])

    def decode(q, cache, idx, extra_cache, extra_idx, extra_len, sink):
        return nb.sparse_mla_decode(q, cache, idx, 0.05, kv_format="fp8_ds_mla_v4", attn_sink=sink,
                                    extra_kv_cache=extra_cache, extra_indices=extra_idx, extra_topk_length=extra_len)

    _compiled_matches(decode, main["q"], main["kv_cache"], main["indices"], extra["kv_cache"], extra["indices"],
                      extra["topk_length"], sink)


def test_compile_quant_and_mhc_ops():
    kv = torch.randn(5, 576).bfloat16()
    _compiled_matches(lambda x: nb.unpack_fp8_ds_mla(nb.pack_fp8_ds_mla(x, "pow2")), kv)

    def write(kv, cache, slots):
        nb.write_fp8_ds_mla_cache(kv, cache, slots)
        return cache

    w = mk.write_cache_args()
    torch._dynamo.reset()
    eager = write(w["kv"], w["kv_cache"].clone(), w["slot_mapping"])
    compiled = torch.compile(write, fullgraph=True, backend=BACKEND)(w["kv"], w["kv_cache"].clone(), w["slot_mapping"])
    assert torch.equal(eager, compiled)

    def hc(a, b):
        d = torch.empty(a.shape[0], b.shape[0])
        s = torch.empty(a.shape[0])
        nb.tf32_hc_prenorm_gemm(a, b, d, s)
        return d, s

    h = mk.hc_args()
    _compiled_matches(hc, h["a"], h["b"])


def test_compile_v4_cache_ops():
    kv = torch.randn(5, 512).bfloat16()
    _compiled_matches(lambda x: nb.unpack_fp8_ds_mla_v4(nb.pack_fp8_ds_mla_v4(x)), kv)

    def write(kv, cache, slots, weight, positions, cos_sin):
        nb.write_fp8_ds_mla_v4_cache(kv, cache, slots, weight, positions, cos_sin)
        return cache

    cache = torch.zeros(2, 64, 584, dtype=torch.uint8)
    args = (kv[:3], cache, torch.tensor([0, 70, -1]), torch.rand(512) + 0.5, torch.tensor([0, 3, 5]),
            torch.randn(8, 64))
    torch._dynamo.reset()
    eager = write(*args[:1], cache.clone(), *args[2:])
    compiled = torch.compile(write, fullgraph=True, backend=BACKEND)(*args[:1], cache.clone(), *args[2:])
    assert torch.equal(eager, compiled)
    assert eager.any()


OPCHECK_CASES = {
    "fp8_mqa_logits": lambda: (torch.ops.nsa_backend.fp8_mqa_logits, (
        *(lambda a: (a["q"], a["kv"][0], a["kv"][1], a["weights"], a["cu_seq_len_k_start"],
                     a["cu_seq_len_k_end"]))(mk.ragged_logits_args()), True, 0, "reference")),
    "topk_indices": lambda: (torch.ops.nsa_backend.topk_indices, (torch.randn(3, 20), 4, None, None, "reference")),
    "flash_mla_sparse_fwd": lambda: (torch.ops.nsa_backend.flash_mla_sparse_fwd, (
        *(lambda a: (a["q"], a["kv"], a["indices"], a["sm_scale"]))(mk.prefill_args()), 512, None, None,
        "reference")),
    "sparse_mla_decode": lambda: (torch.ops.nsa_backend.sparse_mla_decode, (
        *(lambda a: (a["q"], a["kv_cache"], a["indices"], a["sm_scale"]))(mk.decode_args()), 512, "fp8_ds_mla",
        None, None, "pow2", None, None, None, "reference")),
    "sparse_mla_decode_v4": lambda: (torch.ops.nsa_backend.sparse_mla_decode, (
        *(lambda a: (a["q"], a["kv_cache"], a["indices"], a["sm_scale"]))(mk.decode_args(kv_format="fp8_ds_mla_v4")),
        512, "fp8_ds_mla_v4", None, None, None, *(lambda a: (a["kv_cache"], a["indices"], a["topk_length"]))(
            mk.decode_args(kv_format="fp8_ds_mla_v4", num_blocks=3, page=8)), "reference")),
    "tf32_hc_prenorm_gemm": lambda: (torch.ops.nsa_backend.tf32_hc_prenorm_gemm, (
        *(lambda a: (a["a"], a["b"], a["d"], a["sqr_sum"]))(mk.hc_args(splits=2)), 2, "reference")),
    "write_fp8_ds_mla_cache": lambda: (torch.ops.nsa_backend.write_fp8_ds_mla_cache, (
        *(lambda a: (a["kv"], a["kv_cache"], a["slot_mapping"]))(mk.write_cache_args()), "arbitrary",
        "reference")),
}


@pytest.mark.parametrize("name", list(OPCHECK_CASES))
def test_opcheck(name):
    op, args = OPCHECK_CASES[name]()
    # test_autograd_registration is irrelevant (inference only). test_schema compares tensors with
    # arithmetic torch lacks for float8 on CPU, so fp8-input ops check the fake kernel only.
    fp8_inputs = any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args)
    utils = ("test_faketensor",) if fp8_inputs else ("test_schema", "test_faketensor")
    torch.library.opcheck(op, args, test_utils=utils)


def test_every_public_op_is_a_custom_op():
    registered = {name for name in dir(torch.ops.nsa_backend) if not name.startswith("_")}
    public = set(nb.IMPLEMENTATIONS)
    assert public <= registered, public - registered
