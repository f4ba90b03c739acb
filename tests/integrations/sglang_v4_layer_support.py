"""SGLang's own DeepSeek-V4 ``dsv4`` attention backend on CPU, its pools and batches, and a plain-torch reference.

Used by ``test_sglang_v4_backend.py``. Everything here reads SGLang 0.5.23's installed code; nothing is
copied from it. What is built is SGLang's: ``DeepSeekV4TokenToKVPool`` (584-byte V4 rows, 256-token
pages), ``ReqToTokenPool``, ``KVIndexTranslator`` (the batch's KV plan), ``ForwardBatch``, the
``dsv4`` backend from SGLang's attention registry, its ``init_forward_metadata`` and ``forward``.
The model runner is the set of fields the backend reads (:class:`Runner`), as SGLang's model runner
holds them for a DeepSeek-V4 config.

SGLang code replaced because it has no CPU path (:func:`cpu_replacements`):

- ``deepseek_v4_backend.is_cuda`` -> ``True`` while the backend is built: its constructor binds
  ``flash_mla_interface.flash_mla_with_kvcache`` (and FlashMLA's split-KV threshold) only on CUDA,
  which is what the SM90 / SM100 decode path calls; on a CPU it would leave the attribute unset.

Nothing else is replaced: the metadata builders (window page indices, lengths, the sparse-prefill
chunk cache), the pool's cache write (``set_swa_key_buffer_radix_fused`` -> the pool module's
``fused_store_cache``), SGLang's Triton dequantiser of the prefill workspace (Triton's CPU
interpreter) and the attention calls run as SGLang has them, with nsa-backend's replacements of
``fused_store_cache``, ``flash_mla_with_kvcache``, ``flash_mla_sparse_fwd`` and
``flash_mla_with_kvcache_sm120`` installed by :func:`nsa_backend_integrations.sglang.dsv4.activate`.
The SM120 path is selected with SGLang's own ``override_platform(is_sm120=True)``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from nsa_backend import reference as ref

PAGE = 256  # SGLang's DeepSeek-V4 backend hard-codes 256-token pages
WINDOW = 128  # the backend's sliding window
HEADS = 4
D = 512  # 448 nope + 64 rope
INDEX_TOPK = 512  # the only values the backend's metadata accepts are 512 and 1024
MAX_CTX = 512  # ReqToTokenPool row length
SWA_SLOTS = 1024  # SWA pool size in tokens (4 pages)


def hf_config(num_layers: int = 1) -> Any:
    """The DeepSeek-V4 HF config fields the backend and pool read (one SWA-only layer)."""
    cfg = SimpleNamespace(
        architectures=["DeepseekV4ForCausalLM"],
        model_type="deepseek_v4",
        hidden_size=256,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        head_dim=D,
        qk_nope_head_dim=ref.V4_NOPE_DIM,
        qk_rope_head_dim=ref.V4_ROPE_DIM,
        kv_lora_rank=D,
        v_head_dim=D,
        index_topk=INDEX_TOPK,
        num_hidden_layers=num_layers,
        compress_ratios=[0] * num_layers,
        kv_source_layer_ids=[],
        sliding_window=WINDOW,
    )
    cfg.get_text_config = lambda: cfg
    return cfg


class Runner:
    """The model-runner fields SGLang's ``DeepseekV4AttnBackend`` reads, with SGLang's own pools."""

    def __init__(self, num_reqs: int):
        from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        cfg = hf_config()
        self.device = "cpu"
        self.page_size = PAGE
        self.model_config = SimpleNamespace(
            hf_config=cfg, hf_text_config=cfg, context_len=MAX_CTX, head_dim=D, v_head_dim=D,
            num_attention_heads=HEADS,
        )
        self.token_to_kv_pool = DeepSeekV4TokenToKVPool(
            max_num_reqs=num_reqs, swa_size=SWA_SLOTS, c4_size=PAGE, c128_size=PAGE, c4_state_pool_size=num_reqs,
            c128_state_pool_size=num_reqs, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
            c4_state_dtype=torch.bfloat16, c128_state_dtype=torch.bfloat16, qk_nope_head_dim=ref.V4_NOPE_DIM,
            qk_rope_head_dim=ref.V4_ROPE_DIM, indexer_head_dim=128, layer_num=1, device="cpu",
            enable_memory_saver=False, compression_ratios=list(cfg.compress_ratios), full_size=SWA_SLOTS,
        )
        # full KV slots map to the same SWA slots (the pool's full -> SWA translation is then the identity)
        self.token_to_kv_pool.register_mapping(torch.arange(SWA_SLOTS, dtype=torch.int64))
        self.req_to_token_pool = ReqToTokenPool(size=num_reqs, max_context_len=MAX_CTX, device="cpu",
                                                enable_memory_saver=False)
        self.token_to_kv_pool_allocator = SimpleNamespace(page_size=PAGE)
        self.kv_index_translator = KVIndexTranslator(
            req_to_token=self.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            token_to_kv_pool=self.token_to_kv_pool, page_size=PAGE, device="cpu")
        self.hisparse_coordinator = None
        self.is_draft_worker = False
        self.spec_algorithm = SpeculativeAlgorithm.NONE


def slot(req: int, pos: int) -> int:
    """The KV slot of ``(request, position)``: request ``r`` owns slots ``200 + 300 r ...``, so each request's
    rows cross a 256-token page boundary and slot 0 (SGLang's padding slot) stays unused."""
    return 200 + req * 300 + pos


def forward_batch(runner: Runner, backend: Any, prefix: list[int], counts: list[int]) -> Any:
    """SGLang's ``ForwardBatch`` of requests ``0..B-1``: ``counts[r]`` new tokens after ``prefix[r]`` cached
    ones (an extend when any count differs from 1 or a prefix is 0, else a decode step)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    decode = all(n == 1 for n in counts) and all(p > 0 for p in prefix)
    seq = [p + n for p, n in zip(prefix, counts)]
    req_to_token = runner.req_to_token_pool.req_to_token
    for r, s in enumerate(seq):
        req_to_token[r, :s] = torch.tensor([slot(r, p) for p in range(s)], dtype=req_to_token.dtype)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix, counts)])
    out_loc = torch.tensor([slot(r, p) for r, (s, n) in enumerate(zip(prefix, counts)) for p in range(s, s + n)])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE if decode else ForwardMode.EXTEND,
        batch_size=len(seq),
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        req_pool_indices=torch.arange(len(seq), dtype=torch.int32),
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
        out_cache_loc=out_loc,
        seq_lens_sum=sum(seq),
        positions=positions,
    )
    runner.kv_index_translator.bind_own_plan(fb)  # the batch's KV ids, as a scheduled batch carries them
    if not decode:
        fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = list(prefix)
        fb.extend_seq_lens = torch.tensor(counts, dtype=torch.int32)
        fb.extend_seq_lens_cpu = list(counts)
        fb.extend_start_loc = torch.tensor([0, *torch.tensor(counts).cumsum(0)[:-1].tolist()], dtype=torch.int32)
        fb.extend_num_tokens = sum(counts)
    fb.req_to_token_pool = runner.req_to_token_pool
    fb.token_to_kv_pool = runner.token_to_kv_pool
    fb.attn_backend = backend
    return fb


def cpu_replacements(monkeypatch) -> list[str]:
    """Install the replacements listed in the module docstring; returns their names."""
    import sglang.srt.layers.attention.deepseek_v4_backend as v4_backend

    monkeypatch.setattr(v4_backend, "is_cuda", lambda: True)
    return ["deepseek_v4_backend.is_cuda (constructor's FlashMLA binding)"]


def build_backend(monkeypatch, num_reqs: int) -> tuple[Runner, Any]:
    """SGLang's ``dsv4`` backend from its attention registry on a :class:`Runner`."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    cpu_replacements(monkeypatch)
    runner = Runner(num_reqs)
    return runner, ATTENTION_BACKENDS["dsv4"](runner)


def radix_layer(layer_id: int = 0) -> Any:
    """SGLang's ``RadixAttention`` as the V4 model builds it for its MQA (one KV head of 512)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(HEADS, D, D**-0.5, num_kv_heads=1, layer_id=layer_id, v_head_dim=D)


# ---------------------------------------------------------------------------------------------
# Plain-torch reference
# ---------------------------------------------------------------------------------------------


def reference_cache(rows: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The raw SWA page buffer ``like`` (``uint8 [pages, page_bytes]``) after writing ``rows``
    (slot -> bf16 ``[512]``) with nsa-backend's reference V4 writer into zeroed pages."""
    out = torch.zeros_like(like)
    pages = out[:, : PAGE * ref.V4_TOKEN_BYTES].view(out.shape[0], PAGE, ref.V4_TOKEN_BYTES)
    slots = torch.tensor(sorted(rows))
    ref.write_fp8_ds_mla_v4_cache(torch.stack([rows[int(s)] for s in slots]), pages, slots)
    return out


def stored_key(k: torch.Tensor) -> torch.Tensor:
    """What a V4 cache row holds for bf16 ``k [N, 512]``, in float32: the nope part in e4m3 times its
    power-of-two group scale (one per 64 values, ``2^ceil(log2(amax / 448))``), the rope part as is."""
    nope = k[:, : ref.V4_NOPE_DIM].float().unflatten(-1, (-1, ref.V4_GROUP))
    amax = nope.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    q = (nope / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return torch.cat([q.flatten(-2), k[:, ref.V4_NOPE_DIM:].float()], -1)


def window_attention(q: torch.Tensor, keys: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """One query row ``q [H, 512]`` over ``keys [K, 512]`` (its window), float32, with the attention sink:
    ``softmax`` over the keys and one extra logit ``sink[h]`` whose value is zero. Returns ``[H, 512]``."""
    s = (q.float() @ keys.T) * D**-0.5
    denom = torch.logaddexp(torch.logsumexp(s, -1), sink.float())
    return torch.exp(s - denom[:, None]) @ keys
