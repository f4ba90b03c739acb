"""nsa-backend's SGLang DSA backend on CPU against the real SGLang 0.5.23 metadata code.

The ``DSAMetadata`` objects are built by SGLang's own ``DeepseekSparseAttnBackend.init_forward_metadata``
for prefill (with a cached prefix), mixed, decode and MTP target-verify batches (a draft extend with
uneven accepted lengths is SGLang's prefill metadata with the page table expanded to one row per
token, as SGLang builds it for draft extends), and by its CUDA-graph capture / replay path
(``init_forward_metadata_out_graph``) for MTP target verify and draft extend v2; only its Triton helper
``seqlens_expand_triton`` is replaced by the same formula in torch and the DP / context-parallel
padding helpers by their single-GPU answer. References are written out here in plain torch
(FP8 cache decoding, top-k, softmax attention) and share no code with nsa-backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.layers.attention import dsa_backend as sgl_dsa
from sglang.srt.layers.attention.dsa import dsa_indexer
from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
from sglang.srt.layers.attention.dsa.paged_mqa_logits_backend import DSAPagedMQALogitsBackend
from sglang.srt.model_executor.forward_batch_info import ForwardMode

import nsa_backend
from nsa_backend_integrations.sglang import backend as backend_module
from nsa_backend_integrations.sglang import kernels
from nsa_backend_integrations.sglang.backend import NsaIndexerMetadata, NsaSparseAttnBackend
from nsa_backend_integrations.sglang.metadata import to_sparse_attn_metadata

PAGE = 64
TOPK = 16
HEADS = 4  # any head count: GLM-5 at TP=16 holds 4 heads per GPU
D_V, D_ROPE = 512, 64
D_QK = D_V + D_ROPE
DRAFT = 3  # MTP: 1 + 2 draft tokens verified per request
MAX_CTX = 192
NUM_PAGES = 12


# ---------------------------------------------------------------------------------------------
# Fixtures: a bare backend on SGLang's metadata code, a paged pool, forward batches
# ---------------------------------------------------------------------------------------------


def _seqlens_expand(extend_seq_lens, seq_lens, total_len, max_q_len):
    out = [
        torch.arange(kv - q + 1, kv + 1, dtype=torch.int32)
        for q, kv in zip(extend_seq_lens.tolist(), seq_lens.tolist())
    ]
    return torch.cat(out).clamp(min=0).to(seq_lens.device)


@pytest.fixture(autouse=True)
def _cpu_sglang(monkeypatch):
    monkeypatch.setattr(sgl_dsa, "seqlens_expand_triton", _seqlens_expand)
    monkeypatch.setattr(sgl_dsa, "pad_dsa_cache_seqlens", lambda forward_batch, seqlens: seqlens)
    monkeypatch.setattr(sgl_dsa, "can_dsa_prefill_cp_interleave", lambda forward_batch: False)
    from nsa_backend.routing import reset_config

    for var in ("NSA_BACKEND_PREFILL", "NSA_BACKEND_DECODE", "NSA_BACKEND_FORCE_ARCH", "NSA_BACKEND_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    reset_config()
    yield
    reset_config()


class Pool:
    """The parts of SGLang's DSATokenToKVPool / ReqToTokenPool the backend reads."""

    def __init__(self, fp8: bool, page_tables: list[list[int]]):
        self.page_size = PAGE
        self.size = NUM_PAGES * PAGE
        self.start_layer = 0
        self.dsa_kv_cache_store_fp8 = fp8
        self.dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        if fp8:
            self.kv_buffer = [torch.zeros(self.size + PAGE, 1, 656, dtype=torch.uint8)]
        else:
            self.kv_buffer = [torch.zeros(self.size + PAGE, 1, D_QK, dtype=torch.bfloat16)]
        req_to_token = torch.zeros(len(page_tables), MAX_CTX, dtype=torch.int32)
        for r, pages in enumerate(page_tables):
            pos = torch.arange(MAX_CTX)
            req_to_token[r] = torch.tensor(pages, dtype=torch.int32)[pos // PAGE] * PAGE + pos % PAGE
        self.req_to_token = req_to_token

    def get_key_buffer(self, layer_id):  # the pool hands out its storage viewed as its dtype
        return self.kv_buffer[layer_id].view(self.dtype)

    def set_mla_kv_buffer(self, layer, loc, k, k_rope):
        self.kv_buffer[layer.layer_id][loc.long(), 0] = torch.cat(
            [k.reshape(len(loc), -1), k_rope.reshape(len(loc), -1)], -1
        ).to(torch.bfloat16)


# Request r of the pool owns these (shuffled) pages.
PAGE_TABLES = [[7, 2, 9], [4, 11, 0], [5, 1, 8], [10, 3, 6]]


def make_backend(fp8: bool = True) -> NsaSparseAttnBackend:
    pool = Pool(fp8, PAGE_TABLES)
    b = object.__new__(NsaSparseAttnBackend)
    b.device = "cpu"
    b.dsa_kv_cache_store_fp8 = fp8
    b.dsa_index_topk = TOPK
    b.dsa_index_kpool = 1
    b.physical_page_size = PAGE
    b.speculative_num_draft_tokens = DRAFT
    b.req_to_token_pool = SimpleNamespace(req_to_token=pool.req_to_token, size=len(PAGE_TABLES))
    b.req_to_token = pool.req_to_token
    b.token_to_kv_pool = pool
    b._kv_shard_pool = None
    b.hisparse_coordinator = None
    b.dcp_size = 1
    b._arange_buf = torch.arange(1024, dtype=torch.int32)
    b.dsa_topk_backend = DSATopKBackend.TORCH
    b.configure(
        model_arch="GlmMoeDsaForCausalLM", kv_cache_dtype="fp8_e4m3" if fp8 else "bfloat16", device_arch="cpu"
    )
    return b


def make_batch(mode: str, req_ids: list[int], seq_lens: list[int], ext_lens: list[int], pool: Pool):
    """An SGLang ForwardBatch stand-in. ``seq_lens`` include this step's tokens (not the drafts)."""
    forward_mode = {
        "prefill": ForwardMode.EXTEND,
        "mixed": ForwardMode.MIXED,
        "decode": ForwardMode.DECODE,
        "verify": ForwardMode.TARGET_VERIFY,
        "draft_extend": ForwardMode.EXTEND,  # metadata built as an extend, then expanded (see build)
    }[mode]
    kv_lens = [s + (DRAFT if mode == "verify" else 0) for s in seq_lens]
    out_loc = torch.cat(
        [pool.req_to_token[r, kv - n : kv].long() for r, kv, n in zip(req_ids, kv_lens, ext_lens)]
    )
    fb = SimpleNamespace(
        forward_mode=forward_mode,
        batch_size=len(req_ids),
        req_pool_indices=torch.tensor(req_ids, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens),
        out_cache_loc=out_loc,
        global_num_tokens_cpu=None,
        attn_cp_metadata=None,
    )
    if mode in ("prefill", "mixed", "draft_extend"):
        fb.extend_seq_lens = torch.tensor(ext_lens, dtype=torch.int32)
        fb.extend_seq_lens_cpu = list(ext_lens)
        fb.extend_prefix_lens_cpu = [s - n for s, n in zip(seq_lens, ext_lens)]
    return fb


BATCHES = {
    # mode: (requests, seq lens incl. new tokens, new tokens per request)
    "prefill": ([1, 3], [70, 37], [30, 37]),  # request 1 has a 40-token cached prefix
    "mixed": ([1, 3], [70, 37], [1, 37]),  # mixed chunk: a decode token next to a prefill
    "decode": ([0, 2, 3], [130, 9, 64], [1, 1, 1]),
    "verify": ([2, 0], [100, 17], [DRAFT, DRAFT]),
    "draft_extend": ([2, 0], [100, 17], [2, 3]),  # uneven accepted draft lengths
}


def build(mode: str, fp8: bool = True):
    b = make_backend(fp8)
    reqs, lens, ext = BATCHES[mode]
    fb = make_batch(mode, reqs, lens, ext, b.token_to_kv_pool)
    b.init_forward_metadata(fb)  # SGLang's own metadata builder
    if mode == "draft_extend":
        # A draft extend: page tables expanded to one row per query token, one query row per token,
        # paged (slot) top-k; no ragged key buffer.
        md = b.forward_metadata
        rows = torch.tensor(ext)
        b.forward_metadata = dataclasses.replace(
            md,
            page_table_1=md.page_table_1.repeat_interleave(rows, dim=0),
            real_page_table=md.real_page_table.repeat_interleave(rows, dim=0),
            cu_seqlens_q=torch.arange(sum(ext) + 1, dtype=torch.int32),
            page_table_1_flattened=None,
            topk_indices_offset=None,
            indexer_k_start_end=None,
        )
        fb.forward_mode = ForwardMode.DRAFT_EXTEND_V2
    return b, fb


GRAPH_MODES = {"verify": ForwardMode.TARGET_VERIFY, "draft_extend_v2": ForwardMode.DRAFT_EXTEND_V2}


def build_graph(graph_mode: str, fp8: bool = True):
    """The ``"verify"`` batch through SGLang's CUDA-graph metadata path (``init_cuda_graph_state``,
    then ``init_forward_metadata_out_graph`` once to capture the batch size on placeholder
    requests, once more to replay it on the real ones), as SGLang's graph runners call it for MTP
    target verify and draft extend v2. Only CUDA-bound pieces are stubbed: the memory-saver
    region and the TRT-LLM counter buffer; ``is_cuda()`` is False on CPU, so SGLang takes its
    unfused replay branch and skips the DeepGEMM schedule."""
    b = make_backend(fp8)
    b._memory_saver_adapter = SimpleNamespace(region=lambda **kwargs: contextlib.nullcontext())
    b._multi_ctas_kv_counter_buffer = None
    b.experimental_kpool_metadata_fusion = False
    b.init_cuda_graph_state(len(PAGE_TABLES), len(PAGE_TABLES) * DRAFT)
    reqs, lens, ext = BATCHES["verify"]
    forward_mode = GRAPH_MODES[graph_mode]
    # Draft extend v2 replays with seq_lens that already count the draft tokens.
    extra = DRAFT if graph_mode == "draft_extend_v2" else 0
    capture = SimpleNamespace(
        forward_mode=forward_mode,
        batch_size=len(reqs),
        req_pool_indices=torch.zeros(len(reqs), dtype=torch.int64),
        seq_lens=torch.ones(len(reqs), dtype=torch.int64),
        spec_info=None,
    )
    b.init_forward_metadata_out_graph(capture, in_capture=True)
    captured = b.forward_metadata
    fb = make_batch("verify", reqs, lens, ext, b.token_to_kv_pool)
    fb.forward_mode = forward_mode
    fb.spec_info = None
    fb.seq_lens = fb.seq_lens + extra
    fb.seq_lens_cpu = fb.seq_lens_cpu + extra
    b.init_forward_metadata_out_graph(fb)
    assert b.forward_metadata is captured  # replay refills the captured buffers
    return b, fb


def keys_per_token(mode: str) -> list[tuple[int, int]]:
    """(request, visible keys) of every query token, causal."""
    reqs, lens, ext = BATCHES[mode]
    out = []
    for r, s, n in zip(reqs, lens, ext):
        kv = s + (DRAFT if mode == "verify" else 0)
        out += [(r, kv - n + j + 1) for j in range(n)]
    return out


# ---------------------------------------------------------------------------------------------
# Metadata adapter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefill", "decode", "verify"])
def test_adapter_on_sglang_metadata(mode):
    b, fb = build(mode)
    assert type(b.forward_metadata) is sgl_dsa.DSAMetadata
    md = to_sparse_attn_metadata(b.forward_metadata, mode, fb.out_cache_loc)
    tokens = keys_per_token(mode)
    pool = b.token_to_kv_pool
    reqs, lens, ext = BATCHES[mode]
    assert md.page_size == PAGE and md.num_tokens == len(tokens)
    assert torch.equal(md.slot_mapping, fb.out_cache_loc)
    if mode == "prefill":
        assert md.decode is None
        pre = md.prefill
        expect_slots = torch.cat([pool.req_to_token[r, :s].long() for r, s in zip(reqs, lens)])
        assert torch.equal(pre.key_slots, expect_slots)
        starts = [0, *list(torch.tensor(lens).cumsum(0)[:-1].tolist())]
        ks = [starts[i] for i, n in enumerate(ext) for _ in range(n)]
        ke = [k + visible for k, (_, visible) in zip(ks, tokens)]
        assert pre.cu_seq_len_k_start.tolist() == ks and pre.cu_seq_len_k_end.tolist() == ke
    else:
        assert md.prefill is None
        dec = md.decode
        n = ext[0]
        assert (dec.num_reqs, dec.next_n) == (len(reqs), n)
        assert dec.context_lens.tolist() == [
            [v for _, v in tokens[i * n : (i + 1) * n]] for i in range(len(reqs))
        ]
        assert dec.block_table[:, :2].tolist() == [PAGE_TABLES[r][:2] for r in reqs]
        assert dec.req_ids.tolist() == [i for i in range(len(reqs)) for _ in range(n)]


@pytest.mark.parametrize("graph_mode", list(GRAPH_MODES))
def test_adapter_on_sglang_graph_metadata(graph_mode):
    """CUDA-graph verify / draft-extend metadata lists one query length of 1 per token."""
    b, fb = build_graph(graph_mode)
    sgl_md = b.forward_metadata
    reqs, lens, _ = BATCHES["verify"]
    bs, n = len(reqs), DRAFT
    assert sgl_md.dsa_extend_seq_lens_list == [1] * (bs * n)
    assert sgl_md.cache_seqlens_int32.shape == (bs,)
    tokens = keys_per_token("verify")
    for md in (
        to_sparse_attn_metadata(sgl_md, "verify", fb.out_cache_loc),
        to_sparse_attn_metadata(b.get_indexer_metadata(0, fb), slot_mapping=fb.out_cache_loc),
        b.sparse_metadata(fb),
    ):
        assert md.prefill is None and md.num_tokens == bs * n
        assert torch.equal(md.slot_mapping, fb.out_cache_loc)
        dec = md.decode
        assert (dec.num_reqs, dec.next_n) == (bs, n)
        # row j of request r sees seq_len[r] - next_n + j + 1 keys (seq_len counting the drafts)
        assert dec.context_lens.tolist() == [[v for _, v in tokens[i * n : (i + 1) * n]] for i in range(bs)]
        assert dec.context_lens.tolist() == [[s + j + 1 for j in range(n)] for s in lens]
        assert dec.block_table[:, :2].tolist() == [PAGE_TABLES[r][:2] for r in reqs]
        assert dec.row_block_table()[:, :2].tolist() == [PAGE_TABLES[r][:2] for r in reqs]
        assert dec.req_ids.tolist() == [i for i in range(bs) for _ in range(n)]
        assert dec.max_context_len >= max(v for _, v in tokens)
    # Other batch kinds keep rejecting a per-token list.
    with pytest.raises(ValueError, match="query lengths"):
        to_sparse_attn_metadata(sgl_md, "prefill")


@pytest.mark.parametrize("mode", ["prefill", "mixed", "draft_extend"])
def test_adapter_token_rows(mode):
    """Batches other than even decode / verify ones, one decode row per query token."""
    b, fb = build(mode)
    sgl_mode = "verify" if mode == "draft_extend" else "prefill"
    md = to_sparse_attn_metadata(b.forward_metadata, sgl_mode, fb.out_cache_loc, token_rows=True)
    tokens = keys_per_token(mode)
    T = len(tokens)
    assert md.prefill is None and md.num_tokens == T
    dec = md.decode
    assert (dec.num_reqs, dec.next_n, dec.num_tokens) == (T, 1, T)
    assert dec.context_lens.tolist() == [[v] for _, v in tokens]
    assert dec.max_context_len >= max(v for _, v in tokens)
    table = dec.row_block_table()
    pages = table.shape[1]
    assert pages * PAGE >= max(v for _, v in tokens)
    assert table.tolist() == [PAGE_TABLES[r][:pages] for r, _ in tokens]
    if mode == "draft_extend":
        assert to_sparse_attn_metadata(b.forward_metadata, sgl_mode).prefill is not None
    # Even decode / verify batches keep one row per request.
    for even in ("decode", "verify"):
        b, fb = build(even)
        md = to_sparse_attn_metadata(b.forward_metadata, even, token_rows=True)
        assert md.decode.next_n == BATCHES[even][2][0] and md.decode.num_reqs == len(BATCHES[even][0])


def test_prefill_metadata_built_once_per_batch():
    b, fb = build("prefill")
    md = b.sparse_metadata(fb)
    assert b.sparse_metadata(fb) is md  # shared by the layers of one batch
    assert b.sparse_metadata(fb, token_rows=True).decode is not None
    # The next batch (a new metadata object, with other keys) gets its own.
    b.forward_metadata = dataclasses.replace(b.forward_metadata, page_table_1_flattened=None)
    other = b.sparse_metadata(fb)
    assert other is not md and torch.equal(other.prefill.key_slots, md.prefill.key_slots)


def test_adapter_accepts_indexer_and_nsa_names():
    b, fb = build("verify")
    direct = to_sparse_attn_metadata(b.forward_metadata, "verify")
    wrapped = to_sparse_attn_metadata(b.get_indexer_metadata(0, fb))  # DSAIndexerMetadata, mode guessed
    assert isinstance(b.get_indexer_metadata(0, fb), DSAIndexerMetadata)
    fields = {
        f.name.replace("dsa_", "nsa_", 1) if f.name.startswith("dsa_") else f.name: getattr(
            b.forward_metadata, f.name
        )
        for f in dataclasses.fields(b.forward_metadata)
    }
    NSAMetadata = dataclasses.make_dataclass("NSAMetadata", list(fields))  # the pre-rename field names
    old = to_sparse_attn_metadata(SimpleNamespace(attn_metadata=NSAMetadata(**fields)), "verify")
    for md in (wrapped, old):
        assert torch.equal(md.decode.context_lens, direct.decode.context_lens)
        assert torch.equal(md.decode.block_table, direct.decode.block_table)


# ---------------------------------------------------------------------------------------------
# Top-k transform (what SGLang's indexer calls after computing logits)
# ---------------------------------------------------------------------------------------------


def _ref_topk(row: torch.Tensor, lo: int, hi: int) -> set[int]:
    k = min(TOPK, hi - lo)
    return {lo + int(i) for i in torch.topk(row[lo:hi], k).indices}


@pytest.mark.parametrize("mode", ["prefill", "mixed", "decode", "verify"])
def test_topk_transform(mode):
    b, fb = build(mode)
    im = b.get_indexer_metadata(0, fb)
    assert isinstance(im, NsaIndexerMetadata)
    tokens = keys_per_token(mode)
    gen = torch.Generator().manual_seed(3)
    pool = b.token_to_kv_pool
    # Prefill keeps positions in the ragged logits; mixed (extend rows on the ragged logits) and
    # decode / verify (logits over the request's positions) return cache slots.
    paged = mode != "prefill"
    ragged_logits = mode in ("prefill", "mixed")
    assert im.topk_transform_method == (TopkTransformMethod.PAGED if paged else TopkTransformMethod.RAGGED)
    if ragged_logits:
        ks, ke = b.forward_metadata.indexer_k_start_end
        logits = torch.randn(len(tokens), int(ke.max()), generator=gen)
        out = im.topk_transform(logits, TOPK, ks=ks)
    else:
        logits = torch.randn(len(tokens), MAX_CTX, generator=gen)
        out = im.topk_transform(logits, TOPK)
    for i, (r, visible) in enumerate(tokens):
        start = int(ks[i]) if ragged_logits else 0
        expect = _ref_topk(logits[i], start, start + visible)
        if paged:
            expect = {int(pool.req_to_token[r, p - start]) for p in expect}
        assert {int(x) for x in out[i] if x >= 0} == expect, i
    assert out.dtype == torch.int32 and out.shape == (len(tokens), TOPK)


# ---------------------------------------------------------------------------------------------
# Forward: sparse MLA over the FP8 / bf16 cache against an independent computation
# ---------------------------------------------------------------------------------------------


def _decode_fp8_rows(rows: torch.Tensor) -> torch.Tensor:
    """Independent reading of the 656-byte fp8_ds_mla layout: 512 e4m3, 4 fp32 scales, 64 bf16."""
    vals = rows[:, :512].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, 512:528].contiguous().view(torch.float32)
    nope = (vals.view(-1, 4, 128) * scales[:, :, None]).view(-1, 512)
    rope = rows[:, 528:656].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], -1)


