"""vLLM's own DeepSeek-V3.2 attention layer on the CPU, the batches it is served, and a plain-torch
reference of the same layer, for ``test_vllm_layer.py``.

:class:`LayerEngine` builds ``vllm.models.deepseek_v32.attention.DeepseekV32Attention`` (with its
``SparseAttnIndexer`` and MLA attention wrapper) on a tiny DeepSeek-V3.2-shaped config with random
weights, allocates the two paged caches the way vLLM sizes them (from the layers' KV-cache specs),
builds the attention metadata with the builders the layers name (nsa-backend's sparse-MLA builder
and vLLM's indexer builder) from vLLM's ``CommonAttentionMetadata``, and runs the layer's forward
under vLLM's forward context, step after step, as the model runner does.

:func:`reference_step` recomputes the step from the layer's weights in float32 with the formulas
written out here (RMSNorm / LayerNorm, YaRN RoPE, absorbed MLA, the indexer's e4m3 quantisation with
power-of-two scales, its ReLU logits, top-k, sparse softmax attention, output projection); the only
things it takes from the run are the top-k sets the indexer chose, after checking they are top-k
sets of the reference logits.

vLLM is imported inside the functions, so importing this module needs no vLLM.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import torch

from tests.integrations import vllm_fixtures as vf

PAGE = 64
NUM_BLOCKS = 8
LAYER_PREFIX = "model.layers.0.self_attn"
MLA_LAYER = f"{LAYER_PREFIX}.attn"
INDEXER_CACHE = f"{LAYER_PREFIX}.indexer.k_cache"
MAX_TOKENS = 256  # max_num_batched_tokens
MAX_MODEL_LEN = 1024
FP8_MAX = 448.0

# DeepSeek-V3.2's attention on a few heads: kv_lora_rank 512, rope 64, index heads 8 of dim 128,
# top-k 64 (so requests longer than 64 tokens have keys dropped), YaRN RoPE as in the checkpoint.
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
LAYER_CONFIG: dict[str, Any] = vf.dsa_model_config(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=128,
    kv_lora_rank=512,
    qk_nope_head_dim=64,
    qk_rope_head_dim=64,
    v_head_dim=64,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=64,
    num_hidden_layers=1,
    num_nextn_predict_layers=1,
    max_position_embeddings=MAX_MODEL_LEN,
    rope_theta=10000,
    rope_scaling=YARN,
)


def make_vllm_config(model: str, cache_dtype: str, num_speculative_tokens: int = 0) -> Any:
    """``VllmConfig`` of the model in directory ``model`` on the CPU; MTP drafts when
    ``num_speculative_tokens`` > 0 (decode rows then carry ``1 + num_speculative_tokens`` tokens)."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    model_config = ModelConfig(
        model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=MAX_MODEL_LEN
    )
    parallel_config = ParallelConfig()
    speculative_config = None
    if num_speculative_tokens:
        from vllm.config import SpeculativeConfig

        speculative_config = SpeculativeConfig(
            method="mtp",
            num_speculative_tokens=num_speculative_tokens,
            target_model_config=model_config,
            target_parallel_config=parallel_config,
        )
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=PAGE, cache_dtype=cache_dtype),
        device_config=DeviceConfig(device="cpu"),
        parallel_config=parallel_config,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=MAX_TOKENS, max_num_seqs=16, max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
        ),
        speculative_config=speculative_config,
    )


@dataclasses.dataclass
class Request:
    """One sequence: its blocks in each cache group and the hidden states of every position so far."""

    mla_blocks: list[int]
    indexer_blocks: list[int]
    hidden: torch.Tensor  # [L, hidden] bf16

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // PAGE] * PAGE + position % PAGE


@dataclasses.dataclass
class Step:
    """One forward step: the new tokens of each scheduled request (decodes first, as vLLM orders them)."""

    requests: list[int]
    query_lens: list[int]
    positions: torch.Tensor  # [T] int64
    hidden: torch.Tensor  # [T, hidden] bf16
    token_request: list[int]  # request of each token
    token_position: list[int]  # position of each token in its request
    output: torch.Tensor | None = None  # [T, hidden] bf16, the layer's output
    topk: torch.Tensor | None = None  # [T, index_topk] int32, the indexer's choice


def _init_weights(layer: torch.nn.Module, gen: torch.Generator) -> None:
    """Random weights: linear weights ~ N(0, 1/fan_in), norm weights ~ 1 + N(0, 0.1^2)."""
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if param.dim() == 2:
                values = torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1])
            elif name.endswith("bias"):
                values = 0.1 * torch.randn(param.shape, generator=gen)
            else:
                values = 1.0 + 0.1 * torch.randn(param.shape, generator=gen)
            param.copy_(values.to(param.dtype))


