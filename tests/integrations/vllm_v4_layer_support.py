"""vLLM's own DeepSeek-V4 attention layer on the CPU with nsa-backend's class, the batches it is
served, and a plain-torch reference of the same layer, for ``test_vllm_v4_layer.py``.

:class:`LayerEngine` builds the class vLLM's (wrapped) ``_select_dsv4_attn_cls`` returns for the
layer's config, as ``DeepseekV4DecoderLayer`` does, on a tiny DeepSeek-V4-shaped config with random
weights: a sliding-window layer (``layer_types`` entry ``sliding_attention``) with vLLM's SWA cache
layer (584-byte ``fp8_ds_mla`` rows, block-split pages, sized from the layer's KV-cache spec) and
the metadata from the builder its backend names (vLLM's SWA builder) fed with vLLM's
``CommonAttentionMetadata``, run under vLLM's forward context, step after step.

:func:`reference_step` recomputes the step's output from the layer's weights in float32 with the
formulas written out here: fused q-lora / kv projection, RMSNorms, the per-head query RMSNorm, GPT-J
RoPE, the V4 cache quantisation (448 nope values in e4m3 with one power-of-two scale per 64, the 64
rope values in bf16), softmax over the sliding window with the attention sink in the denominator,
inverse RoPE of the output, grouped ``wo_a`` and ``wo_b``.

vLLM is imported inside the functions, so importing this module needs no vLLM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

PAGE = 64
NUM_BLOCKS = 8
MAX_TOKENS = 256
MAX_MODEL_LEN = 1024
LAYER_PREFIX = "model.layers.1.attn"   # layer 1: the sliding-window layer of LAYER_CONFIG
WINDOW = 8
FP8_MAX = 448.0

LAYER_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "o_groups": 2,
    "qk_rope_head_dim": 64,
    "sliding_window": WINDOW,
    "index_topk": 4,
    "index_n_heads": 4,
    "index_head_dim": 128,
    "vocab_size": 1024,
    "max_position_embeddings": MAX_MODEL_LEN,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "layer_types": ["heavily_compressed_attention", "sliding_attention"],
    "moe_intermediate_size": 64,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "rope_theta": 10000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def make_vllm_config(model: str, backend: str | None = None) -> Any:
    """``VllmConfig`` of the model in directory ``model`` on the CPU (``--kv-cache-dtype fp8``,
    ``--attention-backend backend``)."""
    from vllm.config import (
        AttentionConfig,
        CacheConfig,
        DeviceConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN)
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=PAGE, cache_dtype="fp8"),
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend=backend),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=MAX_TOKENS, max_num_seqs=8,
                                         max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False),
    )


@dataclasses.dataclass
class Step:
    """One forward: the new tokens of each scheduled request (decodes first, as vLLM orders them)."""

    token_request: list[int]
    token_position: list[int]
    hidden: torch.Tensor  # [T, hidden] bf16
    output: torch.Tensor | None = None  # [T, hidden] bf16


def _init_weights(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2), sinks ~ N(0, 1)."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() == 2:
                values = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
            elif name.endswith("attn_sink"):
                values = torch.randn(param.shape, generator=gen)
            else:
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values.to(param.dtype))


def schedule_tokens(hidden: list[torch.Tensor], gen: torch.Generator, hidden_size: int,
                    schedule: list[tuple[int, int]]) -> tuple[Step, list[int], torch.Tensor, torch.Tensor]:
    """New random hidden states for ``(request, new tokens)`` pairs, appended to ``hidden``: the step,
    its requests, their query start locations and sequence lengths."""
    token_request, token_position, new_rows, query_lens = [], [], [], []
    for r, n in schedule:
        start = hidden[r].shape[0]
        new = torch.randn(n, hidden_size, generator=gen).to(torch.bfloat16)
        hidden[r] = torch.cat([hidden[r], new])
        token_request += [r] * n
        token_position += list(range(start, start + n))
        new_rows.append(new)
        query_lens.append(n)
    requests = [r for r, _ in schedule]
    qsl = torch.zeros(len(requests) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    seq_lens = torch.tensor([hidden[r].shape[0] for r in requests], dtype=torch.int32)
    return Step(token_request, token_position, torch.cat(new_rows)), requests, qsl, seq_lens


class LayerEngine:
    """The DeepSeek-V4 sliding-window attention layer vLLM's selector picks, with its SWA cache."""

    def __init__(self, vllm_config: Any, seed: int = 0) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v4.nvidia import model
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.vllm_config = vllm_config
        self.hf_config = vllm_config.model_config.hf_config
        self.gen = torch.Generator().manual_seed(seed)
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
            # What DeepseekV4DecoderLayer does: the class the module-level selector returns.
            cls = model._select_dsv4_attn_cls(vllm_config)
            self.layer = cls(vllm_config, prefix=LAYER_PREFIX, topk_indices_buffer=None, aux_stream_list=None)
            _init_weights(self.layer, self.gen)
            swa = self.layer.swa_cache_layer
            self.spec = swa.get_kv_cache_spec(vllm_config)
            swa.bind_kv_cache(torch.zeros(NUM_BLOCKS, 1, self.spec.page_size_bytes, dtype=torch.uint8))
            self.cache = swa.kv_cache
            builder_cls = swa.get_attn_backend().get_builder_cls()
            self.builder = builder_cls(self.spec, [swa.prefix], vllm_config, torch.device("cpu"))
        # Blocks handed out in a scrambled order, so mixing up block tables or slots shows.
        self._free = torch.randperm(NUM_BLOCKS, generator=self.gen).tolist()
        self.blocks: list[list[int]] = []
        self.hidden: list[torch.Tensor] = []

    def add_request(self, num_blocks: int) -> int:
        self.blocks.append([self._free.pop() for _ in range(num_blocks)])
        self.hidden.append(torch.empty(0, self.hf_config.hidden_size, dtype=torch.bfloat16))
        return len(self.blocks) - 1

    def slot(self, r: int, position: int) -> int:
        return self.blocks[r][position // PAGE] * PAGE + position % PAGE

    def step(self, schedule: list[tuple[int, int]]) -> Step:
        """One forward of ``(request, new tokens)`` pairs; returns the step with the layer's output."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        step, requests, qsl, seq_lens = schedule_tokens(self.hidden, self.gen, self.hf_config.hidden_size, schedule)
        token_request, token_position = step.token_request, step.token_position
        block_table = torch.zeros(len(requests), MAX_MODEL_LEN // PAGE, dtype=torch.int32)
        for i, r in enumerate(requests):
            block_table[i, : len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
        slots = torch.tensor([self.slot(r, p) for r, p in zip(token_request, token_position)], dtype=torch.int64)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(requests),
            num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table, slot_mapping=slots, seq_lens_cpu_upper_bound=seq_lens.clone(),
        )
        prefix = self.layer.swa_cache_layer.prefix
        metadata = {prefix: self.builder.build(common_prefix_len=0, common_attn_metadata=common)}
        with torch.no_grad(), set_forward_context(metadata, self.vllm_config, num_tokens=len(token_request),
                                                  slot_mapping={prefix: slots}):
            step.output = self.layer(torch.tensor(token_position, dtype=torch.int64), step.hidden)
        return step


# ---------------------------------------------------------------------------------------------
# Plain-torch reference
# ---------------------------------------------------------------------------------------------


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _rms(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    x = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return x if weight is None else x * weight.float()


def cos_sin(positions: torch.Tensor, theta: float, dim: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE angles (every layer's RoPE on a config without YaRN): ``cos, sin`` ``[T, dim / 2]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rope_gptj(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE on pairs ``(x[2i], x[2i+1])``; ``x`` ``[T, ..., dim]``."""
    shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def v4_cache_roundtrip(kv: torch.Tensor) -> torch.Tensor:
    """The 584-byte V4 row's values: 448 nope values as e4m3 with one power-of-two (UE8M0) scale per
    64 (``2^ceil(log2(amax / 448))``), the 64 rope values as bf16."""
    nope = kv[:, :448].view(-1, 7, 64)
    scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True).clamp(min=1e-10) / FP8_MAX)))
    nope = ((nope / scale).to(torch.float8_e4m3fn).float() * scale).view(-1, 448)
    return torch.cat([nope, _bf16(kv[:, 448:])], dim=-1)


