"""The integer steps of the inline-PTX e4m3 decodings, in torch, for CPU tests of their selectors, shifts and masks."""

from __future__ import annotations

import torch


def prmt_shift_mask(words: torch.Tensor, selector: int, shift: int, mask: int) -> torch.Tensor:
    """``prmt.b32 x, w, 0, selector`` (4-bit nibbles: a byte index 0-3, plus 8 to replicate that byte's sign), then
    ``x << shift`` and ``x & mask``, on 32-bit words of 4 bytes ``words`` (``[n, 4]`` uint8); returns the two 16-bit
    halves ``[n, 2]`` (int64)."""
    word = torch.zeros(words.shape[0], dtype=torch.int64)
    for k in range(4):
        nib = (selector >> (4 * k)) & 0xF
        byte = words[:, nib & 3].to(torch.int64)
        if nib & 8:
            byte = torch.where(byte >= 128, 0xFF, 0)
        word |= byte << (8 * k)
    word = ((word << shift) & 0xFFFFFFFF) & mask
    return torch.stack([word & 0xFFFF, word >> 16], dim=1)


def byte_pairs() -> torch.Tensor:
    """Every pair of bytes ``(b0, b1)`` as the words ``[b0, b1, b1, b0]`` (``[65536, 4]`` uint8): the first selector
    of a decoding reads bytes 0 and 1, the second bytes 2 and 3."""
    b = torch.arange(256)
    grid = torch.stack(torch.meshgrid(b, b, indexing="ij"), dim=-1).reshape(-1, 2)
    return torch.cat([grid, grid.flip(1)], dim=1).to(torch.uint8)