class LayerEngine:
    """vLLM's DeepSeek-V3.2 attention layer with ``attn_backend`` and its caches, served step by step."""

    def __init__(self, vllm_config: Any, attn_backend: type, seed: int = 0) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.models.deepseek_v32.attention import DeepseekV32Attention
        from vllm.utils.torch_utils import set_default_torch_dtype

        self.vllm_config = vllm_config
        self.hf_config = vllm_config.model_config.hf_config
        self.gen = torch.Generator().manual_seed(seed)
        self.topk_buffer = torch.full((MAX_TOKENS, self.hf_config.index_topk), -1, dtype=torch.int32)
        with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
            self.layer = DeepseekV32Attention(
                vllm_config, self.hf_config, prefix=LAYER_PREFIX, topk_indices_buffer=self.topk_buffer,
                attn_backend=attn_backend,
            )
            _init_weights(self.layer, self.gen)
            # What the model loader does once the checkpoint is in: split kv_b_proj into W_UK / W_UV.
            if inspect.signature(self.layer.process_weights_after_loading).parameters:
                self.layer.process_weights_after_loading(torch.bfloat16)
            else:
                self.layer.process_weights_after_loading()
            self.mla_spec = self.layer.get_kv_cache_spec(vllm_config)
            self.indexer_spec = self.layer.indexer.k_cache.get_kv_cache_spec(vllm_config)
            self.mla_cache = self._bind_cache(self.layer, self.mla_spec)
            self.indexer_cache = self._bind_cache(self.layer.indexer.k_cache, self.indexer_spec)
        self.builders: dict[str, tuple[Any, Any]] = {}
        self.add_builders("mtp" if vllm_config.speculative_config else "plain", vllm_config)
        self.requests: list[Request] = []
        # Blocks handed out in a scrambled order, and differently per cache group (vLLM keeps one
        # block table per KV-cache group), so mixing up tables or slots shows.
        self._free = {
            "mla": torch.randperm(NUM_BLOCKS, generator=self.gen).tolist(),
            "indexer": torch.randperm(NUM_BLOCKS, generator=self.gen).tolist(),
        }

    def _bind_cache(self, layer: Any, spec: Any) -> torch.Tensor:
        row_bytes = spec.page_size_bytes // spec.block_size
        cache = torch.zeros(NUM_BLOCKS, 1, spec.block_size, row_bytes, dtype=torch.uint8).view(spec.dtype)
        layer.bind_kv_cache(cache)
        return layer.kv_cache

    def add_builders(self, name: str, vllm_config: Any) -> None:
        """Metadata builders ``name`` for both cache groups, made from ``vllm_config`` the way vLLM's
        model runner makes them (the class each layer's backend names, the layer's KV-cache spec)."""
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(vllm_config):
            self.builders[name] = (
                self._builder(self.layer.get_attn_backend(), self.mla_spec, MLA_LAYER, vllm_config),
                self._builder(
                    self.layer.indexer.k_cache.get_attn_backend(), self.indexer_spec, INDEXER_CACHE, vllm_config
                ),
            )

    def _builder(self, backend: Any, spec: Any, layer_name: str, vllm_config: Any) -> Any:
        builder_cls = backend.get_builder_cls()
        kwargs = {}
        if "block_table_width" in inspect.signature(builder_cls.__init__).parameters:
            kwargs["block_table_width"] = MAX_MODEL_LEN // PAGE
        return builder_cls(spec, [layer_name], vllm_config, torch.device("cpu"), **kwargs)

    def add_request(self, num_blocks: int) -> int:
        """A new request with ``num_blocks`` blocks in each cache group; returns its index."""
        self.requests.append(
            Request(
                mla_blocks=[self._free["mla"].pop() for _ in range(num_blocks)],
                indexer_blocks=[self._free["indexer"].pop() for _ in range(num_blocks)],
                hidden=torch.empty(0, self.hf_config.hidden_size, dtype=torch.bfloat16),
            )
        )
        return len(self.requests) - 1

    def _common_metadata(self, step: Step, group: str) -> Any:
        from vllm.v1.attention.backend import CommonAttentionMetadata

        qsl = torch.zeros(len(step.requests) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(step.query_lens, dtype=torch.int32).cumsum(0)
        seq_lens = torch.tensor([self.requests[r].hidden.shape[0] for r in step.requests], dtype=torch.int32)
        width = MAX_MODEL_LEN // PAGE
        block_table = torch.zeros(len(step.requests), width, dtype=torch.int32)
        for i, r in enumerate(step.requests):
            blocks = getattr(self.requests[r], f"{group}_blocks")
            block_table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        slots = torch.tensor(
            [
                self.requests[r].slot(getattr(self.requests[r], f"{group}_blocks"), p)
                for r, p in zip(step.token_request, step.token_position)
            ],
            dtype=torch.int64,
        )
        return CommonAttentionMetadata(
            query_start_loc=qsl,
            query_start_loc_cpu=qsl.clone(),
            seq_lens=seq_lens,
            num_reqs=len(step.requests),
            num_actual_tokens=int(qsl[-1]),
            max_query_len=max(step.query_lens),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slots,
            seq_lens_cpu_upper_bound=seq_lens.clone(),
        )

    def step(self, schedule: list[tuple[int, int]], builders: str) -> Step:
        """Run one forward of ``(request, new tokens)`` pairs with metadata from builders ``builders``;
        returns the step with the layer's output and the indexer's top-k rows."""
        from vllm.forward_context import set_forward_context

        hidden_size = self.hf_config.hidden_size
        requests, query_lens, hidden, token_request, token_position = [], [], [], [], []
        for r, n in schedule:
            req = self.requests[r]
            start = req.hidden.shape[0]
            new = torch.randn(n, hidden_size, generator=self.gen).to(torch.bfloat16)
            req.hidden = torch.cat([req.hidden, new])
            requests.append(r)
            query_lens.append(n)
            hidden.append(new)
            token_request += [r] * n
            token_position += list(range(start, start + n))
        step = Step(
            requests=requests,
            query_lens=query_lens,
            positions=torch.tensor(token_position, dtype=torch.int64),
            hidden=torch.cat(hidden),
            token_request=token_request,
            token_position=token_position,
        )
        cm_mla = self._common_metadata(step, "mla")
        cm_indexer = self._common_metadata(step, "indexer")
        mla_builder, indexer_builder = self.builders[builders]
        attn_metadata = {
            MLA_LAYER: mla_builder.build(common_prefix_len=0, common_attn_metadata=cm_mla),
            INDEXER_CACHE: indexer_builder.build(common_prefix_len=0, common_attn_metadata=cm_indexer),
        }
        slot_mapping = {MLA_LAYER: cm_mla.slot_mapping, INDEXER_CACHE: cm_indexer.slot_mapping}
        with torch.no_grad(), set_forward_context(
            attn_metadata, self.vllm_config, num_tokens=len(token_request), slot_mapping=slot_mapping
        ):
            step.output = self.layer(step.positions, step.hidden)
        step.topk = self.topk_buffer[: len(token_request)].clone()
        return step


# ---------------------------------------------------------------------------------------------
# Plain-torch reference
# ---------------------------------------------------------------------------------------------


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 where vLLM stores an intermediate in bf16, back to float32 for the math."""
    return x.to(torch.bfloat16).float()


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _bf16(x.float() @ weight.float().T)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight.float()


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).square().mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * weight.float() + bias.float()


def yarn_cos_sin(positions: torch.Tensor, rope: dict[str, Any], theta: float, dim: int) -> tuple[torch.Tensor, ...]:
    """YaRN RoPE angles (Peng et al.): frequencies interpolated by ``factor`` below the correction
    range, extrapolated above it, a linear ramp between; cos / sin scaled by
    ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``. Returns ``cos, sin`` ``[T, dim/2]``."""
    factor = float(rope["factor"])
    original = float(rope["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(rope["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(rope["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_freq = 1.0 / (factor * pos_freqs) * ramp + 1.0 / pos_freqs * (1 - ramp)

    def mscale(m: float) -> float:
        return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0

    scale = mscale(float(rope["mscale"])) / mscale(float(rope["mscale_all_dim"]))
    # float32 angles, as the table vLLM builds (its bf16 rounding then matches bit for bit).
    angles = positions.float()[:, None] * inv_freq[None, :]
    # vLLM keeps the angle table in the model dtype (bf16).
    return _bf16(angles.cos() * scale), _bf16(angles.sin() * scale)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J RoPE on pairs ``(x[2i], x[2i+1])`` (MLA q_pe / k_pe); ``x`` ``[T, ..., dim]``."""
    shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rope_neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE (halves rotated together) on the first ``2 * cos.shape[1]`` values (indexer q / k)."""
    shape = [cos.shape[0]] + [1] * (x.dim() - 2) + [cos.shape[1]]
    cos, sin = cos.view(shape), sin.view(shape)
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def quantise_e4m3_pow2(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values with one power-of-two scale per row of the last dim (``amax / 448`` rounded up,
    floored at ``1e-4 / 448``). Returns the dequantised values and the scales ``[..., 1]``."""
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1, keepdim=True).clamp(min=1e-4) / FP8_MAX)))
    values = (x / scale).to(torch.float8_e4m3fn).float()
    return values, scale


