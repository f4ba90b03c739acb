"""SGLang's own DeepSeek DSA attention layer on CPU, and a plain-torch reference of it.

Used by ``test_sglang_layer.py``. Everything here reads SGLang 0.5.23's installed code; nothing is
copied from it. :func:`cpu_replacements` lists (and installs) every SGLang op replaced because it
has no CPU path; all other SGLang code (the layer, ``forward_mla.py``, the DSA ``Indexer``, the
memory pools, ``DeepseekSparseAttnBackend``'s metadata, the server-argument resolution) runs as is.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import math
import os
import socket
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

PAGE = 64
HIDDEN = 256
HEADS = 4
D_NOPE, D_ROPE, D_V = 32, 64, 32
Q_LORA, KV_LORA = 64, 512
IDX_HEADS, IDX_DIM = 8, 128
TOPK = 64
DRAFT = 3  # MTP: tokens per request of a target-verify / draft-extend batch
MAX_CTX = 192
NUM_PAGES = 8
ROPE_SCALING = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
ROPE_THETA = 10000.0
MAX_POSITIONS = 4096
RMS_EPS = 1e-6
LN_EPS = 1e-6  # SGLang's LayerNorm default, used by the indexer's k_norm

MODEL_ARCHS = {"v32": "DeepseekV32ForCausalLM", "glm5": "GlmMoeDsaForCausalLM"}
SM_CAPABILITY = {"sm90": (9, 0), "sm100": (10, 0), "sm120": (12, 0)}


def hf_config(model: str) -> Any:
    """A tiny random-weight HF config of ``model`` (``"v32"`` / ``"glm5"``) with the DSA indexer."""
    from transformers import PretrainedConfig

    return PretrainedConfig(
        architectures=[MODEL_ARCHS[model]],
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        qk_nope_head_dim=D_NOPE,
        qk_rope_head_dim=D_ROPE,
        v_head_dim=D_V,
        q_lora_rank=Q_LORA,
        kv_lora_rank=KV_LORA,
        rms_norm_eps=RMS_EPS,
        index_n_heads=IDX_HEADS,
        index_head_dim=IDX_DIM,
        index_topk=TOPK,
        rope_theta=ROPE_THETA,
        max_position_embeddings=MAX_POSITIONS,
        rope_scaling=dict(ROPE_SCALING),
        num_hidden_layers=1,
    )


# ---------------------------------------------------------------------------------------------
# Server start: SGLang's argument parsing and resolution pipeline, the GPU capability forced
# ---------------------------------------------------------------------------------------------

DENSE_THRESHOLD_ENV = "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"


def launch_server(
    monkeypatch,
    config_dir: str,
    major: int,
    *flags: str,
    backend: str | None = "nsa_backend",
    full: bool = True,
) -> Any:
    """Server arguments as a launch on an SM``major``x GPU resolves and checks them.

    Parses ``--model-path config_dir --device cuda [--attention-backend backend] *flags`` with SGLang's
    ``prepare_server_args``, runs SGLang's ``ServerArgs.resolve_once()`` (its whole resolution pipeline,
    with the resolution hooks registered by the plugin, e.g. nsa-backend's wrapper of
    ``handle_model_specific_adjustments``) with ``torch.cuda.get_device_capability`` returning
    ``(major, 0)``, then ``ServerArgs.check_server_args`` as the plugin wraps it: the order of a real
    launch. nsa-backend validates its choice for the same GPU (``NSA_BACKEND_FORCE_ARCH``).
    ``full=False``: only SGLang's two DSA passes, the plugin's step after them and nsa-backend's check
    (for flags SGLang's own resolution or checks refuse earlier in a full launch). The served names
    are the plugin's (:func:`~nsa_backend_integrations.sglang.plugin.served_names`). Raises what the
    launch raises.
    """
    from sglang.srt.arg_groups import overrides
    from sglang.srt.server_args import prepare_server_args

    from nsa_backend.routing import reset_config
    from nsa_backend_integrations.sglang import plugin

    # SGLang's DSA resolution writes this variable into os.environ; record its absence so the
    # teardown removes it again.
    if DENSE_THRESHOLD_ENV not in os.environ:
        monkeypatch.setenv(DENSE_THRESHOLD_ENV, "0")
        monkeypatch.delenv(DENSE_THRESHOLD_ENV)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (major, 0))
    monkeypatch.setenv("NSA_BACKEND_FORCE_ARCH", f"sm{major}0")
    reset_config()
    # The device is what SGLang detects on a GPU machine; this one has none.
    argv = ["--model-path", config_dir, "--device", "cuda", *flags]
    if backend is not None:
        argv += ["--attention-backend", backend]
    args = prepare_server_args(argv)
    if full:
        args.resolve_once()
        args.check_server_args()
        return args
    overrides.run_post_process_pass(args, overrides._dsa_kv_cache_dtype_default)
    overrides.run_post_process_pass(args, overrides._dsa_split_backend_resolution)
    plugin.resolve_scaled_fp8_layout(args)
    plugin.validate_server_args(args)
    return args


def model_config_dir(model: str, root: str) -> str:
    """A directory under ``root`` holding ``config.json`` of the tiny ``model`` (what ``--model-path`` reads)."""
    path = os.path.join(root, model)
    os.makedirs(path, exist_ok=True)
    config = hf_config(model).to_dict()
    config["model_type"] = {"v32": "deepseek_v32", "glm5": "glm_moe_dsa"}[model]
    config["num_key_value_heads"] = HEADS
    config["torch_dtype"] = "bfloat16"
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def resolved_dsa_args(server_args: Any) -> dict[str, Any]:
    """``kv_cache_dtype``, ``dsa_prefill_backend`` and ``dsa_decode_backend`` as SGLang resolved them."""
    from sglang.srt.arg_groups.model_override_base import resolved_view

    view = resolved_view(server_args)
    return {name: getattr(view, name) for name in ("kv_cache_dtype", "dsa_prefill_backend", "dsa_decode_backend")}


# ---------------------------------------------------------------------------------------------
# Ops without a CPU path, replaced by their torch equivalent
# ---------------------------------------------------------------------------------------------


def _hadamard(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Sylvester-ordered Walsh-Hadamard transform of the last dim, times ``scale``."""
    n = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return ((x.float() @ h) * scale).to(x.dtype)


def _deepseek_rope_native(original):
    """``DeepseekScalingRotaryEmbedding.forward_native`` with the neox branch's broadcast fixed.

    SGLang's native neox branch repeats ``cos`` / ``sin`` as ``[1, T, D]`` and so broadcasts a
    ``[T, H, D]`` query to ``[1, T, H, D]`` (CUDA runs a fused kernel instead); the GPT-J branch
    is kept as SGLang has it.
    """

    def forward_native(self, positions, query, key, offsets=None, *args, **kwargs):
        if not self.is_neox_style:
            return original(self, positions, query, key, offsets, *args, **kwargs)
        pos = positions + offsets if offsets is not None else positions
        cos, sin = self.cos_sin_cache[pos].float().chunk(2, dim=-1)
        cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            c, s = (cos[:, None], sin[:, None]) if x.dim() == 3 else (cos, sin)
            rot = x[..., : self.rotary_dim].float()
            x1, x2 = rot.chunk(2, dim=-1)
            out = rot * c + torch.cat([-x2, x1], -1) * s
            return torch.cat([out.to(x.dtype), x[..., self.rotary_dim :]], -1)

        return rotate(query), rotate(key)

    return forward_native


def _act_quant(x: torch.Tensor, block_size: int = 128, scale_fmt: str | None = None):
    """``act_quant``: e4m3 values and one fp32 scale per ``block_size`` values (``amax / 448``, or
    its power-of-two ceiling when ``scale_fmt`` is given; ``amax`` floored at 1e-4)."""
    blocks = x.float().unflatten(-1, (-1, block_size))
    amax = blocks.abs().amax(-1).clamp(min=1e-4)
    scale = amax / 448.0
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    values = (blocks / scale[..., None]).clamp(-448.0, 448.0).flatten(-2).to(torch.float8_e4m3fn)
    return values, scale


def _seqlens_expand(extend_seq_lens, seq_lens, total_len, max_q_len):
    """``seqlens_expand_triton``: the causal key count of every query row (row j of a request with
    ``n`` new tokens and ``s`` keys sees ``s - n + j + 1``)."""
    rows = [
        torch.arange(kv - q + 1, kv + 1, dtype=torch.int32)
        for q, kv in zip(extend_seq_lens.tolist(), seq_lens.tolist())
    ]
    return torch.cat(rows).clamp(min=0).to(seq_lens.device)


def _topk_ragged(self, enable_dual_stream, forward_batch, layer_id, q_fp8, weights, metadata, topk_result=None):
    """``Indexer._get_topk_ragged`` without its CUDA device-index / memory-budget guard (it asserts
    an indexed CUDA device before sizing logits chunks): the same unchunked sequence of SGLang calls
    (pool read of the index keys, the resolved ``fp8_mqa_logits``, init/local masking, the backend
    metadata's ``topk_transform``)."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    pool = dsa_indexer.get_token_to_kv_pool()
    lens_cpu = metadata.get_indexer_seq_len_cpu()
    k_fp8, k_scale = pool.get_index_k_scale_buffer(
        layer_id,
        metadata.get_indexer_seq_len(),
        metadata.get_logical_page_table(),
        int(lens_cpu.sum()),
        int(lens_cpu.max()),
    )
    kv = (k_fp8.view(torch.float8_e4m3fn), k_scale.view(torch.float32).squeeze(-1))
    ks, ke = metadata.get_indexer_kvcache_range()
    rows = ks.shape[0]
    q, w, _ = self._pad_heads_for_deep_gemm(q_fp8[:rows], weights.squeeze(-1)[:rows])
    logits = dsa_indexer.resolve_fp8_mqa_logits_fn()(q, kv, w, ks, ke, clean_logits=False)
    self._mask_init_and_local_tokens(logits, metadata.get_seqlens_expanded(), ks)
    out = torch.full((q_fp8.shape[0], self.index_topk), -1, dtype=torch.int32)
    out[:rows] = metadata.topk_transform(logits, self.index_topk, ks=ks)
    return out


def cpu_replacements(monkeypatch) -> list[str]:
    """Replace the SGLang ops that have no CPU path by their torch equivalent; returns their names.

    SGLang's Triton index-K cache writer and reader run as they are, in Triton's CPU interpreter.
    """
    import sglang.kernels.ops.quantization.act_quant_triton as act_quant_triton
    import sglang.kernels.ops.quantization.hadamard as hadamard
    import sglang.srt.layers.rotary_embedding.base as rope_base
    from sglang.srt.layers.attention import dsa_backend
    from sglang.srt.layers.attention.dsa import dsa_indexer
    from sglang.srt.layers.rotary_embedding import rope_variant

    indexer = dsa_indexer.Indexer
    rope = rope_variant.DeepseekScalingRotaryEmbedding
    replaced = {
        # the CPU rope path (otherwise vLLM's compiled rotary op is imported)
        "rotary_embedding.base._is_cpu": (rope_base, "_is_cpu", True),
        "DeepseekScalingRotaryEmbedding.forward_native (neox broadcast)": (
            rope,
            "forward_native",
            _deepseek_rope_native(rope.forward_native),
        ),
        # CUDA-JIT Hadamard transform
        "kernels.ops.quantization.hadamard.hadamard_transform": (hadamard, "hadamard_transform", _hadamard),
        # Triton, but the interpreter's fp32 -> e4m3 store drops the mantissa carry (124 -> 64)
        "kernels.ops.quantization.act_quant_triton.act_quant": (act_quant_triton, "act_quant", _act_quant),
        # the indexer's CUDA dispatch, its platform gate, and its CUDA-only ops
        "Indexer.forward_native -> Indexer.forward_cuda": (indexer, "forward_native", indexer.forward_cuda),
        "dsa_indexer.can_use_dsa_fused_store (CUDA-JIT fused quant+store -> act_quant + pool write)": (
            dsa_indexer,
            "can_use_dsa_fused_store",
            lambda *a, **k: False,
        ),
        "Indexer._weights_proj_bf16_in_fp32_out (torch.mm out_dtype is CUDA-only)": (
            indexer,
            "_weights_proj_bf16_in_fp32_out",
            lambda self, x: x.float() @ self.weights_proj.weight.float().t(),
        ),
        "Indexer._get_topk_ragged (CUDA device-index guard)": (indexer, "_get_topk_ragged", _topk_ragged),
        # Triton helper of the speculative metadata that is launched through a CUDA-only wrapper
        "dsa_backend.seqlens_expand_triton": (dsa_backend, "seqlens_expand_triton", _seqlens_expand),
    }
    for module, name, value in replaced.values():
        monkeypatch.setattr(module, name, value)
    # The cos/sin table in fp32, as on CUDA (on CPU SGLang would cast it to the model dtype).
    monkeypatch.setenv("SGLANG_ROPE_CACHE_FP32", "1")
    return list(replaced)


def open_indexer_gate(monkeypatch, layer: Any) -> None:
    """``dsa_indexer._is_cuda = True`` once the layer is built: ``Indexer.forward_cuda`` refuses
    other platforms. The CUDA constructor would ask DeepGEMM for the SM count, so the layer is
    built without it and given the SM-count fields the CUDA constructor sets."""
    from sglang.srt.layers.attention.dsa import dsa_indexer

    monkeypatch.setattr(dsa_indexer, "_is_cuda", True)
    layer.indexer.sm_count = 8
    layer.indexer.half_device_sm_count = 8


# ---------------------------------------------------------------------------------------------
# Process setup: published server arguments, gloo groups, plugin registration
# ---------------------------------------------------------------------------------------------


_BASE: Any = None


def init_process() -> None:
    """Publish a base config and build single-process gloo groups (once per process)."""
    global _BASE
    if _BASE is not None:
        return
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import get_context, get_parallel

    _BASE = get_context().override_server_args(device="cpu", page_size=PAGE)
    _BASE.install()
    if not parallel_state.model_parallel_is_initialized():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            backend="gloo",
        )
        parallel_state.initialize_model_parallel(backend="gloo")
    try:
        stamped = get_parallel().attn_dcp_rank is not None
    except RuntimeError:  # not stamped by a single-process gloo init
        stamped = False
    if not stamped:
        get_parallel().override_permanently(attn_dcp_rank=0)


@contextlib.contextmanager
def published(typed: dict[str, Any], resolved: dict[str, Any]) -> Iterator[Any]:
    """Publish server arguments for the duration of a case: ``typed`` as the user's command line
    (raw fields, and their resolution), ``resolved`` as what SGLang's resolution declared (the raw
    fields keep their defaults, as in a server)."""
    import msgspec
    from sglang.srt.runtime_context import get_context

    fields = {"device": "cpu", "page_size": PAGE, **typed, **resolved}
    override = get_context().override_server_args(**fields)
    server_args = override.install()
    for name, value in typed.items():
        msgspec.Struct.__setattr__(server_args, name, value)
    try:
        yield server_args
    finally:
        override.restore()


@contextlib.contextmanager
def plugin_registered(monkeypatch, takeover: bool) -> Iterator[None]:
    """Run the plugin's real ``register()``; every registration is undone on exit."""
    from sglang.srt.arg_groups import choices, resolution_hooks
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.model_executor import model_runner
    from sglang.srt.models.deepseek_common import attention_backend_handler, utils
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    from nsa_backend_integrations.sglang import kernels, plugin

    monkeypatch.setattr(attention_registry, "ATTENTION_BACKENDS", dict(attention_registry.ATTENTION_BACKENDS))
    registry = attention_backend_handler.AttentionBackendRegistry
    monkeypatch.setattr(registry, "_handlers", dict(registry._handlers))
    monkeypatch.setattr(DraftBackendFactory, "_create_backend", DraftBackendFactory._create_backend)
    monkeypatch.setattr(ServerArgs, "check_server_args", ServerArgs.check_server_args)
    try:
        import deep_gemm

        for name in kernels.DEEP_GEMM_FUNCTIONS:
            if hasattr(deep_gemm, name):
                monkeypatch.setattr(deep_gemm, name, getattr(deep_gemm, name))
    except Exception:  # DeepGEMM's CUDA library may not load on CPU: nothing to restore then
        pass
    monkeypatch.setattr(kernels, "_deep_gemm_active", kernels._deep_gemm_active)
    # the plugin's wrapper of SGLang's resolution step (registered once per process)
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})
    for name in ("_registered", "_served", "_settings"):
        monkeypatch.setattr(plugin, name, getattr(plugin, name))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setenv("NSA_BACKEND_SGLANG_TAKEOVER", "1" if takeover else "0")
    monkeypatch.delenv("NSA_BACKEND_CONFIG", raising=False)
    # Lists the model code imported by name (restored in place, not rebound).
    lists = [
        getattr(owner, name, None)
        for owner, name in (
            (utils, "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS"),
            (choices, "ATTENTION_BACKEND_CHOICES"),
            (model_runner, "MLA_ATTENTION_BACKENDS"),
        )
    ]
    saved = [(lst, list(lst)) for lst in lists if isinstance(lst, list)]
    try:
        plugin.register()
        yield
    finally:
        for lst, items in saved:
            lst[:] = items