def rope_theta(engine: Any) -> float:
    """The RoPE base of the engine's layer: ``rope_theta`` for sliding-window layers, ``compress_rope_theta``
    for compressed ones (C4A, C128A), as the DeepSeek-V4 config lays out its per-layer-type RoPE."""
    cfg = engine.hf_config
    return float(cfg.compress_rope_theta if getattr(engine, "ratio", 1) > 1 else cfg.rope_theta)


def _projections(engine: LayerEngine, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qr, kv)`` after the fused projection and their RMSNorms, bf16-rounded as vLLM stores them.

    The projection is the platform's bf16 GEMM (what vLLM's unquantised linear layer calls): a float32
    product rounded to bf16 differs from it by one bf16 step in a few elements per ten thousand (a sum
    landing near a rounding boundary in another order), which the exact cache check would report."""
    layer, cfg = engine.layer, engine.hf_config
    qr_kv = torch.nn.functional.linear(h.to(torch.bfloat16), layer.fused_wqa_wkv.weight.to(torch.bfloat16)).float()
    qr = _bf16(_rms(qr_kv[:, : cfg.q_lora_rank], cfg.rms_norm_eps, layer.q_norm.weight))
    kv = _bf16(_rms(qr_kv[:, cfg.q_lora_rank :], cfg.rms_norm_eps, layer.kv_norm.weight))
    return qr, kv


@torch.no_grad()
def request_keys(engine: LayerEngine, r: int) -> torch.Tensor:
    """Every position of request ``r`` as the cache holds it: ``[L, 512]`` float32."""
    h = engine.hidden[r]
    _, kv = _projections(engine, h)
    cos, sin = cos_sin(torch.arange(h.shape[0]), rope_theta(engine))
    kv = torch.cat([kv[:, :448], _bf16(rope_gptj(kv[:, 448:], cos, sin))], dim=-1)
    return v4_cache_roundtrip(kv)


@torch.no_grad()
def reference_step(engine: Any, step: Step, extra_keys: Any = None) -> torch.Tensor:
    """The step's output ``[T, hidden]`` (float32) from the weights; ``extra_keys(t, r, p)`` (optional) gives
    token ``t``'s further keys ``[K, 512]`` (compressed layers), attended with the window."""
    layer, cfg = engine.layer, engine.hf_config
    heads, d, groups, rank = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    positions = torch.tensor(step.token_position)
    cos, sin = cos_sin(positions, rope_theta(engine))
    qr, _ = _projections(engine, step.hidden)
    q = _bf16(qr @ layer.wq_b.weight.float().T).view(-1, heads, d)
    q = _rms(q, cfg.rms_norm_eps)
    q = _bf16(torch.cat([q[..., :448], rope_gptj(q[..., 448:], cos, sin)], dim=-1))
    keys = {r: request_keys(engine, r) for r in set(step.token_request)}
    sink = layer.attn_sink.float()[:heads]
    out = torch.empty(len(step.token_request), heads, d)
    for t, (r, p) in enumerate(zip(step.token_request, step.token_position)):
        k = keys[r][max(0, p - cfg.sliding_window + 1) : p + 1]   # the sliding window
        if extra_keys is not None:
            k = torch.cat([k, extra_keys(t, r, p)])
        scores = q[t] @ k.T * d**-0.5   # [H, W]
        m = torch.maximum(scores.amax(-1), sink)
        weights = torch.exp(scores - m[:, None])
        out[t] = (weights @ k) / (weights.sum(-1) + torch.exp(sink - m))[:, None]
    # Output: inverse RoPE of the rope dims, wo_a per group of heads, wo_b.
    out = _bf16(out)
    out = torch.cat([out[..., :448], rope_gptj(out[..., 448:], cos, -sin)], dim=-1)
    x = _bf16(out).view(-1, groups, heads // groups * d)
    w = layer.wo_a.weight.float().view(groups, rank, -1)
    z = _bf16(torch.einsum("tgi,gri->tgr", x, w)).flatten(1)
    return z @ layer.wo_b.weight.float().T


def read_cache(engine: LayerEngine, r: int) -> torch.Tensor:
    """Request ``r``'s rows decoded from the SWA cache bytes: ``[L, 512]`` float32 (block-split page:
    ``P`` rows of 448 e4m3 + 64 bf16, then ``P`` rows of 8 scale bytes, UE8M0 ``2^(b - 127)``)."""
    rows = []
    flat = engine.cache.view(engine.cache.shape[0], -1)
    for p in range(engine.hidden[r].shape[0]):
        slot = engine.slot(r, p)
        page, off = flat[slot // PAGE], slot % PAGE
        data = page[off * 576 : (off + 1) * 576]
        scales = page[PAGE * 576 + off * 8 : PAGE * 576 + off * 8 + 7].float()
        nope = data[:448].view(torch.float8_e4m3fn).float().view(7, 64) * torch.exp2(scales - 127)[:, None]
        rope = data[448:576].clone().view(torch.bfloat16).float()
        rows.append(torch.cat([nope.view(-1), rope]))
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------
# Compressed layers (C4A, C128A)
# ---------------------------------------------------------------------------------------------

COMPRESSED_BLOCK = 256   # vLLM's DeepSeek-V4 kernel block: 256 tokens, 256 / ratio compressed rows
COMPRESSED_MAX_REQUESTS = 2
COMPRESSED_MAX_TOKENS = 136   # per request
C4_TOPK = 4
COMPRESSED_PREFIX = {4: "model.layers.0.attn", 128: "model.layers.1.attn"}

COMPRESSED_CONFIG: dict[str, Any] = {
    **LAYER_CONFIG,
    "num_hidden_layers": 3,
    "index_topk": C4_TOPK,
    "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "compress_rope_theta": 160000.0,   # the compressed layers' RoPE base (the sliding-window layer's: rope_theta)
}


def make_compressed_vllm_config(model: str, backend: str | None = None) -> Any:
    """:func:`make_vllm_config` with vLLM's DeepSeek-V4 block size (256 tokens) for the compressed caches."""
    config = make_vllm_config(model, backend)
    config.cache_config.block_size = COMPRESSED_BLOCK
    return config


class _Group:
    """One KV-cache group of the layer: its cache layers, spec, builder and each request's blocks."""

    def __init__(self, layers: list[Any], spec: Any, builder: Any, num_blocks: int, gen: torch.Generator) -> None:
        self.layers, self.spec, self.builder = layers, spec, builder
        self.tokens_per_block = int(spec.block_size)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()
        self.blocks: list[list[int]] = []

    def slot(self, r: int, position: int) -> int:
        per = self.tokens_per_block
        return self.blocks[r][position // per] * per + position % per


def _bind(layer: Any, spec: Any, num_blocks: int, rows: int, row_bytes: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed ``[num_blocks, page_size_bytes]`` allocation bound to ``layer`` as ``[num_blocks, 1, rows, row]``
    of ``dtype`` (the page stride is the spec's page, which alignment may pad past ``rows * row``)."""
    page = int(spec.page_size_bytes)
    storage = torch.zeros(num_blocks, page, dtype=torch.uint8).view(dtype)
    size = dtype.itemsize
    layer.bind_kv_cache(torch.as_strided(storage, (num_blocks, 1, rows, row_bytes // size),
                                         (page // size, page // size, row_bytes // size, 1)))
    return storage


class CompressedLayerEngine:
    """A DeepSeek-V4 C4A (``ratio`` 4) or C128A (``ratio`` 128) attention layer vLLM's selector picks, with
    every cache it owns (SWA rows, compressed rows, compressor states; for C4A the indexer's MXFP4 keys
    and its compressor's states) and the metadata of each from the builder its backend names."""

    def __init__(self, vllm_config: Any, ratio: int, seed: int = 0) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v4.nvidia import model
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.vllm_config, self.ratio = vllm_config, ratio
        self.hf_config = vllm_config.model_config.hf_config
        self.gen = torch.Generator().manual_seed(seed)
        cpu = torch.device("cpu")
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
            cls = model._select_dsv4_attn_cls(vllm_config)
            topk_buffer = torch.full((MAX_TOKENS, self.hf_config.index_topk), -1, dtype=torch.int32)
            self.layer = cls(vllm_config, prefix=COMPRESSED_PREFIX[ratio], topk_indices_buffer=topk_buffer,
                             aux_stream_list=None)
            _init_weights(self.layer, self.gen)
            layer = self.layer
            if layer.compress_ratio != ratio:
                raise ValueError(f"layer {layer.prefix}: compress_ratio {layer.compress_ratio}, expected {ratio}")
            self.groups: dict[str, _Group] = {}

            def add(name: str, cache_layer: Any, spec: Any, rows: int, row_bytes: int, dtype: torch.dtype) -> None:
                num_blocks = COMPRESSED_MAX_REQUESTS * -(-COMPRESSED_MAX_TOKENS // int(spec.block_size))
                storage = _bind(cache_layer, spec, num_blocks, rows, row_bytes, dtype)
                builder_cls = cache_layer.get_attn_backend().get_builder_cls()
                # vLLM's runner passes the block-table width to builders that ask for it (the indexer's).
                extra = ({"block_table_width": -(-COMPRESSED_MAX_TOKENS // int(spec.block_size))}
                         if getattr(builder_cls, "requires_block_table_width", False) else {})
                builder = builder_cls(spec, [cache_layer.prefix], vllm_config, cpu, **extra)
                self.groups[name] = _Group([cache_layer], spec, builder, num_blocks, self.gen)
                self.groups[name].storage = storage

            swa = layer.swa_cache_layer
            swa_spec = swa.get_kv_cache_spec(vllm_config)
            add("swa", swa, swa_spec, 1, int(swa_spec.page_size_bytes), torch.uint8)
            spec = layer.get_kv_cache_spec(vllm_config)
            add("compressed", layer, spec, int(spec.num_states), 584, torch.uint8)
            state = layer.compressor.state_cache
            state_spec = state.get_kv_cache_spec(vllm_config)
            add("state", state, state_spec, int(state_spec.block_size), state.state_dim * 4, torch.float32)
            if layer.indexer is not None:
                k_cache = layer.indexer.k_cache
                k_spec = k_cache.get_kv_cache_spec(vllm_config)
                add("index_k", k_cache, k_spec, int(k_spec.num_states), k_cache.head_dim, torch.uint8)
                istate = layer.indexer.compressor.state_cache
                istate_spec = istate.get_kv_cache_spec(vllm_config)
                add("index_state", istate, istate_spec, int(istate_spec.block_size), istate.state_dim * 4,
                    torch.float32)
        self.cache = self.groups["swa"].storage
        self.hidden: list[torch.Tensor] = []

    def add_request(self, num_tokens: int) -> int:
        """A request with blocks for ``num_tokens`` positions in every group."""
        for group in self.groups.values():
            n = -(-num_tokens // group.tokens_per_block)
            group.blocks.append([group.free.pop() for _ in range(n)])
        self.hidden.append(torch.empty(0, self.hf_config.hidden_size, dtype=torch.bfloat16))
        return len(self.hidden) - 1

    def slot(self, r: int, position: int) -> int:
        """SWA slot of request ``r``'s ``position`` (what :func:`read_cache` reads)."""
        return self.groups["swa"].slot(r, position)

    def step(self, schedule: list[tuple[int, int]]) -> Step:
        """One forward of ``(request, new tokens)`` pairs; returns the step with the layer's output."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        step, requests, qsl, seq_lens = schedule_tokens(self.hidden, self.gen, self.hf_config.hidden_size, schedule)
        token_request, token_position = step.token_request, step.token_position
        positions = torch.tensor(token_position, dtype=torch.int64)
        metadata, slot_mappings = {}, {}
        for group in self.groups.values():
            width = max(len(group.blocks[r]) for r in requests)
            block_table = torch.zeros(len(requests), width, dtype=torch.int32)
            for i, r in enumerate(requests):
                block_table[i, : len(group.blocks[r])] = torch.tensor(group.blocks[r], dtype=torch.int32)
            slots = torch.tensor([group.slot(r, p) for r, p in zip(token_request, token_position)], dtype=torch.int64)
            common = CommonAttentionMetadata(
                query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=len(requests),
                num_actual_tokens=int(qsl[-1]), max_query_len=int((qsl[1:] - qsl[:-1]).max()),
            max_seq_len=int(seq_lens.max()),
                block_table_tensor=block_table, slot_mapping=slots, seq_lens_cpu_upper_bound=seq_lens.clone(),
                positions=positions,
            )
            built = group.builder.build(common_prefix_len=0, common_attn_metadata=common)
            for cache_layer in group.layers:
                metadata[cache_layer.prefix] = built
                slot_mappings[cache_layer.prefix] = slots
        with torch.no_grad(), set_forward_context(metadata, self.vllm_config, num_tokens=len(token_request),
                                                  slot_mapping=slot_mappings):
            step.output = self.layer(positions, step.hidden)
        return step


def register_cpu_mm_out_dtype() -> Any:
    """A CPU kernel for ``aten::mm.dtype`` (``torch.mm(a, b, out_dtype=...)``, CUDA-only in torch), which vLLM's
    DeepSeek-V4 layer uses for the compressors' fp32 ``kv_score`` projections: the product in float32 (the
    GPU's bf16 GEMM accumulates in fp32 too), cast to ``out_dtype``. Returns the ``torch.library.Library``
    holding it (the kernel is registered while that object lives; ``_destroy()`` removes it)."""
    lib = torch.library.Library("aten", "IMPL")

    def mm_dtype(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return (a.float() @ b.float()).to(out_dtype)

    lib.impl("mm.dtype", mm_dtype, "CPU")
    return lib


def gather_indexer_k(kv_cache: torch.Tensor, dst_k: torch.Tensor, dst_scale: torch.Tensor,
                         block_table: torch.Tensor, cu_seq_lens: torch.Tensor) -> None:
    """Torch stand-in for vLLM's ``cp_gather_indexer_k_quant_cache`` (a ``vllm._C`` CUDA op, absent from a
    CPU install): request ``b``'s first ``cu[b+1] - cu[b]`` rows of the indexer cache, in order, into ``dst_k``
    (FP8: ``[N, 128]`` e4m3; MXFP4: ``[N, 64]``) and ``dst_scale`` (``[N, 4]`` bytes); a page holds its rows'
    values, then their scales."""
    rows = kv_cache.shape[1]
    half, ns = dst_k.shape[-1] * dst_k.element_size(), dst_scale[0].numel() * dst_scale.element_size()
    cu = cu_seq_lens.tolist()
    for b in range(len(cu) - 1):
        for j in range(cu[b + 1] - cu[b]):
            page = kv_cache[int(block_table[b, j // rows])].reshape(-1)
            o = j % rows
            dst_k[cu[b] + j] = page[o * half : (o + 1) * half].view(dst_k.dtype)
            dst_scale[cu[b] + j] = page[rows * half + o * ns : rows * half + (o + 1) * ns].view(
                dst_scale.dtype).view(dst_scale.shape[1:])


def top_k_per_row_prefill(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, out: torch.Tensor,
                          num_rows: int, stride0: int, stride1: int, topk: int) -> None:
    """vLLM's ``top_k_per_row_prefill`` (a ``vllm._C`` CUDA op) through :func:`nsa_backend.topk_indices`:
    row ``i``'s ``topk`` best columns of ``[starts[i], ends[i])``, relative to ``starts[i]``, ``-1`` padded."""
    import nsa_backend

    idx = nsa_backend.topk_indices(logits[:num_rows].float().contiguous(), topk, starts[:num_rows].int(),
                                   ends[:num_rows].int())
    out[:num_rows, :topk] = torch.where(idx >= 0, idx - starts[:num_rows, None].int(), -1)


def read_compressed(engine: CompressedLayerEngine, r: int) -> torch.Tensor:
    """Request ``r``'s compressed keys as vLLM's compressor stored them: ``[L // ratio, 512]`` float32, decoded
    from the compressed cache bytes (block-split pages of ``256 / ratio`` rows, as :func:`read_cache`)."""
    group = engine.groups["compressed"]
    rows = int(group.spec.num_states)
    flat = group.storage
    out = []
    for i in range(engine.hidden[r].shape[0] // engine.ratio):
        page, off = flat[group.blocks[r][i // rows]], i % rows
        data = page[off * 576 : (off + 1) * 576]
        scales = page[rows * 576 + off * 8 : rows * 576 + off * 8 + 7].float()
        nope = data[:448].view(torch.float8_e4m3fn).float().view(7, 64) * torch.exp2(scales - 127)[:, None]
        out.append(torch.cat([nope.view(-1), data[448:576].clone().view(torch.bfloat16).float()]))
    return torch.stack(out) if out else torch.empty(0, 512)
