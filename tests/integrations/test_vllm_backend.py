"""vLLM integration, attention side: metadata builder on vLLM's CommonAttentionMetadata and the
sparse-MLA impl's ``forward_mqa`` on the CPU (nsa-backend reference ops).

Reference for the impl: attention written out in this file in float64 over keys decoded here from
the cache bytes (fp8 values times their block scale, bf16 rope), independent of nsa-backend.
"""

from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402

import nsa_backend  # noqa: E402
from nsa_backend_integrations.vllm.backend import (  # noqa: E402
    NsaSparseMLABackend,
    NsaSparseMLAImpl,
    NsaSparseMLAMetadataBuilder,
)
from nsa_backend_integrations.vllm.metadata import NsaSparseMLAMetadata  # noqa: E402
from tests.integrations import vllm_fixtures as vf  # noqa: E402

PAGE = 64
TOPK = 2048
NUM_HEADS = 4
D_QK, D_V = 576, 512

@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    vf.cpu_platform()
    # GLM-5-shaped: DeepSeek-V3.2's DSA fields with GLM-5's architecture and head dimensions.
    config = vf.dsa_model_config(
        architectures=["GlmMoeDsaForCausalLM"],
        model_type="glm_moe_dsa",
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_HEADS,
        qk_nope_head_dim=192,
        v_head_dim=256,
        index_topk=TOPK,
        index_n_heads=32,
    )
    return vf.vllm_config(vf.model_dir(tmp_path_factory, "glm5", config), block_size=PAGE)


