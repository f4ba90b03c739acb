"""Small valid inputs for every public op, shared by the validation and torch.compile tests."""

from __future__ import annotations

from typing import Any

import torch

import nsa_backend as nb

FP8 = torch.float8_e4m3fn


def ragged_logits_args(S: int = 3, H: int = 4, D: int = 64, N: int = 10) -> dict[str, Any]:
    return dict(
        q=torch.randn(S, H, D).to(FP8),
        kv=(torch.randn(N, D).to(FP8), torch.rand(N) + 0.5),
        weights=torch.randn(S, H),
        cu_seq_len_k_start=torch.zeros(S, dtype=torch.int32),
        cu_seq_len_k_end=torch.full((S,), N, dtype=torch.int32),
    )


def paged_logits_args(B: int = 2, next_n: int = 2, H: int = 4, D: int = 64, block_kv: int = 64,
                      pages: int = 3) -> dict[str, Any]:
    k = torch.randn(pages * block_kv, D)
    cache = nb.pack_indexer_k_cache(k, block_kv, impl="reference")
    ctx = torch.tensor([70, 5][:B] + [1] * max(0, B - 2), dtype=torch.int32)
    return dict(
        q=torch.randn(B, next_n, H, D).to(FP8),
        kv_cache=cache,
        weights=torch.randn(B * next_n, H),
        context_lens=ctx,
        block_table=torch.arange(B * 2, dtype=torch.int32).view(B, 2) % pages,
        schedule_meta=nb.get_paged_mqa_logits_metadata(ctx, block_kv, 4, impl="reference"),
        max_context_len=80,
    )


def topk_args(R: int = 3, N: int = 20, topk: int = 4) -> dict[str, Any]:
    return dict(logits=torch.randn(R, N), topk=topk)


def l2g_args() -> dict[str, Any]:
    return dict(
        indices=torch.tensor([[0, 5, -1], [64, 3, 100]], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [1, 3]], dtype=torch.int32),
        req_ids=torch.tensor([0, 1], dtype=torch.int32),
        page_size=64,
    )


def prefill_args(s_q: int = 2, h_q: int = 2, d_qk: int = 576, s_kv: int = 12, topk: int = 4) -> dict[str, Any]:
    return dict(
        q=torch.randn(s_q, h_q, d_qk).bfloat16(),
        kv=torch.randn(s_kv, 1, d_qk).bfloat16(),
        indices=torch.randint(0, s_kv, (s_q, 1, topk), dtype=torch.int32),
        sm_scale=d_qk ** -0.5,
    )


def decode_args(B: int = 2, s_q: int = 1, h_q: int = 2, topk: int = 4, kv_format: str = "fp8_ds_mla",
                num_blocks: int = 2, page: int = 64) -> dict[str, Any]:
    d_qk = 512 if kv_format == "fp8_ds_mla_v4" else 576
    if kv_format == "fp8_ds_mla_v4":
        cache = nb.pack_fp8_ds_mla_v4(torch.randn(num_blocks * page, d_qk).bfloat16(), impl="reference")
        # one token per packed row -> block-split pages: every page's data rows, then its scale rows
        rows = cache.view(num_blocks, page, 584)
        cache = torch.cat([rows[:, :, :576].reshape(num_blocks, -1), rows[:, :, 576:].reshape(num_blocks, -1)], 1)
        cache = cache.view(num_blocks, page, 1, 584)
    elif kv_format == "fp8_ds_mla":
        cache = nb.pack_fp8_ds_mla(torch.randn(num_blocks * page, d_qk).bfloat16(), impl="reference")
        cache = cache.view(num_blocks, page, 1, 656)
    else:
        cache = torch.randn(num_blocks, page, 1, d_qk).bfloat16()
    return dict(
        q=torch.randn(B, s_q, h_q, d_qk).bfloat16(),
        kv_cache=cache,
        indices=torch.randint(0, num_blocks * page, (B, s_q, topk), dtype=torch.int32),
        sm_scale=d_qk ** -0.5,
        kv_format=kv_format,
        topk_length=torch.randint(0, topk + 1, (B,), dtype=torch.int32),
    )


def hc_args(M: int = 4, N: int = 8, K: int = 128, splits: int | None = None) -> dict[str, Any]:
    d = torch.empty(M, N) if splits is None else torch.empty(splits, M, N)
    s = torch.empty(M) if splits is None else torch.empty(splits, M)
    return dict(a=torch.randn(M, K).bfloat16(), b=torch.randn(N, K), d=d, sqr_sum=s, num_splits=splits)


def write_cache_args(T: int = 3, num_blocks: int = 2, page: int = 64) -> dict[str, Any]:
    return dict(
        kv=torch.randn(T, 576).bfloat16(),
        kv_cache=torch.zeros(num_blocks, page, 656, dtype=torch.uint8),
        slot_mapping=torch.tensor([0, 65, -1][:T], dtype=torch.int64),
    )
