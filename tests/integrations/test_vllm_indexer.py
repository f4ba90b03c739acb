"""vLLM integration, indexer side: the out-of-tree ``SparseAttnIndexer`` that vLLM's DSA layer
builds, its forward on the CPU, the module-level indexer entry points, and the mHC GEMM routing.

Reference: index scores written out in this file from the cache bytes
(``sum_h relu(q . k) * w * k_scale``), and a top-k check that accepts any order and ties.
"""

from __future__ import annotations

import inspect
import sys

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.config.compilation import CompilationConfig  # noqa: E402

import nsa_backend  # noqa: E402
from nsa_backend_integrations.vllm import indexer as nsa_indexer  # noqa: E402
from nsa_backend_integrations.vllm import plugin  # noqa: E402
from tests.integrations import vllm_fixtures as vf  # noqa: E402

PAGE = 64
HEAD_DIM = 128
INDEX_HEADS = 8
TOPK = 16
NUM_BLOCKS = 24
PREFIX = "model.layers.1.self_attn.indexer"

@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    vf.cpu_platform()
    plugin.register()
    config = vf.dsa_model_config(index_topk=TOPK, index_n_heads=INDEX_HEADS, index_head_dim=HEAD_DIM)
    return vf.vllm_config(vf.model_dir(tmp_path_factory, "dsv32", config), block_size=PAGE)