@dataclasses.dataclass
class RequestTensors:
    """Every position of one request, recomputed from the weights: attention keys and index keys."""

    latent: torch.Tensor  # [L, 512] kv_c normed, fp8_ds_mla-quantised and dequantised
    k_rope: torch.Tensor  # [L, 64] k_pe after RoPE (bf16)
    index_k: torch.Tensor  # [L, 128] dequantised e4m3 index keys (scale folded in)


@torch.no_grad()
def request_tensors(engine: LayerEngine, r: int, kv_format: str) -> RequestTensors:
    layer, cfg = engine.layer, engine.hf_config
    h = engine.requests[r].hidden.float()
    positions = torch.arange(h.shape[0])
    qkv = _linear(h, layer.fused_qkv_a_proj.weight)
    kv_c = qkv[:, cfg.q_lora_rank : cfg.q_lora_rank + cfg.kv_lora_rank]
    k_pe = qkv[:, cfg.q_lora_rank + cfg.kv_lora_rank :]
    latent = _rms_norm(kv_c, layer.kv_a_layernorm.weight, cfg.rms_norm_eps)
    if kv_format == "fp8_ds_mla":
        tiles, scales = quantise_e4m3_pow2(latent.view(-1, 4, 128))
        latent = (tiles * scales).view(-1, 512)
    else:
        latent = _bf16(latent)
    cos, sin = yarn_cos_sin(positions, YARN, LAYER_CONFIG["rope_theta"], cfg.qk_rope_head_dim)
    k_rope = _bf16(rope_interleaved(k_pe, cos, sin))
    kw = _linear(h, layer.indexer.wk_weights_proj.weight)
    index_k = _layer_norm(
        kw[:, : cfg.index_head_dim], layer.indexer.k_norm.weight, layer.indexer.k_norm.bias, 1e-6
    )
    index_k = rope_neox(index_k, cos, sin)
    values, scales = quantise_e4m3_pow2(index_k)
    return RequestTensors(latent=latent, k_rope=k_rope, index_k=values * scales)