# ---------------------------------------------------------------------------------------------
# The layer, its pools, its backend, its batches
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Weights:
    """The layer's weights in fp32, read back from SGLang's modules."""

    qkv_a: torch.Tensor  # [Q_LORA + KV_LORA + D_ROPE, HIDDEN]
    q_a_norm: torch.Tensor  # [Q_LORA]
    kv_a_norm: torch.Tensor  # [KV_LORA]
    q_b: torch.Tensor  # [HEADS * (D_NOPE + D_ROPE), Q_LORA]
    kv_b: torch.Tensor  # [HEADS * (D_NOPE + D_V), KV_LORA]
    o: torch.Tensor  # [HIDDEN, HEADS * D_V]
    idx_q_b: torch.Tensor  # [IDX_HEADS * IDX_DIM, Q_LORA]
    idx_k: torch.Tensor  # [IDX_DIM, HIDDEN]
    idx_k_norm_w: torch.Tensor  # [IDX_DIM]
    idx_k_norm_b: torch.Tensor  # [IDX_DIM]
    idx_w: torch.Tensor  # [IDX_HEADS, HIDDEN]


def build_layer(model: str, seed: int = 0):
    """SGLang's ``DeepseekV2AttentionMLA`` (with its DSA ``Indexer``) with random weights, in bf16,
    and the absorbed ``w_kc`` / ``w_vc`` SGLang derives from ``kv_b_proj`` when loading weights."""
    from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA

    cfg = hf_config(model)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the model dtype; the indexer keeps its own dtypes
    try:
        layer = DeepseekV2AttentionMLA(
            cfg,
            HIDDEN,
            HEADS,
            D_NOPE,
            D_ROPE,
            D_V,
            Q_LORA,
            KV_LORA,
            rope_theta=ROPE_THETA,
            rope_scaling=dict(ROPE_SCALING),
            max_position_embeddings=MAX_POSITIONS,
            layer_id=0,
            prefix="model.layers.0.self_attn",
        )
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name and name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
        w_kc, w_vc = layer.kv_b_proj.weight.unflatten(0, (HEADS, D_NOPE + D_V)).split([D_NOPE, D_V], dim=1)
        layer.w_kc = w_kc.contiguous()  # [H, D_NOPE, KV_LORA]
        layer.w_vc = w_vc.transpose(1, 2).contiguous()  # [H, KV_LORA, D_V]
    idx = layer.indexer
    weights = Weights(
        qkv_a=layer.fused_qkv_a_proj_with_mqa.weight.float(),
        q_a_norm=layer.q_a_layernorm.weight.float(),
        kv_a_norm=layer.kv_a_layernorm.weight.float(),
        q_b=layer.q_b_proj.weight.float(),
        kv_b=layer.kv_b_proj.weight.float(),
        o=layer.o_proj.weight.float(),
        idx_q_b=idx.wq_b.weight.float(),
        idx_k=idx.wk.weight.float(),
        idx_k_norm_w=idx.k_norm.weight.float(),
        idx_k_norm_b=idx.k_norm.bias.float(),
        idx_w=idx.weights_proj.weight.float(),
    )
    return layer, weights