@pytest.fixture(scope="module")
def builder(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    spec = MLAAttentionSpec(
        block_size=PAGE, num_kv_heads=1, head_size=D_QK, dtype=torch.uint8, cache_dtype_str="fp8_ds_mla"
    )
    with set_current_vllm_config(vllm_config):
        return NsaSparseMLABackend.get_builder_cls()(
            spec, ["model.layers.0.self_attn.attn"], vllm_config, torch.device("cpu")
        )


def common_metadata(
    query_lens: list[int], context_lens: list[int], blocks_per_req: int = 4, seed: int = 0
) -> CommonAttentionMetadata:
    """vLLM's CommonAttentionMetadata for requests with these new-token and cached-token counts."""
    gen = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([q + c for q, c in zip(query_lens, context_lens)], dtype=torch.int32)
    block_table = torch.randperm(64, generator=gen)[: num_reqs * blocks_per_req].view(num_reqs, -1).int()
    tokens = int(qsl[-1])
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=seq_lens,
        num_reqs=num_reqs,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table,
        slot_mapping=torch.arange(tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq_lens.clone(),
    )


# ---------------------------------------------------------------------------------------------
# Metadata builder
# ---------------------------------------------------------------------------------------------


def test_builder_declares_cudagraph_support(builder, vllm_config):
    assert (
        builder.get_cudagraph_support(vllm_config, builder.kv_cache_spec) is AttentionCGSupport.UNIFORM_BATCH
    )
    assert builder.reorder_batch_threshold == 1
    assert builder.topk_tokens == TOPK and builder.block_size == PAGE


@pytest.mark.parametrize(
    "query_lens, context_lens, split",
    [
        ([7, 3], [0, 5], (0, 2, 0, 10)),  # prefill only (one fresh, one chunked)
        ([1, 1, 1], [9, 130, 64], (3, 0, 3, 0)),  # decode only
        ([1, 1, 5, 2], [40, 7, 0, 90], (2, 2, 2, 7)),  # mixed: decodes first, as vLLM orders them
    ],
    ids=["prefill", "decode", "mixed"],
)
def test_builder_consumes_common_attention_metadata(builder, query_lens, context_lens, split):
    cm = common_metadata(query_lens, context_lens)
    md = builder.build(common_prefix_len=0, common_attn_metadata=cm)
    assert isinstance(md, NsaSparseMLAMetadata)
    assert (md.num_decodes, md.num_prefills, md.num_decode_tokens, md.num_prefill_tokens) == split
    assert md.num_actual_tokens == sum(query_lens) and md.num_reqs == len(query_lens)
    expected_req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    assert torch.equal(md.req_id_per_token.long(), expected_req)
    assert md.block_table is cm.block_table_tensor and md.seq_lens is cm.seq_lens
    assert md.query_start_loc is cm.query_start_loc and md.slot_mapping is cm.slot_mapping
    assert md.block_size == PAGE and md.topk_tokens == TOPK
    assert md.prefill is None and md.decode is None  # vLLM then runs every token through forward_mqa
    num_decodes = split[0]
    assert md.decode_max_query_len == (max(query_lens[:num_decodes]) if num_decodes else 0)
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    assert md.prefill_max_seq_len == (max(seq[num_decodes:]) if split[1] else 0)


def expected_visible(query_lens: list[int], seq_lens: list[int]) -> list[int]:
    """Keys each token may see (causal, its own included), written out per request."""
    return [L - n + j + 1 for n, L in zip(query_lens, seq_lens) for j in range(n)]


@pytest.mark.parametrize(
    "query_lens, context_lens, threshold",
    [
        ([7, 3], [0, 5], 1),
        ([1, 1, 1], [9, 130, 64], 1),
        ([1, 1, 5, 2], [40, 7, 0, 90], 1),
        ([2, 1, 3, 9], [40, 70, 5, 60], 3),  # speculative decodes of different lengths, then a prefill
    ],
    ids=["prefill", "decode", "mixed", "ragged-decodes"],
)
def test_builder_core_metadata(builder, monkeypatch, query_lens, context_lens, threshold):
    """``md.core`` is nsa-backend's SparseAttnMetadata of the batch, checked field by field."""
    from nsa_backend.metadata import SparseAttnMetadata

    monkeypatch.setattr(builder, "reorder_batch_threshold", threshold)
    cm = common_metadata(query_lens, context_lens)
    md = builder.build(0, cm)
    core = md.core
    assert isinstance(core, SparseAttnMetadata)
    assert core.page_size == PAGE and core.num_tokens == sum(query_lens)
    assert torch.equal(core.slot_mapping, cm.slot_mapping)
    seq = [q + c for q, c in zip(query_lens, context_lens)]
    visible = expected_visible(query_lens, seq)
    req = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens)).tolist()
    num_dec_tokens = md.num_decode_tokens
    if md.num_decodes:
        dec = core.decode
        assert (dec.num_reqs, dec.next_n) == (num_dec_tokens, 1)  # one row per decode token
        assert dec.context_lens.tolist() == [[v] for v in visible[:num_dec_tokens]]
        assert dec.req_ids.tolist() == req[:num_dec_tokens]
        assert dec.block_table is cm.block_table_tensor and dec.max_context_len == cm.max_seq_len
        want_rows = cm.block_table_tensor[req[:num_dec_tokens]]
        assert torch.equal(dec.row_block_table(), want_rows)
    else:
        assert core.decode is None
    if md.num_prefills:
        pre = core.prefill
        assert (pre.token_start, pre.num_tokens) == (num_dec_tokens, md.num_prefill_tokens)
        table = cm.block_table_tensor.tolist()
        slots, starts, ends, offset = [], [], [], 0
        for r in range(md.num_decodes, len(query_lens)):
            slots += [table[r][p // PAGE] * PAGE + p % PAGE for p in range(seq[r])]
            t0 = sum(query_lens[:r])
            starts += [offset] * query_lens[r]
            ends += [offset + visible[t0 + j] for j in range(query_lens[r])]
            offset += seq[r]
        assert pre.key_slots.tolist() == slots
        assert pre.cu_seq_len_k_start.tolist() == starts and pre.cu_seq_len_k_end.tolist() == ends
    else:
        assert core.prefill is None


def test_builder_core_decode_tensors_are_persistent(builder):
    """Decode batches replay CUDA graphs: the core tensors the impl reads keep their addresses."""
    first = builder.build(0, common_metadata([1, 1], [3, 4]))
    second = builder.build(0, common_metadata([1, 1, 1], [30, 4, 5], seed=3))
    assert first.core.decode.context_lens.data_ptr() == second.core.decode.context_lens.data_ptr()
    assert first.core.decode.req_ids.data_ptr() == second.core.decode.req_ids.data_ptr()
    assert second.core.decode.context_lens.view(-1).tolist() == [31, 5, 6]


def test_builder_checks_configured_implementations(builder, vllm_config, monkeypatch):
    """A forced decode implementation that cannot run here fails when the builder is made."""
    from vllm.config import set_current_vllm_config

    from nsa_backend.routing import ImplChoiceError, use_config

    monkeypatch.delenv("NSA_BACKEND_CONFIG", raising=False)
    monkeypatch.setenv("NSA_BACKEND_DECODE", "flash_mla")
    use_config()
    try:
        with set_current_vllm_config(vllm_config), pytest.raises(ImplChoiceError, match="flashmla_kv"):
            NsaSparseMLAMetadataBuilder(builder.kv_cache_spec, ["layer"], vllm_config, torch.device("cpu"))
        monkeypatch.setenv("NSA_BACKEND_DECODE", "reference")
        use_config()
        with set_current_vllm_config(vllm_config):
            NsaSparseMLAMetadataBuilder(builder.kv_cache_spec, ["layer"], vllm_config, torch.device("cpu"))
    finally:
        monkeypatch.delenv("NSA_BACKEND_DECODE")
        use_config()


def test_builder_reuses_request_id_buffer(builder):
    first = builder.build(0, common_metadata([1, 1], [3, 4]))
    second = builder.build(0, common_metadata([2, 1, 1], [3, 4, 5]))
    assert first.req_id_per_token.data_ptr() == second.req_id_per_token.data_ptr()  # stable for CUDA graphs


# ---------------------------------------------------------------------------------------------
# Impl forward_mqa
# ---------------------------------------------------------------------------------------------


def decode_fp8_rows(raw: torch.Tensor) -> torch.Tensor:
    """fp8_ds_mla bytes ``[N, 656]`` -> float64 ``[N, 576]``, written out independently."""
    nope = raw[:, :512].contiguous().view(torch.float8_e4m3fn).double()
    scales = raw[:, 512:528].contiguous().view(torch.float32).double()  # [N, 4]
    rope = raw[:, 528:656].contiguous().view(torch.bfloat16).double()
    return torch.cat([nope * scales.repeat_interleave(128, dim=1), rope], dim=1)


def expected_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    positions: torch.Tensor,
    req: torch.Tensor,
    block_table: torch.Tensor,
    stride_rows: int,
    scale: float,
) -> torch.Tensor:
    """Per token: softmax over its selected positions of its request, float64."""
    out = torch.zeros(q.shape[0], q.shape[1], D_V, dtype=torch.float64)
    for t in range(q.shape[0]):
        pos = positions[t][positions[t] >= 0].long()
        if pos.numel() == 0:
            continue
        rows = block_table[req[t], pos // PAGE].long() * stride_rows + pos % PAGE
        k = keys[rows]  # [n, 576]
        p = (q[t].double() @ k.T) * scale  # [H, n]
        out[t] = torch.softmax(p, dim=-1) @ k[:, :D_V]
    return out


def impl_args(**overrides) -> dict:
    """The attention-layer arguments vLLM passes to every impl, for an fp8_ds_mla layer of this model."""
    args = dict(
        num_heads=NUM_HEADS,
        head_size=D_QK,
        scale=0.1,
        num_kv_heads=1,
        alibi_slopes=None,
        sliding_window=None,
        kv_cache_dtype="fp8_ds_mla",
        logits_soft_cap=None,
        attn_type="decoder",
        kv_sharing_target_layer_name=None,
    )
    return {**args, **overrides}


@pytest.mark.parametrize(
    "kv_cache_dtype, spaced, threshold",
    [
        ("fp8_ds_mla", False, 1),
        ("fp8_ds_mla", True, 1),
        ("bfloat16", False, 1),
        ("bfloat16", True, 1),
        ("fp8_ds_mla", True, 2),
        ("bfloat16", False, 2),
    ],
    ids=[
        "fp8-contiguous",
        "fp8-spaced-blocks",
        "bf16-contiguous",
        "bf16-spaced-blocks",
        "fp8-spaced-spec-decodes",
        "bf16-spec-decodes",
    ],
)
def test_impl_forward_matches_independent_attention(
    builder, vllm_config, monkeypatch, kv_cache_dtype, spaced, threshold
):
    from vllm.config import set_current_vllm_config

    torch.manual_seed(0)
    # threshold 1: one decode, three prefills; threshold 2: two decodes of 1 and 2 tokens, two prefills.
    monkeypatch.setattr(builder, "reorder_batch_threshold", threshold)
    query_lens, context_lens = [1, 2, 6, 3], [150, 70, 0, 200]
    cm = common_metadata(query_lens, context_lens, blocks_per_req=4, seed=1)
    md = builder.build(0, cm)
    assert md.num_decodes == threshold
    num_tokens = md.num_actual_tokens
    seq_lens = cm.seq_lens.tolist()

    # The cache: 64 blocks of 64 tokens; "spaced" puts another layer's page between blocks.
    num_blocks, stride_rows = 64, PAGE * (2 if spaced else 1)
    rows_bf16 = (torch.randn(num_blocks * stride_rows, D_QK) * 0.5).to(torch.bfloat16)
    if kv_cache_dtype == "fp8_ds_mla":
        packed = nsa_backend.pack_fp8_ds_mla(rows_bf16, "arbitrary", impl="reference")
        storage, keys = packed, decode_fp8_rows(packed)
    else:
        storage, keys = rows_bf16, rows_bf16.double()
    kv_cache = storage.view(num_blocks, stride_rows, -1)[
        :, :PAGE
    ]  # [num_blocks, 64, width], stride(0) spaced

    # Indexer output: per-token positions inside its request, causal, -1 padded, some rows short.
    req = md.req_id_per_token.long()
    buffer = torch.full((64, TOPK), -1, dtype=torch.int32)
    qsl = cm.query_start_loc.tolist()
    for t in range(num_tokens):
        r = int(req[t])
        visible = seq_lens[r] - (qsl[r + 1] - t) + 1  # causal: its own position included
        count = min(visible, 40 if t % 2 else 2000)
        buffer[t, :count] = torch.randperm(visible)[:count].int()

    with set_current_vllm_config(vllm_config):
        impl = NsaSparseMLABackend.get_impl_cls()(
            **impl_args(scale=0.07, kv_cache_dtype=kv_cache_dtype),
            q_lora_rank=128,
            kv_lora_rank=512,
            qk_nope_head_dim=192,
            qk_rope_head_dim=64,
            qk_head_dim=256,
            v_head_dim=256,
            kv_b_proj=None,
            indexer=None,
            topk_indices_buffer=buffer,
        )
    assert isinstance(impl, NsaSparseMLAImpl) and impl.is_sparse and not impl.supports_dense_mha_prefill
    q = (torch.randn(num_tokens, NUM_HEADS, D_QK) * 0.5).to(torch.bfloat16)
    out, lse = impl.forward_mqa((q[..., :512], q[..., 512:]), kv_cache, md, layer=None)

    assert lse is None
    assert out.shape == (num_tokens, NUM_HEADS, D_V) and out.dtype == torch.bfloat16
    ref = expected_attention(q, keys, buffer[:num_tokens], req, cm.block_table_tensor, stride_rows, 0.07)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_impl_writes_cache_rows_on_cpu(vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        impl = NsaSparseMLAImpl(**impl_args(), topk_indices_buffer=torch.empty(0, dtype=torch.int32))
        kv_c = torch.randn(5, 512).to(torch.bfloat16)
        k_pe = torch.randn(5, 1, 64).to(torch.bfloat16)
        cache = torch.zeros(4, PAGE, 656, dtype=torch.uint8)
        slots = torch.tensor([3, 64, -1, 200, 255])
        impl.do_kv_cache_update(kv_c, k_pe, cache, slots, "fp8_ds_mla", torch.ones(()))
    flat = cache.view(-1, 656)
    rows = torch.cat([kv_c, k_pe.squeeze(1)], dim=1).double()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            torch.testing.assert_close(decode_fp8_rows(flat[s : s + 1])[0], rows[i], atol=0.07, rtol=0.07)
    assert flat[[0, 1, 2, 4]].count_nonzero() == 0


def test_impl_rejects_unsupported_layers(vllm_config):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        with pytest.raises(NotImplementedError, match="sliding_window"):
            NsaSparseMLAImpl(**impl_args(sliding_window=128))
        with pytest.raises(NotImplementedError, match="kv_cache_dtype 'fp8'"):
            NsaSparseMLAImpl(**impl_args(kv_cache_dtype="fp8"))