def read_caches(engine: LayerEngine, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Request ``r``'s rows decoded from the two caches: latent ``[L, 512]`` (fp8_ds_mla: e4m3 times
    the tile's fp32 scale; bf16 cache: as stored), RoPE part ``[L, 64]`` and index keys ``[L, 128]``
    (e4m3 times the token's fp32 scale, stored after the block's values)."""
    req = engine.requests[r]
    length = req.hidden.shape[0]
    latent, k_rope, index_k = [], [], []
    for p in range(length):
        slot = req.slot(req.mla_blocks, p)
        row = engine.mla_cache[slot // PAGE, slot % PAGE]
        if row.dtype == torch.uint8:
            values = row[:512].view(torch.float8_e4m3fn).float().view(4, 128)
            scales = row[512:528].clone().view(torch.float32)
            latent.append((values * scales[:, None]).view(-1))
            k_rope.append(row[528:656].clone().view(torch.bfloat16).float())
        else:
            latent.append(row[:512].float())
            k_rope.append(row[512:576].float())
        slot = req.slot(req.indexer_blocks, p)
        page = engine.indexer_cache[slot // PAGE].reshape(-1)
        d, off = engine.hf_config.index_head_dim, slot % PAGE
        values = page[off * d : (off + 1) * d].view(torch.float8_e4m3fn).float()
        scale = page[PAGE * d + 4 * off : PAGE * d + 4 * off + 4].clone().view(torch.float32)
        index_k.append(values * scale)
    return torch.stack(latent), torch.stack(k_rope), torch.stack(index_k)


def check_topk_choice(chosen: torch.Tensor, scores: torch.Tensor, topk: int, where: str) -> torch.Tensor:
    """``chosen`` ``[topk]`` (``-1`` padded) must be a top-``topk`` set of ``scores`` ``[n]`` (any order,
    near-ties either way); returns the chosen positions."""
    n = scores.numel()
    picked = chosen[chosen >= 0].long()
    assert picked.numel() == min(topk, n), f"{where}: {picked.numel()} indices for {n} visible keys"
    assert picked.unique().numel() == picked.numel(), f"{where}: repeated index"
    assert int(picked.max()) < n, f"{where}: index {int(picked.max())} beyond the {n} visible keys"
    if n <= topk:
        return picked
    kth = torch.topk(scores, topk).values[-1]
    tol = 1e-3 * float(scores.abs().max()) + 1e-6
    assert float(scores[picked].min()) >= float(kth) - tol, f"{where}: a key outside the top-{topk} was chosen"
    return picked


@torch.no_grad()
def reference_step(engine: LayerEngine, step: Step, kv_format: str) -> torch.Tensor:
    """The step's layer output ``[T, hidden]`` (float32) from the weights; checks the indexer's choices."""
    layer, cfg = engine.layer, engine.hf_config
    nope, rope_dim, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    heads, n_index, d_index, topk = cfg.num_attention_heads, cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
    h = step.hidden.float()
    cos, sin = yarn_cos_sin(step.positions, YARN, LAYER_CONFIG["rope_theta"], rope_dim)

    # Queries: q_a -> RMSNorm -> q_b; the nope part absorbed into the latent space through W_UK.
    qkv = _linear(h, layer.fused_qkv_a_proj.weight)
    q_c = _bf16(_rms_norm(qkv[:, : cfg.q_lora_rank], layer.q_a_layernorm.weight, cfg.rms_norm_eps))
    q = _linear(q_c, layer.q_b_proj.weight).view(-1, heads, nope + rope_dim)
    kv_b = layer.kv_b_proj.weight.float().view(heads, nope + v_dim, cfg.kv_lora_rank)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]  # [H, nope, 512], [H, v, 512]
    q_latent = _bf16(torch.einsum("thn,hnl->thl", q[..., :nope], w_uk))
    q_rope = _bf16(rope_interleaved(q[..., nope:], cos, sin))

    # Indexer queries: e4m3 per (token, head) with power-of-two scales, the scale folded into the weights.
    index_q = rope_neox(_linear(q_c, layer.indexer.wq_b.weight).view(-1, n_index, d_index), cos, sin)
    index_q, q_scale = quantise_e4m3_pow2(index_q)
    kw = _linear(h, layer.indexer.wk_weights_proj.weight)
    index_w = kw[:, d_index:] * q_scale[..., 0] * d_index**-0.5 * n_index**-0.5

    mscale = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1.0
    sm_scale = (nope + rope_dim) ** -0.5 * mscale * mscale
    keys = {r: request_tensors(engine, r, kv_format) for r in set(step.token_request)}
    latent_out = torch.empty(h.shape[0], heads, cfg.kv_lora_rank)
    for t, (r, p) in enumerate(zip(step.token_request, step.token_position)):
        k = keys[r]
        logits = (torch.relu(index_q[t] @ k.index_k[: p + 1].T) * index_w[t][:, None]).sum(0)
        picked = check_topk_choice(step.topk[t], logits, topk, f"token {t} (request {r}, position {p})")
        scores = (q_latent[t] @ k.latent[picked].T + q_rope[t] @ k.k_rope[picked].T) * sm_scale
        latent_out[t] = torch.softmax(scores, dim=-1) @ k.latent[picked]
    # Value up-projection through W_UV, then o_proj.
    attn = _bf16(torch.einsum("thl,hvl->thv", _bf16(latent_out), w_uv)).reshape(h.shape[0], heads * v_dim)
    return attn @ layer.o_proj.weight.float().T


def rounding_float_conversion(original: Any) -> Any:
    """A replacement for the Triton interpreter's ``_convert_float`` whose narrowing conversions of
    float32 to e4m3 and to bf16 round to nearest even, as the GPU instructions do (the interpreter's
    own drops the carry of a rounded-up mantissa, so 1.95 becomes 1.0 in e4m3, and truncates to
    bf16); every other conversion is left to ``original``."""
    import numpy as np
    import triton.language as tl

    targets = {
        tl.float8e4nv: (torch.float8_e4m3fn, torch.uint8, np.uint8),
        tl.bfloat16: (torch.bfloat16, torch.int16, np.uint16),
    }

    def convert(input: Any, input_dtype: Any, output_dtype: Any, rounding_mode: Any) -> Any:
        target = targets.get(output_dtype)
        if target is None or input_dtype != tl.float32:
            return original(input, input_dtype, output_dtype, rounding_mode)
        dtype, bits, np_bits = target
        values = torch.from_numpy(np.ascontiguousarray(input, dtype=np.float32))
        return values.to(dtype).view(bits).numpy().view(np_bits).reshape(input.shape)

    return convert