class Runner:
    """The model-runner fields SGLang's ``DeepseekSparseAttnBackend`` reads, with SGLang's own pools."""

    def __init__(self, model: str, kv_dtype: torch.dtype, server_args: Any, page_tables: list[list[int]]):
        from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

        cfg = hf_config(model)
        self.device = "cpu"
        self.page_size = PAGE
        self.model_config = SimpleNamespace(
            hf_config=cfg,
            context_len=4096,
            num_attention_heads=HEADS,
            qk_nope_head_dim=D_NOPE,
            kv_lora_rank=KV_LORA,
            qk_rope_head_dim=D_ROPE,
        )
        # The row size SGLang's KV-cache configurator gives the pool for this config.
        kv_cache_dim = calculate_mla_kv_cache_dim(model_config=self.model_config, kv_cache_dtype=kv_dtype)
        self.token_to_kv_pool = DSATokenToKVPool(
            size=NUM_PAGES * PAGE,
            page_size=PAGE,
            kv_lora_rank=KV_LORA,
            dtype=kv_dtype,
            qk_rope_head_dim=D_ROPE,
            layer_num=1,
            device="cpu",
            index_head_dim=IDX_DIM,
            enable_memory_saver=False,
            kv_cache_dim=kv_cache_dim,
        )
        self.req_to_token_pool = ReqToTokenPool(
            size=len(page_tables), max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False
        )
        pos = torch.arange(MAX_CTX)
        for r, pages in enumerate(page_tables):
            row = torch.tensor(pages, dtype=torch.int32)[pos // PAGE] * PAGE + pos % PAGE
            self.req_to_token_pool.req_to_token[r, :MAX_CTX] = row
        self.kv_cache_dim = kv_cache_dim
        self.hisparse_coordinator = None
        self.is_draft_worker = False
        self.kv_cache_dtype = kv_dtype
        self.server_args = server_args
        self.max_running_requests = len(page_tables)


    def worker(self, server_args: Any) -> Runner:
        """Another worker on the same pools (PD disaggregation: the KV cache a prefill worker
        wrote, as the decode worker receives it), under that worker's published ``server_args``."""
        from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

        dim = calculate_mla_kv_cache_dim(model_config=self.model_config, kv_cache_dtype=self.kv_cache_dtype)
        assert dim == self.kv_cache_dim, f"the workers' KV-cache rows differ: {self.kv_cache_dim} vs {dim}"
        other = copy.copy(self)
        other.server_args = server_args
        return other


@dataclasses.dataclass
class Step:
    """One batch: ``mode`` in extend / decode / verify / draft_extend; per request the first new
    position and the number of new tokens."""

    name: str
    mode: str
    starts: list[int]
    counts: list[int]


def forward_batch(step: Step, runner: Runner, backend: Any):
    """SGLang's ``ForwardBatch`` of ``step`` (requests 0..B-1 of the pool)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    mode = {
        "extend": ForwardMode.EXTEND,
        "decode": ForwardMode.DECODE,
        "verify": ForwardMode.TARGET_VERIFY,
        "draft_extend": ForwardMode.DRAFT_EXTEND_V2,
    }[step.mode]
    req_to_token = runner.req_to_token_pool.req_to_token
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(step.starts, step.counts)])
    out_loc = torch.cat([req_to_token[r, s : s + n].long() for r, (s, n) in enumerate(zip(step.starts, step.counts))])
    # seq_lens count the new tokens, except for target verify (SGLang adds the drafts itself)
    ends = [s + n for s, n in zip(step.starts, step.counts)]
    seq = step.starts if step.mode == "verify" else ends
    bs = len(step.starts)
    fb = ForwardBatch(
        forward_mode=mode,
        batch_size=bs,
        input_ids=torch.zeros(len(positions), dtype=torch.int64),
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.tensor(seq),
        out_cache_loc=out_loc,
        seq_lens_sum=sum(seq),
        seq_lens_cpu=torch.tensor(seq),
        positions=positions,
    )
    if step.mode in ("extend", "draft_extend"):
        fb.extend_seq_lens = torch.tensor(step.counts, dtype=torch.int32)
        fb.extend_seq_lens_cpu = list(step.counts)
        fb.extend_prefix_lens = torch.tensor(step.starts, dtype=torch.int32)
        fb.extend_prefix_lens_cpu = list(step.starts)
        fb.extend_start_loc = torch.tensor([0, *torch.tensor(step.counts).cumsum(0)[:-1].tolist()])
        fb.extend_num_tokens = sum(step.counts)
    fb.req_to_token_pool = runner.req_to_token_pool
    fb.token_to_kv_pool = runner.token_to_kv_pool
    fb.attn_backend = backend
    return fb


def run_layer(layer: Any, backend: Any, fb: Any, hidden: torch.Tensor) -> torch.Tensor:
    """One forward of SGLang's layer: backend metadata, forward context, attention inputs."""
    from sglang.srt.layers.layer_boundary.adapters.attention import AttentionInputs, get_attn_tp_context
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.utils import BumpAllocator

    backend.init_forward_metadata(fb)
    # torch.compile'd helpers of the indexer run eagerly (no C++ toolchain needed on CPU)
    with torch.no_grad(), torch.compiler.set_stance("force_eager"), forward_context(
        ForwardContext(attn_backend=backend)
    ):
        get_attn_tp_context().set_attn_inputs(AttentionInputs(hidden, fb, layer.prepare_qkv_latent))
        try:
            out = layer(fb.positions, hidden, fb, BumpAllocator(256, torch.float32, "cpu"))
        finally:
            get_attn_tp_context().clear_attn_inputs()
    return out[0] if isinstance(out, tuple) else out


# ---------------------------------------------------------------------------------------------
# Plain-torch reference
# ---------------------------------------------------------------------------------------------


def yarn_cos_sin(
    positions: torch.Tensor, dim: int = D_ROPE, base: float = ROPE_THETA
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek YaRN rotary tables ``[T, dim / 2]`` (frequency blend between interpolation and
    extrapolation over the correction range, amplitude ``mscale(f, mscale) / mscale(f, mscale_all_dim)``)."""
    f = ROPE_SCALING["factor"]
    orig = ROPE_SCALING["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ROPE_SCALING["beta_fast"])), 0)
    high = min(math.ceil(correction_dim(ROPE_SCALING["beta_slow"])), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    inv_freq = extrapolate / f * ramp + extrapolate * (1 - ramp)

    def mscale(m: float) -> float:
        return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

    amp = mscale(ROPE_SCALING["mscale"]) / mscale(ROPE_SCALING["mscale_all_dim"])
    freqs = positions.double()[:, None] * inv_freq[None]
    return (freqs.cos() * amp).float(), (freqs.sin() * amp).float()


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on pairs (2i, 2i+1) (DeepSeek MLA, ``rope_interleave``); ``x`` ``[T, ..., D]``."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], -1).flatten(-2)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on (i, i + D/2) pairs (the indexer's neox style); ``x`` ``[T, ..., D]``."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + RMS_EPS) * w


def hadamard(x: torch.Tensor) -> torch.Tensor:
    return _hadamard(x.float(), x.shape[-1] ** -0.5)


def fp8_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantisation with one power-of-two (UE8M0) scale per 128 values: ``(values, scale)``."""
    amax = x.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))
    return (x / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float(), scale


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 where the layer stores activations in bf16."""
    return x.to(torch.bfloat16).float()


@dataclasses.dataclass
class TokenState:
    """What the reference derives from one token's hidden state at its position."""

    c_kv: torch.Tensor  # [KV_LORA] normalised latent
    k_pe: torch.Tensor  # [D_ROPE] rotated
    q_abs: torch.Tensor  # [HEADS, KV_LORA] absorbed q_nope
    q_pe: torch.Tensor  # [HEADS, D_ROPE] rotated
    idx_q: torch.Tensor  # [IDX_HEADS, IDX_DIM] dequantised fp8 query
    idx_w: torch.Tensor  # [IDX_HEADS] head gates (fp8 query scale folded in)
    idx_k: torch.Tensor  # [IDX_DIM] dequantised fp8 key


def token_states(w: Weights, hidden: torch.Tensor, positions: torch.Tensor) -> list[TokenState]:
    """Projections, norms, RoPE, absorption and the indexer's fp8 query / key of every token."""
    h = bf16(hidden.float())
    qkv = bf16(h @ w.qkv_a.T)
    q_a, kv_a, k_pe = qkv.split([Q_LORA, KV_LORA, D_ROPE], -1)
    q_a = bf16(rms_norm(q_a, w.q_a_norm))
    c_kv = bf16(rms_norm(kv_a, w.kv_a_norm))
    q = bf16(q_a @ w.q_b.T).view(-1, HEADS, D_NOPE + D_ROPE)
    q_nope, q_pe = q.split([D_NOPE, D_ROPE], -1)
    w_kc = w.kv_b.view(HEADS, D_NOPE + D_V, KV_LORA)[:, :D_NOPE]
    q_abs = bf16(torch.einsum("thn,hnc->thc", q_nope, bf16(w_kc)))
    cos, sin = yarn_cos_sin(positions)
    q_pe = bf16(rope_interleaved(q_pe, cos, sin))
    k_pe = bf16(rope_interleaved(k_pe, cos, sin))
    # indexer: per-head query and one key, neox RoPE on the first D_ROPE dims, Hadamard, fp8
    iq = bf16(q_a @ w.idx_q_b.T).view(-1, IDX_HEADS, IDX_DIM)
    ik = bf16(h @ w.idx_k.T)
    ik = bf16(torch.nn.functional.layer_norm(ik, (IDX_DIM,), w.idx_k_norm_w, w.idx_k_norm_b, LN_EPS))
    iq = torch.cat([bf16(rope_halves(iq[..., :D_ROPE], cos, sin)), iq[..., D_ROPE:]], -1)
    ik = torch.cat([bf16(rope_halves(ik[..., :D_ROPE], cos, sin)), ik[..., D_ROPE:]], -1)
    iq_v, iq_s = fp8_blocks(bf16(hadamard(iq)))
    ik_v, ik_s = fp8_blocks(bf16(hadamard(ik)))
    gates = (h @ w.idx_w.T) * IDX_HEADS**-0.5 * iq_s.squeeze(-1) * IDX_DIM**-0.5
    return [
        TokenState(c_kv[t], k_pe[t], q_abs[t], q_pe[t], iq_v[t], gates[t], ik_v[t] * ik_s[t])
        for t in range(len(positions))
    ]


def softmax_scale() -> float:
    """``(d_nope + d_rope) ** -0.5`` times the YaRN attention factor ``mscale(f, mscale_all_dim) ** 2``."""
    m = 0.1 * ROPE_SCALING["mscale_all_dim"] * math.log(ROPE_SCALING["factor"]) + 1.0
    return (D_NOPE + D_ROPE) ** -0.5 * m * m


def index_logits(query: TokenState, keys: list[TokenState]) -> torch.Tensor:
    """The lightning indexer's score of every key: ``sum_h gate_h * relu(q_h . k)``."""
    k = torch.stack([s.idx_k for s in keys])
    return (torch.relu(query.idx_q @ k.T) * query.idx_w[:, None]).sum(0)


def attention(w: Weights, query: TokenState, keys: list[TokenState]) -> torch.Tensor:
    """Absorbed MLA of one query over ``keys``, then ``v`` up-projection and ``o_proj``: ``[HIDDEN]``."""
    c = torch.stack([s.c_kv for s in keys])
    pe = torch.stack([s.k_pe for s in keys])
    scores = (query.q_abs @ c.T + query.q_pe @ pe.T) * softmax_scale()
    latent = torch.softmax(scores, -1) @ c  # [HEADS, KV_LORA]
    w_vc = w.kv_b.view(HEADS, D_NOPE + D_V, KV_LORA)[:, D_NOPE:]
    out = torch.einsum("hc,hvc->hv", bf16(latent), bf16(w_vc)).reshape(-1)
    return bf16(out) @ w.o.T
