"""Bad inputs fail on the host with a TypeError/ValueError naming the argument, before any kernel runs.

Each case builds valid inputs, breaks exactly one thing and checks the exception type and that the
message names the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import nsa_backend as nb
from tests.ops import _inputs as mk

FP8 = torch.float8_e4m3fn


def _set(**changes: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def apply(args: dict[str, Any]) -> dict[str, Any]:
        args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
        return args
    return apply


def _padded_cache(args: dict[str, Any]) -> torch.Tensor:
    # Page-contiguous is required: a token-strided view breaks it.
    return args["kv_cache"].transpose(0, 1).contiguous().transpose(0, 1)


# (id, op, valid-input factory, breaker, exception, fragments that must appear in the message)
CASES: list[tuple[str, Callable[..., Any], Callable[[], dict[str, Any]], Callable, type, tuple[str, ...]]] = [
    # fp8_mqa_logits
    ("ragged-q-bf16", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(q=lambda a: a["q"].float().bfloat16()), TypeError, ("q", "float8_e4m3fn", "bfloat16")),
    ("ragged-q-2d", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(q=lambda a: a["q"][:, 0]), ValueError, ("q", "3-D")),
    ("ragged-head-dim-96", nb.fp8_mqa_logits, lambda: mk.ragged_logits_args(D=64),
     _set(q=lambda a: torch.zeros(3, 4, 96).to(FP8), kv=lambda a: (torch.zeros(10, 96).to(FP8), a["kv"][1])),
     ValueError, ("head dim", "[64, 128]", "96")),
    ("ragged-heads-129", nb.fp8_mqa_logits, lambda: mk.ragged_logits_args(H=129, S=1, N=2),
     _set(), ValueError, ("heads", "128", "129")),
    ("ragged-kv-not-tuple", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(kv=lambda a: a["kv"][0]), TypeError, ("kv", "tuple")),
    ("ragged-k-dim-mismatch", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(kv=lambda a: (torch.zeros(10, 128).to(FP8), a["kv"][1])), ValueError, ("k", "D=64")),
    ("ragged-kscale-len", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(kv=lambda a: (a["kv"][0], torch.ones(9))), ValueError, ("k_scale", "N=10")),
    ("ragged-kscale-bf16", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(kv=lambda a: (a["kv"][0], torch.ones(10).bfloat16())), TypeError, ("k_scale", "float32")),
    ("ragged-weights-shape", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(weights=torch.ones(3, 5)), ValueError, ("weights", "H=4")),
    ("ragged-ks-int64", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(cu_seq_len_k_start=torch.zeros(3, dtype=torch.int64)), TypeError, ("cu_seq_len_k_start", "int32")),
    ("ragged-ke-len", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(cu_seq_len_k_end=torch.zeros(4, dtype=torch.int32)), ValueError, ("cu_seq_len_k_end", "S=3")),
    ("ragged-max-seqlen-neg", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(max_seqlen_k=-1), ValueError, ("max_seqlen_k", ">= 0")),
    ("ragged-clean-not-bool", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(clean_logits=1), TypeError, ("clean_logits", "bool")),
    ("ragged-unknown-impl", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(impl="cutlass"), ValueError, ("impl", "reference", "cutlass")),
    ("ragged-impl-not-offered", nb.fp8_mqa_logits, mk.ragged_logits_args,
     _set(impl="flash_mla"), ValueError, ("impl", "fp8_mqa_logits", "flash_mla")),
    # get_paged_mqa_logits_metadata
    ("meta-block-kv-48", nb.get_paged_mqa_logits_metadata, lambda: dict(
        context_lens=torch.ones(2, dtype=torch.int32), block_kv=48, num_sms=4), _set(),
     ValueError, ("block_kv", "[32, 64]", "48")),
    ("meta-num-sms-0", nb.get_paged_mqa_logits_metadata, lambda: dict(
        context_lens=torch.ones(2, dtype=torch.int32), block_kv=64, num_sms=0), _set(),
     ValueError, ("num_sms", ">= 1")),
    ("meta-ctx-3d", nb.get_paged_mqa_logits_metadata, lambda: dict(
        context_lens=torch.ones(2, 1, 1, dtype=torch.int32), block_kv=64, num_sms=4), _set(),
     ValueError, ("context_lens", "1-D or 2-D")),
    ("meta-ctx-float", nb.get_paged_mqa_logits_metadata, lambda: dict(
        context_lens=torch.ones(2), block_kv=64, num_sms=4), _set(), TypeError, ("context_lens", "int32")),
    # fp8_paged_mqa_logits
    ("paged-next-n-5", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(q=torch.zeros(2, 5, 4, 64).to(FP8)), ValueError, ("next_n", "<= 4", "5")),
    ("paged-cache-width", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(kv_cache=torch.zeros(3, 64, 1, 64, dtype=torch.uint8)), ValueError, ("kv_cache", "D + 4 = 68")),
    ("paged-cache-dtype", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(kv_cache=lambda a: a["kv_cache"].float()), TypeError, ("kv_cache", "uint8")),
    ("paged-cache-block-16", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(kv_cache=torch.zeros(3, 16, 1, 68, dtype=torch.uint8)), ValueError, ("block_kv", "16")),
    ("paged-cache-strided", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(kv_cache=_padded_cache), ValueError, ("kv_cache", "contiguous", "strides")),
    ("paged-weights-rows", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(weights=torch.ones(2, 4)), ValueError, ("weights", "rows=4")),
    ("paged-ctx-batch", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(context_lens=torch.ones(3, dtype=torch.int32)), ValueError, ("context_lens", "B=2")),
    ("paged-ctx-2d-next-n", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(context_lens=torch.ones(2, 3, dtype=torch.int32)), ValueError, ("context_lens", "next_n=2")),
    ("paged-block-table-dtype", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(block_table=lambda a: a["block_table"].long()), TypeError, ("block_table", "int32")),
    ("paged-schedule-shape", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(schedule_meta=torch.zeros(5, 3, dtype=torch.int32)), ValueError, ("schedule_meta", "2")),
    ("paged-max-ctx-float", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(max_context_len=80.0), TypeError, ("max_context_len", "int")),
    ("paged-device-mismatch", nb.fp8_paged_mqa_logits, mk.paged_logits_args,
     _set(weights=lambda a: a["weights"].to("meta")), ValueError, ("weights", "cpu", "meta")),
    # pack_indexer_k_cache
    ("kpack-int-input", nb.pack_indexer_k_cache, lambda: dict(k=torch.zeros(4, 64, dtype=torch.int32)), _set(),
     TypeError, ("k", "bfloat16")),
    ("kpack-dim-32", nb.pack_indexer_k_cache, lambda: dict(k=torch.zeros(4, 32)), _set(),
     ValueError, ("head dim", "32")),
    ("kpack-pair-len", nb.pack_indexer_k_cache, lambda: dict(k=(torch.zeros(4, 64).to(FP8),)), _set(),
     TypeError, ("k", "pair")),
    # topk_indices
    ("topk-zero", nb.topk_indices, mk.topk_args, _set(topk=0), ValueError, ("topk", ">= 1")),
    ("topk-logits-bf16", nb.topk_indices, mk.topk_args,
     _set(logits=lambda a: a["logits"].bfloat16()), TypeError, ("logits", "float32")),
    ("topk-logits-1d", nb.topk_indices, mk.topk_args,
     _set(logits=lambda a: a["logits"][0]), ValueError, ("logits", "2-D")),
    ("topk-starts-len", nb.topk_indices, mk.topk_args,
     _set(starts=torch.zeros(2, dtype=torch.int32)), ValueError, ("starts", "R=3")),
    ("topk-ends-int64", nb.topk_indices, mk.topk_args,
     _set(ends=torch.zeros(3, dtype=torch.int64)), TypeError, ("ends", "int32")),
    # logical_to_global_indices
    ("l2g-page-size-0", nb.logical_to_global_indices, mk.l2g_args, _set(page_size=0), ValueError,
     ("page_size", ">= 1")),
    ("l2g-req-ids-len", nb.logical_to_global_indices, mk.l2g_args,
     _set(req_ids=torch.zeros(3, dtype=torch.int32)), ValueError, ("req_ids", "R=2")),
    ("l2g-indices-int64", nb.logical_to_global_indices, mk.l2g_args,
     _set(indices=lambda a: a["indices"].long()), TypeError, ("indices", "int32")),
    # flash_mla_sparse_fwd
    ("prefill-q-fp16", nb.flash_mla_sparse_fwd, mk.prefill_args,
     _set(q=lambda a: a["q"].half()), TypeError, ("q", "bfloat16", "float16")),
    ("prefill-dqk-256", nb.flash_mla_sparse_fwd, lambda: mk.prefill_args(d_qk=256), _set(), ValueError,
     ("d_qk", "[512, 576]", "256")),
    ("prefill-kv-heads-2", nb.flash_mla_sparse_fwd, mk.prefill_args,
     _set(kv=torch.zeros(12, 2, 576).bfloat16()), ValueError, ("kv", "1")),
    ("prefill-indices-rows", nb.flash_mla_sparse_fwd, mk.prefill_args,
     _set(indices=torch.zeros(3, 1, 4, dtype=torch.int32)), ValueError, ("indices", "s_q=2")),
    ("prefill-dv-256", nb.flash_mla_sparse_fwd, mk.prefill_args, _set(d_v=256), ValueError, ("d_v", "512")),
    ("prefill-sm-scale-neg", nb.flash_mla_sparse_fwd, mk.prefill_args, _set(sm_scale=-1.0), ValueError,
     ("sm_scale", "> 0")),
    ("prefill-sink-shape", nb.flash_mla_sparse_fwd, mk.prefill_args, _set(attn_sink=torch.zeros(3)),
     ValueError, ("attn_sink", "h_q=2")),
    ("prefill-topk-length-dtype", nb.flash_mla_sparse_fwd, mk.prefill_args,
     _set(topk_length=torch.zeros(2)), TypeError, ("topk_length", "int32")),
    ("prefill-heads-256", nb.flash_mla_sparse_fwd, lambda: mk.prefill_args(h_q=129, s_q=1, s_kv=2, topk=1),
     _set(), ValueError, ("h_q", "128", "129")),
    # sparse_mla_decode
    ("decode-kv-format", nb.sparse_mla_decode, mk.decode_args, _set(kv_format="fp8_e4m3"), ValueError,
     ("kv_format", "fp8_ds_mla", "bf16")),
    ("decode-cache-656-wrong", nb.sparse_mla_decode, mk.decode_args,
     _set(kv_cache=torch.zeros(2, 64, 1, 600, dtype=torch.uint8)), ValueError, ("kv_cache", "656")),
    ("decode-fp8-needs-576", nb.sparse_mla_decode, mk.decode_args,
     _set(q=torch.zeros(2, 1, 2, 512).bfloat16()), ValueError, ("q", "576", "512")),
    ("decode-bf16-cache-dtype", nb.sparse_mla_decode, lambda: mk.decode_args(kv_format="bf16"),
     _set(kv_cache=lambda a: a["kv_cache"].float()), TypeError, ("kv_cache", "bfloat16")),
    ("decode-indices-shape", nb.sparse_mla_decode, mk.decode_args,
     _set(indices=torch.zeros(2, 2, 4, dtype=torch.int32)), ValueError, ("indices", "s_q=1")),
    ("decode-s-q-17", nb.sparse_mla_decode, mk.decode_args,
     _set(q=torch.zeros(2, 17, 2, 576).bfloat16()), ValueError, ("s_q", "16", "17")),
    ("decode-topk-length-shape", nb.sparse_mla_decode, mk.decode_args,
     _set(topk_length=torch.ones(1, 1, dtype=torch.int32)), ValueError, ("topk_length", "B=2")),
    ("decode-scale-format", nb.sparse_mla_decode, mk.decode_args, _set(kv_scale_format="ue8m0"), ValueError,
     ("kv_scale_format", "arbitrary", "pow2", "ue8m0")),
    ("decode-scale-format-bf16", nb.sparse_mla_decode, lambda: mk.decode_args(kv_format="bf16"),
     _set(kv_scale_format="pow2"), ValueError, ("kv_scale_format", "fp8_ds_mla", "bf16")),
    # pack / unpack / write fp8_ds_mla
    ("pack-width-512", nb.pack_fp8_ds_mla, lambda: dict(kv=torch.zeros(4, 512).bfloat16()), _set(), ValueError,
     ("kv", "576")),
    ("pack-scale-format", nb.pack_fp8_ds_mla, lambda: dict(kv=torch.zeros(4, 576).bfloat16()),
     _set(scale_format="ue8m0"), ValueError, ("scale_format", "arbitrary", "pow2")),
    ("unpack-width", nb.unpack_fp8_ds_mla, lambda: dict(packed=torch.zeros(4, 655, dtype=torch.uint8)), _set(),
     ValueError, ("packed", "656")),
    ("write-slot-float", nb.write_fp8_ds_mla_cache, mk.write_cache_args,
     _set(slot_mapping=torch.zeros(3)), TypeError, ("slot_mapping", "int32")),
    ("write-cache-width", nb.write_fp8_ds_mla_cache, mk.write_cache_args,
     _set(kv_cache=torch.zeros(2, 64, 576, dtype=torch.uint8)), ValueError, ("kv_cache", "656")),
    # tf32_hc_prenorm_gemm
    ("hc-k-not-64", nb.tf32_hc_prenorm_gemm, lambda: mk.hc_args(K=96), _set(), ValueError, ("K", "64", "96")),
    ("hc-n-not-8", nb.tf32_hc_prenorm_gemm, lambda: mk.hc_args(N=12), _set(), ValueError, ("N", "8", "12")),
    ("hc-b-bf16", nb.tf32_hc_prenorm_gemm, mk.hc_args, _set(b=lambda a: a["b"].bfloat16()), TypeError,
     ("b", "float32")),
    ("hc-d-shape", nb.tf32_hc_prenorm_gemm, mk.hc_args, _set(d=torch.empty(4, 16)), ValueError, ("d", "N=8")),
    ("hc-splits-vs-2d", nb.tf32_hc_prenorm_gemm, mk.hc_args, _set(num_splits=2), ValueError, ("d", "3-D")),
    ("hc-a-noncontig", nb.tf32_hc_prenorm_gemm, lambda: mk.hc_args(K=128),
     _set(a=lambda a: torch.randn(128, 4).bfloat16().T), ValueError, ("a", "contiguous")),
    ("hc-sqr-sum-splits", nb.tf32_hc_prenorm_gemm, lambda: mk.hc_args(splits=2),
     _set(sqr_sum=torch.empty(4)), ValueError, ("sqr_sum", "2-D")),
]


def test_table_is_large_and_distinct():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in CASES])
def test_bad_input_is_rejected(case):
    _, op, make, breaker, exc, fragments = case
    args = breaker(make())
    with pytest.raises(exc) as info:
        op(**args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


@pytest.mark.parametrize("make,op", [
    pytest.param(mk.ragged_logits_args, nb.fp8_mqa_logits, id="fp8_mqa_logits"),
    pytest.param(mk.paged_logits_args, nb.fp8_paged_mqa_logits, id="fp8_paged_mqa_logits"),
    pytest.param(mk.topk_args, nb.topk_indices, id="topk_indices"),
    pytest.param(mk.l2g_args, nb.logical_to_global_indices, id="logical_to_global_indices"),
    pytest.param(mk.prefill_args, nb.flash_mla_sparse_fwd, id="flash_mla_sparse_fwd"),
    pytest.param(mk.decode_args, nb.sparse_mla_decode, id="sparse_mla_decode"),
    pytest.param(mk.hc_args, nb.tf32_hc_prenorm_gemm, id="tf32_hc_prenorm_gemm"),
    pytest.param(mk.write_cache_args, nb.write_fp8_ds_mla_cache, id="write_fp8_ds_mla_cache"),
])
def test_valid_inputs_pass(make, op):
    """The unbroken inputs of the table are accepted (so each case fails for its one change)."""
    op(**make(), impl="reference")


def test_triton_on_cpu_without_interpreter_is_rejected(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError) as info:
        nb.topk_indices(**mk.topk_args(), impl="triton")
    assert "triton" in str(info.value) and "cpu" in str(info.value)