def _cache_rows(b, slots: torch.Tensor) -> torch.Tensor:
    buf = b.token_to_kv_pool.kv_buffer[0][:, 0]
    rows = buf[slots.long()]
    return _decode_fp8_rows(rows) if b.dsa_kv_cache_store_fp8 else rows.float()


def _fill_prefix(b, mode, gen):
    """Write random latent KV for the keys that were cached before this step."""
    reqs, lens, ext = BATCHES[mode]
    pool = b.token_to_kv_pool
    for r, s, n in zip(reqs, lens, ext):
        old = s - n if mode in ("prefill", "mixed", "draft_extend") else s - (0 if mode == "verify" else 1)
        if old <= 0:
            continue
        slots = pool.req_to_token[r, :old].long()
        kv = torch.randn(old, D_QK, generator=gen).to(torch.bfloat16)
        if b.dsa_kv_cache_store_fp8:
            nsa_backend.write_fp8_ds_mla_cache(kv, pool.kv_buffer[0], slots, "arbitrary")
        else:
            pool.kv_buffer[0][slots, 0] = kv


@pytest.mark.parametrize(
    "mode, fp8, paged_prefill",
    [
        pytest.param("prefill", True, False, id="prefill-fp8_ds_mla"),
        pytest.param("prefill", False, False, id="prefill-bf16"),
        # prefill through a paged-cache-only kernel (FlashInfer's path), here on the reference op
        pytest.param("prefill", True, True, id="prefill-fp8_ds_mla-paged"),
        pytest.param("prefill", False, True, id="prefill-bf16-paged"),
        pytest.param("mixed", True, False, id="mixed-fp8_ds_mla"),
        pytest.param("mixed", False, False, id="mixed-bf16"),
        pytest.param("draft_extend", True, False, id="draft_extend-fp8_ds_mla"),
        pytest.param("draft_extend", False, False, id="draft_extend-bf16"),
        pytest.param("decode", True, False, id="decode-fp8_ds_mla"),
        pytest.param("decode", False, False, id="decode-bf16"),
        pytest.param("verify", True, False, id="verify-fp8_ds_mla"),
        pytest.param("verify", False, False, id="verify-bf16"),
        # SGLang's CUDA-graph metadata (captured, then replayed) for MTP verify / draft extend v2
        pytest.param("verify", True, "verify", id="verify-graph-fp8_ds_mla"),
        pytest.param("verify", False, "verify", id="verify-graph-bf16"),
        pytest.param("verify", True, "draft_extend_v2", id="draft_extend_v2-graph-fp8_ds_mla"),
    ],
)
def test_forward_matches_reference(mode, fp8, paged_prefill, monkeypatch):
    # ``paged_prefill``: True for the paged-only prefill kernel; a graph mode name for graph metadata.
    graph_mode = paged_prefill if isinstance(paged_prefill, str) else None
    paged_prefill = paged_prefill is True
    b, fb = build_graph(graph_mode, fp8) if graph_mode else build(mode, fp8)
    if paged_prefill:
        monkeypatch.setattr(backend_module, "PAGED_ONLY_IMPLS", frozenset({"reference"}))
        b.nsa_prefill_impl = "reference"
    calls = []
    core_attention = backend_module.dsa_sparse_attention

    def spy(md, q, kv_cache, selection, *args, **kwargs):
        calls.append((md, selection))
        # decode is told the scale format of the backend's own fp8 cache writes
        assert kwargs["kv_scale_format"] == (b.nsa_scale_format if fp8 else None)
        return core_attention(md, q, kv_cache, selection, *args, **kwargs)

    monkeypatch.setattr(backend_module, "dsa_sparse_attention", spy)
    gen = torch.Generator().manual_seed(11)
    _fill_prefix(b, mode, gen)
    tokens = keys_per_token(mode)
    T = len(tokens)
    if mode in ("verify", "draft_extend"):  # the draft tokens' KV is written by the draft step
        kv = torch.randn(T, D_QK, generator=gen).to(torch.bfloat16)
        if fp8:
            nsa_backend.write_fp8_ds_mla_cache(
                kv, b.token_to_kv_pool.kv_buffer[0], fb.out_cache_loc, "arbitrary"
            )
        else:
            b.token_to_kv_pool.kv_buffer[0][fb.out_cache_loc, 0] = kv
    k_nope = torch.randn(T, 1, D_V, generator=gen).to(torch.bfloat16)
    k_rope = torch.randn(T, 1, D_ROPE, generator=gen).to(torch.bfloat16)
    q_nope = torch.randn(T, HEADS, D_V, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(T, HEADS, D_ROPE, generator=gen).to(torch.bfloat16)
    layer = SimpleNamespace(
        layer_id=0,
        tp_q_head_num=HEADS,
        v_head_dim=D_V,
        head_dim=D_QK,
        scaling=D_QK**-0.5,
        is_cross_attention=False,
        logit_cap=0.0,
    )

    im = b.get_indexer_metadata(0, fb)
    if mode in ("prefill", "mixed"):
        ks, ke = b.forward_metadata.indexer_k_start_end
        logits = torch.randn(T, int(ke.max()), generator=gen)
        topk = im.topk_transform(logits, TOPK, ks=ks)
    else:
        topk = im.topk_transform(torch.randn(T, MAX_CTX, generator=gen), TOPK)

    write = mode not in ("verify", "draft_extend")
    args = dict(q_rope=q_rope, k_rope=k_rope, topk_indices=topk)
    k_in, v_in = (k_nope, k_nope) if write else (None, None)
    if mode == "decode":
        out = b.forward_decode(q_nope, k_in, v_in, layer, fb, **args)
    else:
        out = b.forward_extend(q_nope, k_in, v_in, layer, fb, **args)
    assert out.shape == (T, HEADS, D_V) and out.dtype == torch.bfloat16

    # Every batch runs the core pipeline once; all but ragged prefill on a kernel with a ragged
    # entry, and even decode / verify batches, as one decode row per query token.
    assert len(calls) == 1
    md_core, selection = calls[0]
    if mode == "prefill" and not paged_prefill:
        assert md_core.decode is None and md_core.prefill.num_tokens == T
        assert selection.prefill_keys is not None
    elif mode in ("decode", "verify"):
        assert md_core.prefill is None and md_core.decode.num_reqs == len(BATCHES[mode][0])
    else:
        assert md_core.prefill is None and selection.prefill_keys is None
        assert (md_core.decode.num_reqs, md_core.decode.next_n) == (T, 1)

    # This step's keys landed in their slots (dequantised within e4m3 precision).
    if write:
        written = _cache_rows(b, fb.out_cache_loc)
        fresh = torch.cat([k_nope[:, 0], k_rope[:, 0]], -1).float()
        assert torch.allclose(written, fresh, atol=0.07 * fresh.abs().max().item(), rtol=0.07)

    # Independent attention: selected slots, softmax over scaled scores, latent values.
    pool = b.token_to_kv_pool
    q = torch.cat([q_nope, q_rope], -1).float()
    md = b.forward_metadata
    for i, (r, visible) in enumerate(tokens):
        sel = topk[i][topk[i] >= 0].long()
        if mode == "prefill":
            sel = (
                md.page_table_1_flattened[sel]
                if md.page_table_1_flattened is not None
                else torch.cat(
                    [pool.req_to_token[rr, :s] for rr, s in zip(BATCHES[mode][0], BATCHES[mode][1])]
                )[sel]
            )
        slots = sel.long()
        assert len(slots) == min(TOPK, visible)
        assert set(slots.tolist()) <= set(pool.req_to_token[r, :visible].tolist())
        kv = _cache_rows(b, slots)
        p = torch.softmax((q[i] @ kv.T) * layer.scaling, dim=-1)
        ref = p @ kv[:, :D_V]
        err = (out[i].float() - ref).abs().max().item()
        assert err <= 2e-2 * max(1.0, ref.abs().max().item()), (mode, i, err)


# ---------------------------------------------------------------------------------------------
# SGLang's own indexer (decode / MTP verify path) on the routed indexer ops
# ---------------------------------------------------------------------------------------------

IDX_HEADS, IDX_DIM = 32, 128  # GLM-5's indexer: 32 heads (below some native kernels' minimum)


def _read_index_cache(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Independent reading of the page-wise indexer cache: a page holds 64 x 128 e4m3, then 64 fp32."""
    flat = cache.reshape(cache.shape[0], -1)
    page, row = slots // PAGE, slots % PAGE
    vals = torch.stack([flat[p, r * IDX_DIM : (r + 1) * IDX_DIM] for p, r in zip(page, row)])
    scale_at = PAGE * IDX_DIM + 4 * row
    scales = (
        torch.stack([flat[p, a : a + 4] for p, a in zip(page, scale_at)]).contiguous().view(torch.float32)
    )
    return vals.view(torch.float8_e4m3fn).float() * scales


@pytest.mark.parametrize("mode, graph_mode", [("decode", None), ("verify", None), ("verify", "verify")])
def test_sglang_indexer_runs_on_routed_ops(mode, graph_mode, monkeypatch):
    b, fb = build_graph(graph_mode) if graph_mode else build(mode)
    assert dsa_indexer.resolve_fp8_paged_mqa_logits_fn() is kernels.fp8_paged_mqa_logits
    assert dsa_indexer.resolve_fp8_mqa_logits_fn() is kernels.fp8_mqa_logits
    assert sgl_dsa.resolve_paged_mqa_logits_metadata_fn() is kernels.get_paged_mqa_logits_metadata
    gen = torch.Generator().manual_seed(5)
    num_pages = NUM_PAGES + 1
    keys = torch.randn(num_pages * PAGE, IDX_DIM, generator=gen)
    cache = nsa_backend.pack_indexer_k_cache(keys, PAGE)  # [pages, 64, 1, 132]
    pool = SimpleNamespace(
        index_page_size=PAGE, get_index_k_with_scale_buffer=lambda layer_id: cache.view(num_pages, -1)
    )
    monkeypatch.setattr(dsa_indexer, "get_token_to_kv_pool", lambda: pool)

    tokens = keys_per_token(mode)
    ctx = torch.tensor([v for _, v in tokens], dtype=torch.int32).view(-1, 1)
    schedule = kernels.get_paged_mqa_logits_metadata(ctx, 64, 8)  # what SGLang builds on a GPU
    object.__setattr__(b.forward_metadata, "paged_mqa_schedule_metadata", schedule)
    q = torch.randn(len(tokens), IDX_HEADS, IDX_DIM, generator=gen).to(torch.float8_e4m3fn)
    w = torch.rand(len(tokens), IDX_HEADS, 1, generator=gen)
    indexer = SimpleNamespace(
        n_heads=IDX_HEADS,
        index_topk=TOPK,
        sm_count=8,
        paged_mqa_logits_backend=DSAPagedMQALogitsBackend.DEEPGEMM,
        num_init_tokens=0,
        num_local_tokens=0,
        _get_index_k_read_buffer=dsa_indexer.Indexer._get_index_k_read_buffer,
    )
    indexer._mask_init_and_local_tokens = dsa_indexer.Indexer._mask_init_and_local_tokens.__get__(indexer)
    out = dsa_indexer.Indexer._get_topk_paged(indexer, fb, 0, q, w, b.get_indexer_metadata(0, fb))

    req_to_token = b.token_to_kv_pool.req_to_token
    for i, (r, visible) in enumerate(tokens):
        slots = req_to_token[r, :visible].long()
        k = _read_index_cache(cache, slots)
        logits = (torch.relu(q[i].float() @ k.T) * w[i]).sum(0)
        expect = {int(slots[j]) for j in torch.topk(logits, min(TOPK, visible)).indices}
        assert {int(x) for x in out[i] if x >= 0} == expect, (mode, i)


def test_multi_step_draft_backend_builds_our_steps(monkeypatch):
    from nsa_backend_integrations.sglang import plugin

    made = []

    def fake_init(self, runner, *args, **kwargs):
        made.append(kwargs)

    monkeypatch.setattr(NsaSparseAttnBackend, "__init__", fake_init)
    multi = plugin.create_draft_decode_backend(object(), 1, 4, seed_dsa_topk_from_draft_extend=True)
    assert isinstance(multi, backend_module.NsaSparseAttnMultiStepBackend)
    assert isinstance(multi, sgl_dsa.DeepseekSparseAttnMultiStepBackend)
    assert all(isinstance(s, NsaSparseAttnBackend) for s in multi.attn_backends)
    assert [m["speculative_step_id"] for m in made] == [0, 1, 2]
    assert all(m["topk"] == 1 and m["speculative_num_steps"] == 4 for m in made)
    assert all(m["seed_dsa_topk_from_draft_extend"] for m in made)


def _raw_fp8_backend(kv_cache_dim: int = 576) -> NsaSparseAttnBackend:
    """A bare backend on SGLang's raw FP8 pool (TRT-LLM's rows: no scales, ``dsa_kv_cache_store_fp8`` False)."""
    b = object.__new__(NsaSparseAttnBackend)
    b.dsa_kv_cache_store_fp8 = False
    b.kv_cache_dim = kv_cache_dim
    b.dsa_index_kpool = 1
    b.hisparse_coordinator = None
    b.dcp_size = 1
    return b


def test_configure_raw_fp8_pool_refused_with_the_flags_to_change():
    """SGLang's resolved trtllm phases with nsa-backend's ops: the refusal names the flags and the
    alternatives (the resolved-layout check runs before the pool-layout check)."""
    with pytest.raises(ValueError) as err:
        _raw_fp8_backend().configure(
            model_arch="DeepseekV32ForCausalLM",
            kv_cache_dtype="fp8_e4m3",
            device_arch="sm100",
            resolved=("trtllm", "trtllm"),
        )
    msg = str(err.value)
    assert "resolved --dsa-prefill-backend 'trtllm' / --dsa-decode-backend 'trtllm'" in msg
    assert "--kv-cache-dtype bfloat16" in msg and "--dsa-decode-backend flashmla_kv" in msg
    assert "TileLang" not in msg


def test_configure_raw_fp8_pool_of_other_resolved_names_refused():
    """A raw pool whose resolved names are not trtllm (SGLang sizes a TileLang pair raw too) with
    nsa-backend's ops for a phase: refused, naming the flags and the alternatives."""
    with pytest.raises(ValueError) as err:
        _raw_fp8_backend().configure(
            model_arch="DeepseekV32ForCausalLM",
            kv_cache_dtype="fp8_e4m3",
            device_arch="sm90",
            resolved=("tilelang", "tilelang"),
        )
    msg = str(err.value)
    assert "for the prefill and decode phase" in msg and "raw FP8 MLA rows (576 B/token)" in msg
    assert "--kv-cache-dtype bfloat16" in msg and "--dsa-prefill-backend flashmla_sparse" in msg


def test_configure_raw_fp8_pool_with_sglang_kernels_for_both_phases():
    """``--dsa-prefill-backend trtllm --dsa-decode-backend trtllm``: SGLang's kernels read their raw rows,
    nsa-backend's ops read none of them."""
    b = _raw_fp8_backend()
    b.configure(
        model_arch="DeepseekV32ForCausalLM",
        kv_cache_dtype="fp8_e4m3",
        prefill_flag="trtllm",
        decode_flag="trtllm",
        device_arch="sm100",
        resolved=("trtllm", "trtllm"),
    )
    assert (b.nsa_prefill_impl, b.nsa_decode_impl) == (None, None)
    assert (b.dsa_prefill_impl, b.dsa_decode_impl) == ("trtllm", "trtllm")


# ---------------------------------------------------------------------------------------------
# Fused RoPE: the model leaves q_pe / k_pe unrotated and passes cos_sin_cache / is_neox
# ---------------------------------------------------------------------------------------------


def _rope_by_complex(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, is_neox: bool):
    """Rotation written as complex multiplication: pair (a, b) -> (a + ib) * exp(i * pos * freq)."""
    half = x.shape[-1] // 2
    xf = x.double()
    a, b = (xf[..., :half], xf[..., half:]) if is_neox else (xf[..., 0::2], xf[..., 1::2])
    angle = positions.double()[:, None] * inv_freq.double()[None, :]
    angle = angle.view(angle.shape[0], *([1] * (x.dim() - 2)), half)
    z = torch.complex(a, b) * torch.polar(torch.ones_like(angle), angle)
    if is_neox:
        return torch.cat([z.real, z.imag], -1)
    return torch.stack([z.real, z.imag], -1).flatten(-2)


@pytest.mark.parametrize("is_neox", [False, True], ids=["gptj", "neox"])
def test_apply_rope_matches_complex_rotation(is_neox):
    from nsa_backend_integrations.sglang.rope import apply_rope

    gen = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D_ROPE, 2, dtype=torch.float64) / D_ROPE))
    t = torch.arange(300, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cache = torch.cat([t.cos(), t.sin()], -1).float()  # SGLang's layout: cos half, then sin half
    positions = torch.randint(0, 300, (9,), generator=gen)
    x = torch.randn(9, HEADS, D_ROPE, generator=gen)
    got = apply_rope(x, positions, cache, is_neox)
    assert torch.allclose(got.double(), _rope_by_complex(x, positions, inv_freq, is_neox), atol=1e-5)
    # the other pairing convention gives another answer: the flag is honoured
    assert not torch.allclose(got.double(), _rope_by_complex(x, positions, inv_freq, not is_neox), atol=1e-2)
    with pytest.raises(ValueError, match="cos_sin_cache: expected"):
        apply_rope(x, positions, cache[:, :32], is_neox)
    with pytest.raises(ValueError, match="positions: expected at least 9"):
        apply_rope(x, positions[:4], cache, is_neox)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_fused_rope_is_applied_before_attention_and_cache_write(mode, monkeypatch):
    """``cos_sin_cache`` / ``is_neox`` as SGLang's model passes them (its rotary module, unrotated rope
    parts) give the output and cache of the same batch rotated by SGLang's own ``forward_native``."""
    from sglang.srt.layers.rotary_embedding import base as rotary_base

    monkeypatch.setattr(rotary_base, "_is_cpu", True)  # its CPU path (no vLLM / sgl-kernel op)
    rotary = rotary_base.RotaryEmbedding(D_ROPE, D_ROPE, 512, 10000, False, torch.float32)
    gen = torch.Generator().manual_seed(5)
    _, lens, ext = BATCHES[mode]
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(lens, ext)])
    T = len(positions)
    k_nope = torch.randn(T, 1, D_V, generator=gen).to(torch.bfloat16)
    k_rope = torch.randn(T, 1, D_ROPE, generator=gen).to(torch.bfloat16)
    q_nope = torch.randn(T, HEADS, D_V, generator=gen).to(torch.bfloat16)
    q_rope = torch.randn(T, HEADS, D_ROPE, generator=gen).to(torch.bfloat16)
    layer = SimpleNamespace(
        layer_id=0, tp_q_head_num=HEADS, v_head_dim=D_V, head_dim=D_QK, scaling=D_QK**-0.5, is_cross_attention=False
    )
    q_rot, k_rot = rotary.forward_native(positions, q_rope.float().clone(), k_rope.float().clone())

    def run(q_pe, k_pe, **fused):
        b, fb = build(mode, fp8=True)
        fb.positions = positions
        torch.manual_seed(0)
        _fill_prefix(b, mode, torch.Generator().manual_seed(7))
        im = b.get_indexer_metadata(0, fb)
        logits_gen = torch.Generator().manual_seed(1)
        if mode == "prefill":
            ks, ke = b.forward_metadata.indexer_k_start_end
            topk = im.topk_transform(torch.randn(T, int(ke.max()), generator=logits_gen), TOPK, ks=ks)
        else:
            topk = im.topk_transform(torch.randn(T, MAX_CTX, generator=logits_gen), TOPK)
        call = b.forward_decode if mode == "decode" else b.forward_extend
        out = call(q_nope, k_nope, k_nope, layer, fb, q_rope=q_pe, k_rope=k_pe, topk_indices=topk, **fused)
        return out, _cache_rows(b, fb.out_cache_loc)

    fused_out, fused_cache = run(
        q_rope, k_rope, cos_sin_cache=rotary.cos_sin_cache, is_neox=rotary.is_neox_style, llama_4_scaling=None
    )
    ref_out, ref_cache = run(q_rot.to(torch.bfloat16), k_rot.to(torch.bfloat16))
    assert torch.equal(fused_cache, ref_cache)  # rotated before the FP8 cache write
    assert torch.allclose(fused_out.float(), ref_out.float(), atol=1e-2, rtol=1e-2)
    unrotated_out, unrotated_cache = run(q_rope, k_rope)  # what dropping the arguments gives
    assert not torch.equal(unrotated_cache, ref_cache)
    assert (unrotated_out.float() - ref_out.float()).abs().max() > 0.05
