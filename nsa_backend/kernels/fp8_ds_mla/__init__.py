"""FP8 KV cache kernels, one module per token format.

- :mod:`.v32`: the 656-byte "fp8_ds_mla" tokens of DeepSeek-V3.2 / GLM-5 (pack and cache write);
- :mod:`.v4`: the 584-byte tokens of DeepSeek-V4 (pack, unpack and cache write).
"""

from nsa_backend.kernels.fp8_ds_mla.v4 import (
    pack_fp8_ds_mla_v4_triton,
    unpack_fp8_ds_mla_v4_triton,
    write_fp8_ds_mla_v4_cache_triton,
)
from nsa_backend.kernels.fp8_ds_mla.v32 import pack_fp8_ds_mla_triton, write_fp8_ds_mla_cache_triton

__all__ = [
    "pack_fp8_ds_mla_triton",
    "pack_fp8_ds_mla_v4_triton",
    "unpack_fp8_ds_mla_v4_triton",
    "write_fp8_ds_mla_cache_triton",
    "write_fp8_ds_mla_v4_cache_triton",
]
