"""Rotary position embedding of the rope part of MLA queries and keys, as SGLang's fused path applies it.

With the backend names ``dsa`` / ``nsa``, a resolved ``trtllm`` DSA phase and an FP8 KV cache, SGLang's
DeepSeek MLA forward (``_fuse_rope_for_trtllm_mla``) skips RoPE on ``q_pe`` / ``k_pe`` and passes its
rotary module's ``cos_sin_cache`` and ``is_neox_style`` to the attention backend, which rotates both
with ``forward_batch.positions`` before attention and before the cache write. :func:`apply_rope` is that
rotation in plain torch, with the cache layout SGLang's rotary embeddings build:

- ``cos_sin_cache`` ``[max_positions, rotary_dim]``: row ``p`` is ``cat(cos(p * f), sin(p * f))`` over
  the ``rotary_dim // 2`` frequencies ``f`` (YaRN variants fold their magnitude scale into both halves);
- NeoX style (``is_neox``): element ``i`` of the first half pairs with element ``i`` of the second half;
- GPT-J style (``not is_neox``): elements ``2i`` and ``2i + 1`` pair (interleaved).
"""

from __future__ import annotations

import torch


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """Rotate the last dimension of ``x`` by the angles of ``positions``.

    Parameters
    ----------
    x : torch.Tensor
        ``[T, ..., rotary_dim]`` (``[T, heads, 64]`` for ``q_pe``, ``[T, 1, 64]`` or ``[T, 64]`` for
        ``k_pe``); any float dtype.
    positions : torch.Tensor
        ``[T]`` integer position of each token (SGLang's ``forward_batch.positions``).
    cos_sin_cache : torch.Tensor
        ``[max_positions, rotary_dim]`` cos half then sin half (SGLang's ``rotary_emb.cos_sin_cache``).
    is_neox : bool
        NeoX (rotate halves) when true, GPT-J (rotate interleaved pairs) otherwise.

    Returns
    -------
    torch.Tensor
        Rotated ``x``, same shape and dtype; computed in float32.
    """
    if x.dim() < 2:
        raise ValueError(f"x: expected [T, ..., rotary_dim], got shape {tuple(x.shape)}")
    rot = x.shape[-1]
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] != rot or rot % 2:
        raise ValueError(
            f"cos_sin_cache: expected [max_positions, {rot}] (an even rotary dim matching x), "
            f"got shape {tuple(cos_sin_cache.shape)}"
        )
    tokens = x.shape[0]
    positions = positions.reshape(-1)
    if positions.shape[0] < tokens:
        raise ValueError(f"positions: expected at least {tokens} entries (one per token), got {positions.shape[0]}")
    if positions.dtype.is_floating_point:
        raise ValueError(f"positions: expected an integer tensor, got {positions.dtype}")
    pos = positions[:tokens].to(device=cos_sin_cache.device, dtype=torch.long)
    cos, sin = cos_sin_cache.index_select(0, pos).float().chunk(2, dim=-1)  # [T, rot / 2] each
    view = (tokens,) + (1,) * (x.dim() - 2) + (rot // 2,)
    cos, sin = cos.view(view).to(x.device), sin.view(view).to(x.device)
    xf = x.float()
    if is_neox:
        x1, x2 = xf[..., : rot // 2], xf[..., rot // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.to(x.dtype)
