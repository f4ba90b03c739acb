"""Builders shared by the vLLM integration tests: a DeepSeek-V3.2-shaped model small enough to build
on a CPU, its model directory, and the ``VllmConfig`` around it.

vLLM is imported inside the builders, so importing this module needs no vLLM; the test modules
that call them skip themselves where vLLM is not installed.
"""

from __future__ import annotations

import json
import socket
from typing import Any

# DeepSeek-V3.2's DSA fields (GLM-5 uses the same ones) on a model small enough for the CPU.
DSA_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": 128,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "max_position_embeddings": 4096,
    "rope_theta": 10000,
    "vocab_size": 1024,
    "torch_dtype": "bfloat16",
    "rms_norm_eps": 1e-6,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "sigmoid",
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
}


def free_port() -> int:
    """A free local TCP port (for ``distributed_init_method``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dsa_model_config(**overrides: Any) -> dict[str, Any]:
    """:data:`DSA_CONFIG` with some fields replaced."""
    return {**DSA_CONFIG, **overrides}


def model_dir(tmp_path_factory, name: str, config: dict[str, Any]) -> str:
    """A fresh model directory holding ``config`` as its ``config.json``."""
    path = tmp_path_factory.mktemp(name)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def cpu_platform():
    """vLLM's current platform, given the CPU device type where vLLM finds no GPU (configs need one)."""
    from vllm.platforms import current_platform

    if not current_platform.device_type:
        current_platform.device_type = "cpu"
    return current_platform


def vllm_config(model: str, block_size: int = 64):
    """``VllmConfig`` of the model in directory ``model`` on the CPU, with an fp8_ds_mla cache."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    model_config = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    return VllmConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, cache_dtype="fp8_ds_mla"),
        device_config=DeviceConfig(device="cpu"),
    )