@pytest.fixture(scope="module")
def dsa_indexer(vllm_config):
    """vLLM's own DeepSeek-V3.2 indexer layer, built the way the model builds it (TP = 1, gloo)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{vf.free_port()}",
        )
        initialize_model_parallel(1, 1)
        from vllm.models.deepseek_v32.attention import DeepseekV32Indexer

        buffer = torch.full((256, TOPK), -1, dtype=torch.int32)
        layer = DeepseekV32Indexer(
            vllm_config,
            vllm_config.model_config.hf_config,
            256,
            128,
            None,
            vllm_config.cache_config,
            buffer,
            prefix=PREFIX,
        )
    yield layer
    destroy_model_parallel()
    destroy_distributed_environment()


# ---------------------------------------------------------------------------------------------
# Independent helpers: cache bytes and scores
# ---------------------------------------------------------------------------------------------


def quantise(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 with a power-of-two scale (vLLM's "ue8m0" indexer K format)."""
    scale = torch.exp2(torch.ceil(torch.log2(k.float().abs().amax(-1).clamp(min=1e-4) / 448.0)))
    return (k.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def write_page_wise(cache: torch.Tensor, slot: int, values: torch.Tensor, scale: float) -> None:
    page = cache[slot // PAGE].view(-1)
    off = slot % PAGE
    page[off * HEAD_DIM : (off + 1) * HEAD_DIM] = values.view(torch.uint8)
    page[PAGE * HEAD_DIM + 4 * off : PAGE * HEAD_DIM + 4 * off + 4] = torch.tensor([scale]).view(torch.uint8)


def read_page_wise(cache: torch.Tensor, slot: int) -> tuple[torch.Tensor, float]:
    page = cache[slot // PAGE].reshape(-1)
    off = slot % PAGE
    values = page[off * HEAD_DIM : (off + 1) * HEAD_DIM].view(torch.float8_e4m3fn)
    scale = page[PAGE * HEAD_DIM + 4 * off : PAGE * HEAD_DIM + 4 * off + 4].clone().view(torch.float32)
    return values, float(scale)


def check_topk(chosen: torch.Tensor, scores: torch.Tensor, topk: int, where: str) -> None:
    """``chosen`` must be a valid top-``topk`` of ``scores`` (any order; near-ties either way)."""
    n = scores.numel()
    picked = chosen[chosen >= 0].long()
    assert picked.numel() == min(topk, n), f"{where}: {picked.numel()} indices for {n} keys"
    assert bool((chosen[picked.numel() :] == -1).all()), f"{where}: -1 padding must follow the indices"
    assert picked.unique().numel() == picked.numel() and int(picked.max()) < n, where
    kth = torch.topk(scores, min(topk, n)).values[-1]
    tol = 1e-4 * float(scores.abs().max()) + 1e-6
    assert float(scores[picked].min()) >= float(kth) - tol, f"{where}: a non-top key was selected"


class Batch:
    """A decode + prefill batch in vLLM's indexer metadata, with the cache filled for past tokens."""

    def __init__(
        self,
        decode_lens: list[int],
        decode_context: list[int],
        prefill_context: list[int],
        prefill_new: list[int],
        seed: int = 0,
        context_seq_lens: bool = False,
    ):
        from vllm.v1.attention.backends.mla.indexer import (
            DeepSeekV32IndexerDecodeMetadata,
            DeepseekV32IndexerMetadata,
            DeepseekV32IndexerPrefillChunkMetadata,
            DeepseekV32IndexerPrefillMetadata,
        )

        gen = torch.Generator().manual_seed(seed)
        self.query_lens = decode_lens + prefill_new
        self.context = decode_context + prefill_context
        num_reqs = len(self.query_lens)
        self.seq_lens = [c + q for c, q in zip(self.context, self.query_lens)]
        self.block_table = torch.randperm(NUM_BLOCKS, generator=gen)[: num_reqs * 4].view(num_reqs, 4).int()
        self.cache = torch.zeros(NUM_BLOCKS, PAGE, HEAD_DIM + 4, dtype=torch.uint8)
        # Keys of every position; past ones are already in the cache.
        self.keys = [torch.randn(s, HEAD_DIM, generator=gen).to(torch.bfloat16) for s in self.seq_lens]
        for r in range(num_reqs):
            kq, ks = quantise(self.keys[r][: self.context[r]])
            for p in range(self.context[r]):
                write_page_wise(self.cache, self.slot(r, p), kq[p], float(ks[p]))
        self.token_req, self.token_pos = [], []
        for r in range(num_reqs):
            for j in range(self.query_lens[r]):
                self.token_req.append(r)
                self.token_pos.append(self.context[r] + j)
        T = len(self.token_req)
        self.k_new = torch.stack([self.keys[r][p] for r, p in zip(self.token_req, self.token_pos)])
        self.q = (torch.randn(T, INDEX_HEADS, HEAD_DIM, generator=gen) * 2).to(torch.float8_e4m3fn)
        self.weights = torch.rand(T, INDEX_HEADS, generator=gen) * 0.1
        slots = torch.tensor([self.slot(r, p) for r, p in zip(self.token_req, self.token_pos)])

        nd, ndt = len(decode_lens), sum(decode_lens)
        decode = None
        if nd:
            next_n = max(decode_lens)
            seq = torch.tensor(self.seq_lens[:nd], dtype=torch.int32)
            seq_2d = (seq[:, None] - next_n + 1 + torch.arange(next_n, dtype=torch.int32)).clamp(min=0)
            decode = DeepSeekV32IndexerDecodeMetadata(
                block_table=self.block_table[:nd],
                # vLLM's plain-decode form: [B] context lengths instead of [B, next_n] rows.
                seq_lens=seq if context_seq_lens else seq_2d,
                decode_lens=torch.tensor(decode_lens),
                requires_padding=min(decode_lens) != next_n,
                schedule_metadata=nsa_backend.get_paged_mqa_logits_metadata(seq_2d, PAGE, 4),
            )
        prefill = None
        if prefill_new:
            kv_lens = torch.tensor(self.seq_lens[nd:], dtype=torch.int32)
            cu = torch.zeros(len(kv_lens) + 1, dtype=torch.int32)
            cu[1:] = kv_lens.cumsum(0)
            ks = torch.cat(
                [torch.full((q,), int(cu[i]), dtype=torch.int32) for i, q in enumerate(prefill_new)]
            )
            ke = torch.tensor(
                [int(cu[r - nd]) + p + 1 for r, p in zip(self.token_req[ndt:], self.token_pos[ndt:])],
                dtype=torch.int32,
            )
            total = int(cu[-1])
            chunk = DeepseekV32IndexerPrefillChunkMetadata(
                block_table=self.block_table[nd:],
                cu_seqlen_ks=ks,
                cu_seqlen_ke=ke,
                cu_seq_lens=cu,
                token_to_seq=torch.repeat_interleave(torch.arange(len(kv_lens), dtype=torch.int32), kv_lens),
                total_seq_lens=total,
                max_seqlen_k=int(kv_lens.max()),
                token_start=ndt,
                token_end=T,
                num_reqs=len(kv_lens),
                local_cu_seq_lens=cu,
                local_total_seq_lens=total,
                max_local_total_seq_lens=total,
            )
            prefill = DeepseekV32IndexerPrefillMetadata(chunks=[chunk])
        self.metadata = DeepseekV32IndexerMetadata(
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            max_seq_len=max(self.seq_lens),
            slot_mapping=slots,
            num_decodes=nd,
            num_decode_tokens=ndt,
            num_prefills=len(prefill_new),
            num_prefill_tokens=T - ndt,
            decode=decode,
            prefill=prefill,
        )

    def slot(self, r: int, p: int) -> int:
        return int(self.block_table[r, p // PAGE]) * PAGE + p % PAGE

    def check(self, buffer: torch.Tensor) -> None:
        """Every token's row against scores computed here from the cache bytes."""
        for t, (r, p) in enumerate(zip(self.token_req, self.token_pos)):
            kv = [read_page_wise(self.cache, self.slot(r, n)) for n in range(p + 1)]
            k = torch.stack([v.float() for v, _ in kv])  # [p+1, D]
            k_scale = torch.tensor([s for _, s in kv])
            scores = (torch.relu(self.q[t].float() @ k.T) * self.weights[t][:, None]).sum(0) * k_scale
            check_topk(buffer[t], scores, TOPK, f"token {t} (request {r}, position {p})")


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_vllm_instantiates_the_oot_indexer(dsa_indexer):
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    op = dsa_indexer.indexer_op
    assert type(op) is nsa_indexer.NsaSparseAttnIndexer
    assert isinstance(op, SparseAttnIndexer) and op.nsa_enabled
    # The fused DeepSeek-V3.2 / GLM-5 layer and the indexer metadata builder call module-level names.
    v32 = sys.modules["vllm.models.deepseek_v32.attention"]
    assert inspect.unwrap(v32.sparse_attn_indexer) is nsa_indexer.nsa_sparse_attn_indexer
    assert (
        nsa_indexer.install_module_patches()["vllm.models.deepseek_v32.attention"] is v32.sparse_attn_indexer
    )
    builder_module = sys.modules["vllm.v1.attention.backends.mla.indexer"]
    assert builder_module.get_paged_mqa_logits_metadata is nsa_indexer._paged_mqa_logits_metadata
    # Piecewise CUDA graphs split at the indexer op, as at vLLM's own.
    assert nsa_indexer.SPLITTING_OP in CompilationConfig._attention_ops


def test_layers_with_unsupported_caches_keep_vllm_indexer(dsa_indexer, vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer

    buffer = torch.full((8, TOPK), -1, dtype=torch.int32)
    with set_current_vllm_config(vllm_config):
        op = SparseAttnIndexer(dsa_indexer.k_cache, HEAD_DIM, "ue8m0", TOPK, HEAD_DIM, 4096, 4096, buffer,
                               compress_ratio=4)
    assert type(op) is nsa_indexer.NsaSparseAttnIndexer and not op.nsa_enabled


@pytest.mark.parametrize(
    "decode_lens, decode_context, context_seq_lens",
    [
        ([1, 1], [70, 130], False),
        ([2, 2], [70, 130], False),
        ([1, 2], [70, 130], False),
        ([1, 3], [3, 130], False),  # fewer keys than top-k: every visible key must be chosen
        ([3, 3], [5, 130], True),
        ([3, 1], [5, 10], True),
    ],
    ids=["decode", "mtp", "ragged-padded", "ragged-short", "mtp-context-lens", "ragged-context-lens"],
)
def test_oot_indexer_forward_matches_scores(
    dsa_indexer, vllm_config, decode_lens, decode_context, context_seq_lens
):
    from vllm.forward_context import set_forward_context

    batch = Batch(
        decode_lens,
        decode_context=decode_context,
        prefill_context=[40, 0],
        prefill_new=[30, 20],
        seed=len(decode_lens) + sum(decode_lens),
        context_seq_lens=context_seq_lens,
    )
    op = dsa_indexer.indexer_op
    op.k_cache.kv_cache = batch.cache
    T = batch.q.shape[0]
    hidden = torch.zeros(T, 256, dtype=torch.bfloat16)
    with set_forward_context({op.k_cache.prefix: batch.metadata}, vllm_config):
        out = op(hidden, batch.q, batch.k_new, batch.weights)
    assert out is op.topk_indices_buffer
    # This step's keys went into the cache exactly as vLLM's "ue8m0" format stores them.
    kq, ks = quantise(batch.k_new)
    for t, (r, p) in enumerate(zip(batch.token_req, batch.token_pos)):
        values, scale = read_page_wise(batch.cache, batch.slot(r, p))
        assert torch.equal(values.view(torch.uint8), kq[t].view(torch.uint8)) and scale == float(ks[t])
    batch.check(out)


def test_module_level_indexer_function_matches(dsa_indexer, vllm_config):
    """The function the fused DeepSeek-V3.2 layer calls (keys already cached, buffer pre-cleared)."""
    from vllm.forward_context import set_forward_context

    batch = Batch([1, 1, 1], decode_context=[3, 200, 64], prefill_context=[10], prefill_new=[7], seed=5)
    for t, (r, p) in enumerate(zip(batch.token_req, batch.token_pos)):
        kq, ks = quantise(batch.k_new[t : t + 1])
        write_page_wise(batch.cache, batch.slot(r, p), kq[0], float(ks[0]))
    v32 = sys.modules["vllm.models.deepseek_v32.attention"]
    buffer = torch.full((64, TOPK), -1, dtype=torch.int32)
    T = batch.q.shape[0]
    with set_forward_context({PREFIX + ".k_cache": batch.metadata}, vllm_config):
        v32.sparse_attn_indexer(
            torch.zeros(T, 128),
            PREFIX + ".k_cache",
            batch.cache,
            batch.q,
            None,
            None,
            batch.weights,
            HEAD_DIM,
            "ue8m0",
            TOPK,
            HEAD_DIM,
            4096,
            4096,
            buffer,
            skip_k_cache_insert=True,
            use_pcp=False,
            pcp_shard_decode_requests=False,
            dense_mha_metadata_layer_name="",
            dcp_rank=0,
            dcp_world_size=1,
            cp_kv_cache_interleave_size=1,
            skip_topk_buffer_clear=True,
            topk_backend="auto",
        )
    batch.check(buffer)


def _call_v32_indexer(batch, vllm_config, buffer, **extra):
    """vLLM 0.34's fused-layer call of the module-level indexer (keys cached, buffer cleared)."""
    from vllm.forward_context import set_forward_context

    v32 = sys.modules["vllm.models.deepseek_v32.attention"]
    T = batch.q.shape[0]
    with set_forward_context({PREFIX + ".k_cache": batch.metadata}, vllm_config):
        v32.sparse_attn_indexer(
            torch.zeros(T, 128), PREFIX + ".k_cache", batch.cache, batch.q, None, None, batch.weights,
            HEAD_DIM, "ue8m0", TOPK, HEAD_DIM, 4096, 4096, buffer,
            skip_k_cache_insert=True, use_pcp=False, pcp_shard_decode_requests=False,
            dense_mha_metadata_layer_name="", dcp_rank=0, dcp_world_size=1, cp_kv_cache_interleave_size=1,
            skip_topk_buffer_clear=True, topk_backend="auto", **extra,
        )


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_module_level_indexer_ranks_logits_in_logits_dtype(dsa_indexer, vllm_config, monkeypatch, logits_dtype):
    """``logits_dtype`` (vLLM 0.34's keyword): the top-k ranks scores produced in that dtype."""
    batch = Batch([1, 1], decode_context=[3, 200], prefill_context=[10], prefill_new=[7], seed=11)
    for t, (r, p) in enumerate(zip(batch.token_req, batch.token_pos)):
        kq, ks = quantise(batch.k_new[t : t + 1])
        write_page_wise(batch.cache, batch.slot(r, p), kq[0], float(ks[0]))
    ranked = []
    topk = nsa_backend.topk_indices

    def recording_topk(logits, *args, **kwargs):
        ranked.append(logits.clone())
        return topk(logits, *args, **kwargs)

    # the DSA pipeline ranks the scores (nsa_backend.dsa imports topk_indices by name)
    monkeypatch.setattr(nsa_backend.dsa, "topk_indices", recording_topk)
    buffer = torch.full((64, TOPK), -1, dtype=torch.int32)
    _call_v32_indexer(batch, vllm_config, buffer, logits_dtype=logits_dtype, dcp_direct_topk_max_rows=0)
    assert len(ranked) == 2  # one prefill chunk, one decode batch
    finite = torch.cat([x[torch.isfinite(x)] for x in ranked])
    in_bf16 = torch.equal(finite, finite.to(torch.bfloat16).float())
    assert in_bf16 == (logits_dtype == torch.bfloat16), f"scores ranked in {logits_dtype}: bf16-exact={in_bf16}"
    if logits_dtype == torch.float32:
        batch.check(buffer)


@pytest.mark.parametrize("logits_dtype", [torch.float16, "float32"])
def test_module_level_indexer_refuses_other_logits_dtypes(dsa_indexer, vllm_config, logits_dtype):
    batch = Batch([1], decode_context=[3], prefill_context=[], prefill_new=[], seed=3)
    buffer = torch.full((64, TOPK), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"logits_dtype={logits_dtype!r}"):
        _call_v32_indexer(batch, vllm_config, buffer, logits_dtype=logits_dtype)


def test_indexer_builder_schedule_comes_from_nsa_backend(dsa_indexer):
    builder_module = sys.modules["vllm.v1.attention.backends.mla.indexer"]
    seq_lens = torch.tensor([[71], [131], [5]], dtype=torch.int32)
    schedule = builder_module.get_paged_mqa_logits_metadata(seq_lens, PAGE, 8, indices=None)
    assert schedule.shape == (9, 2) and schedule.dtype == torch.int32
    assert torch.equal(schedule, nsa_backend.get_paged_mqa_logits_metadata(seq_lens, PAGE, 8))


def test_profile_run_returns_buffer_untouched(dsa_indexer, vllm_config):
    from vllm.forward_context import set_forward_context

    op = dsa_indexer.indexer_op
    op.topk_indices_buffer.fill_(7)
    with set_forward_context(None, vllm_config):
        out = op(
            torch.zeros(4, 256),
            torch.zeros(4, INDEX_HEADS, HEAD_DIM).to(torch.float8_e4m3fn),
            torch.zeros(4, HEAD_DIM),
            torch.zeros(4, INDEX_HEADS),
        )
    assert bool((out == 7).all())


# ---------------------------------------------------------------------------------------------
# mHC pre-norm GEMM
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_split", [1, 3])
def test_hc_prenorm_gemm_routed_to_nsa_backend(vllm_config, num_split):
    from vllm.utils import deep_gemm

    assert hasattr(deep_gemm.tf32_hc_prenorm_gemm, "nsa_backend_original")
    torch.manual_seed(num_split)
    M, K, N = 5, 4 * 64, 24  # DeepSeek-V4 mixes: N = hc_mult * (hc_mult + 2)
    x = torch.randn(M, K).to(torch.bfloat16)
    fn = torch.randn(N, K)
    out = torch.empty(num_split, M, N)
    sqrsum = torch.empty(num_split, M)
    deep_gemm.tf32_hc_prenorm_gemm(x, fn, out, sqrsum, num_split)
    torch.testing.assert_close(
        out.sum(0), x.double() @ fn.double().T, atol=1e-3, rtol=1e-4, check_dtype=False
    )
    torch.testing.assert_close(
        sqrsum.sum(0), x.double().square().sum(-1), atol=1e-3, rtol=1e-4, check_dtype=False
    )
