"""The DSA pipeline (metadata -> indexer -> top-k -> sparse MLA) against a dense per-token oracle.

The oracle never touches the paged layouts or the pipeline's metadata: it keeps every request's
keys as plain tensors, scores each query token against its causal prefix, takes the top-k
positions and runs softmax attention over exactly those keys.
"""

from __future__ import annotations

import pytest
import torch

import nsa_backend as nb

FP8 = torch.float8_e4m3fn
PAGE = 64
H, D = 4, 64  # indexer heads / head dim
HQ, DQK, DV = 2, 576, 512


def _make_batch(q_lens, seq_lens, num_decode, topk, kv_format, device="cpu"):
    g = torch.Generator().manual_seed(7)
    B = len(seq_lens)
    pages_per_req = [(L + PAGE - 1) // PAGE for L in seq_lens]
    num_blocks = sum(pages_per_req) + 2
    perm = torch.randperm(num_blocks, generator=g)  # scattered pages
    block_table = torch.full((B, max(pages_per_req)), -1, dtype=torch.int32)
    used = 0
    for r, n in enumerate(pages_per_req):
        block_table[r, :n] = perm[used:used + n].int()
        used += n
    # Per-request plain keys (what the oracle uses) and the paged caches built from them.
    idx_keys = [torch.randn(L, D, generator=g) for L in seq_lens]
    lat_keys = [torch.randn(L, DQK, generator=g).bfloat16() for L in seq_lens]
    index_cache = torch.zeros(num_blocks, PAGE, 1, D + 4, dtype=torch.uint8)
    if kv_format == "fp8_ds_mla":
        kv_cache = torch.zeros(num_blocks, PAGE, 656, dtype=torch.uint8)
    else:
        kv_cache = torch.zeros(num_blocks, PAGE, 1, DQK, dtype=torch.bfloat16)
    for r, L in enumerate(seq_lens):
        packed = nb.pack_indexer_k_cache(idx_keys[r], PAGE)  # [pages, PAGE, 1, D+4] in request order
        for p in range(pages_per_req[r]):
            index_cache[block_table[r, p]] = packed[p]
        slots = torch.tensor([int(block_table[r, t // PAGE]) * PAGE + t % PAGE for t in range(L)])
        if kv_format == "fp8_ds_mla":
            nb.write_fp8_ds_mla_cache(lat_keys[r], kv_cache, slots)
        else:
            kv_cache.view(-1, DQK)[slots] = lat_keys[r]
    T = sum(q_lens)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slot_mapping = torch.cat([torch.tensor([int(block_table[r, t // PAGE]) * PAGE + t % PAGE
                                            for t in range(seq_lens[r] - q_lens[r], seq_lens[r])])
                              for r in range(B)])
    md = nb.build_sparse_attn_metadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), block_table.to(device),
                                       slot_mapping.to(device), PAGE, num_decode)
    q_idx = torch.randn(T, H, D, generator=g).to(FP8)
    w = torch.randn(T, H, generator=g)
    q = torch.randn(T, HQ, DQK, generator=g).bfloat16()
    return md, dict(block_table=block_table, idx_keys=idx_keys, lat_keys=lat_keys, index_cache=index_cache.to(device),
                    kv_cache=kv_cache.to(device), q_idx=q_idx.to(device), w=w.to(device), q=q.to(device), qsl=qsl)


def _oracle(q_lens, seq_lens, b, topk, kv_format, sm_scale):
    """Per token: dense scores over its causal prefix -> top-k positions -> attention."""
    outs, chosen = [], []
    t = 0
    for r, (n, L) in enumerate(zip(q_lens, seq_lens)):
        k = b["idx_keys"][r]
        scale = k.abs().amax(-1).clamp(min=1e-4) / 448
        k8 = (k / scale[:, None]).to(FP8).float()
        lat = b["lat_keys"][r]
        if kv_format == "fp8_ds_mla":
            lat = nb.unpack_fp8_ds_mla(nb.pack_fp8_ds_mla(lat))
        for j in range(n):
            pos = L - n + j
            qf = b["q_idx"][t].cpu().float()  # [H, D]
            s = ((qf @ k8[: pos + 1].T).relu() * b["w"][t].cpu()[:, None]).sum(0) * scale[: pos + 1]
            top = torch.topk(s, min(topk, pos + 1)).indices
            chosen.append({int(b["block_table"][r, p // PAGE]) * PAGE + p % PAGE for p in top.tolist()})
            kk = lat[top].float()  # [k, DQK]
            p_ = (b["q"][t].cpu().float() @ kk.T) * sm_scale  # [HQ, k]
            outs.append(torch.softmax(p_, -1) @ kk[:, :DV])
            t += 1
    return torch.stack(outs), chosen


CASES = [
    pytest.param([1, 1, 1], [5, 70, 130], 3, "fp8_ds_mla", id="decode-only"),
    pytest.param([2, 2, 7, 3], [9, 66, 7, 140], 2, "fp8_ds_mla", id="mtp2-decode+prefill"),
    pytest.param([5, 12], [5, 80], 0, "bf16", id="prefill-only-bf16"),
    pytest.param([3, 4], [40, 4], 1, "bf16", id="mtp3-decode+prefill-bf16"),
]


def _check(q_lens, seq_lens, num_decode, kv_format, device, impl):
    topk = 16
    sm_scale = DQK ** -0.5
    md, b = _make_batch(q_lens, seq_lens, num_decode, topk, kv_format, device)
    sel = nb.dsa_topk(md, b["q_idx"], b["w"], b["index_cache"], topk, impl=impl)
    out = nb.dsa_sparse_attention(md, b["q"], b["kv_cache"], sel, sm_scale, kv_format=kv_format, impl=impl)
    want_out, want_sets = _oracle(q_lens, seq_lens, b, topk, kv_format, sm_scale)
    for t, want in enumerate(want_sets):
        got = {s for s in sel.global_slots[t].tolist() if s >= 0}
        assert got == want, f"token {t}: selected slots differ"
        assert (sel.global_slots[t] == -1).sum() == topk - len(want)
    torch.testing.assert_close(out.float().cpu(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("q_lens,seq_lens,num_decode,kv_format", CASES)
def test_pipeline_matches_dense_oracle(q_lens, seq_lens, num_decode, kv_format):
    _check(q_lens, seq_lens, num_decode, kv_format, "cpu", "reference")


@pytest.mark.gpu
@pytest.mark.parametrize("q_lens,seq_lens,num_decode,kv_format", CASES)
def test_pipeline_on_gpu_routes_matches_dense_oracle(q_lens, seq_lens, num_decode, kv_format):
    """impl="auto" on the GPU: the routed kernels (Triton or native) give the oracle's selection and output."""
    _check(q_lens, seq_lens, num_decode, kv_format, "cuda", "auto")


def test_metadata_rejects_ragged_decode():
    with pytest.raises(ValueError, match="same number of query tokens"):
        nb.build_sparse_attn_metadata(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([4, 5]),
                                      torch.zeros(2, 1, dtype=torch.int32), torch.zeros(3), 64, 2)


def test_metadata_fields():
    qsl = torch.tensor([0, 2, 4, 7], dtype=torch.int32)
    md = nb.build_sparse_attn_metadata(qsl, torch.tensor([10, 3, 65], dtype=torch.int32),
                                       torch.tensor([[0, -1], [1, -1], [2, 3]], dtype=torch.int32),
                                       torch.arange(7), 64, num_decode_reqs=2)
    assert md.decode.next_n == 2 and md.decode.num_reqs == 2
    assert md.decode.context_lens.tolist() == [[9, 10], [2, 3]]
    assert md.decode.req_ids.tolist() == [0, 0, 1, 1]
    pre = md.prefill
    assert (pre.token_start, pre.num_tokens) == (4, 3)
    assert pre.cu_seq_len_k_start.tolist() == [0, 0, 0]
    assert pre.cu_seq_len_k_end.tolist() == [63, 64, 65]
    assert pre.key_slots.tolist() == [2 * 64 + t for t in range(64)] + [3 * 64]


def _per_token_metadata(q_lens, seq_lens, num_decode, b):
    """The batch with its decode tokens one per row (``next_n = 1``, rows of the whole block table),
    the form used when decode query lengths differ; built with the device-side helpers."""
    from nsa_backend.metadata import build_decode_batch, build_prefill_batch, token_request_ids

    qsl, lens = b["qsl"], torch.tensor(seq_lens, dtype=torch.int32)
    T = sum(q_lens)
    req_ids = token_request_ids(qsl, T)
    num_dec_tokens = sum(q_lens[:num_decode])
    md = nb.SparseAttnMetadata(page_size=PAGE, num_tokens=T, slot_mapping=torch.full((T,), -1))
    if num_decode:
        md.decode = build_decode_batch(qsl, lens, b["block_table"], req_ids[:num_dec_tokens], max(seq_lens))
    if num_decode < len(q_lens):
        md.prefill = build_prefill_batch(qsl, lens, b["block_table"], req_ids[num_dec_tokens:], PAGE,
                                         num_decode, num_dec_tokens, sum(seq_lens[num_decode:]))
    return md


@pytest.mark.parametrize("q_lens,seq_lens,num_decode,kv_format", [
    pytest.param([1, 3, 2, 7], [20, 70, 129, 9], 3, "fp8_ds_mla", id="ragged-decode+prefill"),
    pytest.param([2, 1], [66, 140], 2, "bf16", id="ragged-decode-only-bf16"),
])
def test_pipeline_per_token_decode_rows(q_lens, seq_lens, num_decode, kv_format):
    # Shapes chosen so that no token's k-th and (k+1)-th scores tie (top-k ties are free).
    topk = 16
    sm_scale = DQK ** -0.5
    _, b = _make_batch(q_lens, seq_lens, 0, topk, kv_format)
    md = _per_token_metadata(q_lens, seq_lens, num_decode, b)
    assert md.decode.next_n == 1 and md.decode.num_reqs == sum(q_lens[:num_decode])
    sel = nb.dsa_topk(md, b["q_idx"], b["w"], b["index_cache"], topk, impl="reference")
    out = nb.dsa_sparse_attention(md, b["q"], b["kv_cache"], sel, sm_scale, kv_format=kv_format,
                                  impl="reference")
    want_out, want_sets = _oracle(q_lens, seq_lens, b, topk, kv_format, sm_scale)
    for t, want in enumerate(want_sets):
        got = {s for s in sel.global_slots[t].tolist() if s >= 0}
        assert got == want, f"token {t}: selected slots differ"
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kv_format", ["fp8_ds_mla", "bf16"])
def test_prefill_reads_selected_cache_rows(kv_format):
    """Without prefill key-buffer positions, prefill tokens read their selected slots from the cache."""
    q_lens, seq_lens, topk = [2, 7, 3], [9, 7, 140], 16
    sm_scale = DQK ** -0.5
    md, b = _make_batch(q_lens, seq_lens, 1, topk, kv_format)
    sel = nb.dsa_topk(md, b["q_idx"], b["w"], b["index_cache"], topk, impl="reference")
    direct = nb.TopkSelection(global_slots=sel.global_slots, prefill_keys=None)
    out = nb.dsa_sparse_attention(md, b["q"], b["kv_cache"], direct, sm_scale, kv_format=kv_format,
                                  impl="reference")
    want_out, _ = _oracle(q_lens, seq_lens, b, topk, kv_format, sm_scale)
    torch.testing.assert_close(out.float(), want_out, atol=2e-2, rtol=2e-2)


def test_metadata_helpers_match_host_builder():
    """The device-side helpers give the fields build_sparse_attn_metadata documents."""
    from nsa_backend.metadata import build_decode_batch, token_request_ids

    qsl = torch.tensor([0, 1, 4, 6, 6], dtype=torch.int32)  # a zero-length (padding) request last
    assert token_request_ids(qsl, 8).tolist() == [0, 1, 1, 1, 2, 2, 3, 3]
    buf = torch.full((10,), 7, dtype=torch.int32)
    out = token_request_ids(qsl, 6, out=buf)
    assert out.data_ptr() == buf.data_ptr() and buf.tolist() == [0, 1, 1, 1, 2, 2, 7, 7, 7, 7]
    lens = torch.tensor([5, 12, 4, 0], dtype=torch.int32)
    table = torch.arange(8, dtype=torch.int32).view(4, 2)
    dec = build_decode_batch(qsl, lens, table, out[:4], max_context_len=12)
    assert dec.context_lens.tolist() == [[5], [10], [11], [12]]
    assert dec.row_block_table().tolist() == [[0, 1], [2, 3], [2, 3], [2, 3]]
    with pytest.raises(ValueError, match="next_n"):
        build_decode_batch(qsl, lens, table, out[:4], max_context_len=12, next_n=3)


def test_prefill_positions_in_compressed_logits():
    """Per-row logit windows (``max_seqlen_k``) choose the same positions as full-width logits."""
    from nsa_backend.dsa import prefill_topk_positions

    q_lens, seq_lens, topk = [2, 2, 7, 3], [9, 66, 7, 140], 16
    md, b = _make_batch(q_lens, seq_lens, 2, topk, "fp8_ds_mla")
    pre = md.prefill
    full = prefill_topk_positions(pre, b["q_idx"], b["w"], b["index_cache"], topk, impl="reference")
    windowed = prefill_topk_positions(pre, b["q_idx"], b["w"], b["index_cache"], topk, max_seqlen_k=140,
                                      impl="reference")
    _, want_sets = _oracle(q_lens, seq_lens, b, topk, "fp8_ds_mla", DQK ** -0.5)
    t0 = pre.token_start
    for i in range(pre.num_tokens):
        r = 2 if i < 7 else 3
        want = {p for p in range(seq_lens[r])
                if int(b["block_table"][r, p // PAGE]) * PAGE + p % PAGE in want_sets[t0 + i]}
        assert {p for p in full[i].tolist() if p >= 0} == want, f"prefill token {i}"
        assert {p for p in windowed[i].tolist() if p >= 0} == want, f"prefill token {i} (windowed)"


def test_scores_ranked_in_logits_dtype():
    from nsa_backend.dsa import in_logits_dtype

    logits = torch.tensor([[1.0, 1.0 + 2.0**-10, float("-inf")]])
    assert torch.equal(in_logits_dtype(logits, torch.float32), logits)
    rounded = in_logits_dtype(logits, torch.bfloat16)
    assert rounded.dtype == torch.float32 and rounded[0, 0] == rounded[0, 1] and rounded[0, 2] == float("-inf")
    with pytest.raises(ValueError, match="logits_dtype"):
        in_logits_dtype(logits, torch.float16)
