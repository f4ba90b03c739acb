"""Numbers of the DeepSeek-V4 MXFP4 indexer replacements, through SGLang's own call sites.

:mod:`nsa_backend_integrations.sglang.dsv4` replaces ``deep_gemm.fp8_fp4_paged_mqa_logits`` and
``deep_gemm.fp8_fp4_mqa_logits`` (DeepGEMM's argument order, adapted to nsa-backend's ops). Here the inputs
are built by SGLang's own code: queries by ``quantize_index_q`` (packed e2m1 ``int8 [rows, H, 64]`` with
four UE8M0 bytes per head in ``int32 [rows, H]``), the paged index-K cache ``[pages, 64 * 68]`` by
``store_fp4_index_k_cache``, the flattened prefill K by ``gather_fp4_index_k``. The replaced functions are
reached through SGLang's functions that import them from ``deep_gemm`` when they run
(``deep_gemm_fp4_paged_mqa_logits`` with ``DeepGEMMDecodeData.paged_logits_args`` for one or two rows per
request, ``flat_index_logits_tiles``), and with the positional call of the V4 indexer's
``forward_c4_indexer``. The logits are compared with nsa-backend's plain-torch references and with SGLang's
own torch scoring (``DeepseekV41Indexer.scores``, masked as its torch prefill masks) over the same cache;
keys a row cannot see must be ``-inf``. (SGLang's Triton scorer ``fp4_index_logits_decode`` is not used:
under the Triton CPU interpreter it returns logits off by about 1e11, so it is left to GPU runs.)
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("sglang")

from sglang.kernels.ops.attention.dsv4 import index_logits
from sglang.kernels.ops.attention.dsv4.index_logits import deep_gemm_fp4_paged_mqa_logits, flat_index_logits_tiles
from sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache import gather_fp4_index_k, store_fp4_index_k_cache
from sglang.srt.layers.attention.dsv4.dsv41_sparse import DeepseekV41Indexer
from sglang.srt.layers.attention.dsv4.v41_indexer.scoring import DeepGEMMDecodeData, quantize_index_q

import nsa_backend
from nsa_backend import reference as ref
from nsa_backend_integrations.sglang import dsv4

deep_gemm = pytest.importorskip("deep_gemm")

PAGE = 64  # SGLang's compressed index-K page size (the V4 indexer views its pool as [pages, 64, 1, 68])
D = 128
SLOT_BYTES = D // 2 + D // 32


@pytest.fixture
def routed(routing_isolated):
    """DeepGEMM's MXFP4 indexer functions replaced by :func:`dsv4.activate`; SGLang's put back afterwards."""
    dsv4.deactivate()  # SGLang's own functions, whether or not an earlier test left the replacements in
    originals = {name: getattr(deep_gemm, name) for name in dsv4.DEEP_GEMM_V4_FUNCTIONS}
    dsv4.activate()
    assert all(getattr(deep_gemm, name) is not originals[name] for name in originals)
    yield
    dsv4.deactivate()
    assert all(getattr(deep_gemm, name) is originals[name] for name in originals)


def _pool(ctx: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SGLang's index-K pool holding ``ctx[b]`` compressed keys per request on shuffled pages.

    Returns ``(cache uint8 [pages, 64 * 68], page_table int32 [B, max_pages], slots int64 [sum(ctx)])`` with
    ``slots`` the pool slot of each key, request-major (the flattened prefill K's columns).
    """
    g = torch.Generator().manual_seed(seed)
    pages_per = [(n + PAGE - 1) // PAGE for n in ctx]
    num_pages = sum(pages_per) + 1  # one page nobody owns
    order = torch.randperm(num_pages, generator=g).to(torch.int32)
    table = torch.zeros(len(ctx), max(pages_per), dtype=torch.int32)
    used = 0
    slots = []
    for b, (n, p) in enumerate(zip(ctx, pages_per)):
        table[b, :p] = order[used: used + p]
        used += p
        t = torch.arange(n)
        slots.append(table[b, t // PAGE].long() * PAGE + t % PAGE)
    slots = torch.cat(slots)
    cache = torch.zeros(num_pages, PAGE * SLOT_BYTES, dtype=torch.uint8)
    k = torch.randn(slots.numel(), D, generator=g).to(torch.bfloat16)
    store_fp4_index_k_cache(k, cache, slots, page_size=PAGE)
    return cache, table, slots


def _queries(rows: int, heads: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q_fp4 int8 [rows, H, 64], q_sf int32 [rows, H], weights fp32 [rows, H])`` as SGLang makes them
    (weights bf16-exact, so SGLang's bf16 scorer sees the same weights)."""
    g = torch.Generator().manual_seed(seed)
    q_fp4, q_sf = quantize_index_q(torch.randn(rows, heads, D, generator=g).to(torch.bfloat16))
    weights = (torch.randn(rows, heads, generator=g) * heads ** -0.5).bfloat16().float()
    return q_fp4, q_sf, weights


def _q_bytes(q_fp4: torch.Tensor, q_sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's view of SGLang's query: packed bytes and ``[..., 4]`` UE8M0 bytes."""
    return q_fp4.view(torch.uint8), q_sf.contiguous().view(torch.uint8).view(*q_sf.shape, 4)


def _sglang_scores(q_fp4, q_sf, weights, slots: torch.Tensor, lens: torch.Tensor, cache) -> torch.Tensor:
    """SGLang's torch scoring (``DeepseekV41Indexer.scores``: ``relu(q . k)`` times the head weight, summed
    over heads) of each row against the pool keys at ``slots [rows, L]``, ``-inf`` at columns ``>= lens``
    (as its torch prefill masks them). The MXFP4 query and pool rows are dequantised to fp32."""
    q = ref.dequantize_mxfp4(*_q_bytes(q_fp4, q_sf))
    packed, scales = ref.unpack_indexer_k_cache_fp4(cache.view(-1, PAGE, 1, SLOT_BYTES), D)
    keys = ref.dequantize_mxfp4(packed, scales).reshape(-1, D)
    out = torch.stack([DeepseekV41Indexer.scores(None, q[r: r + 1], keys[slots[r]], weights[r: r + 1])[0]
                       for r in range(q.shape[0])])
    return out.masked_fill(torch.arange(slots.shape[1]) >= lens.long()[:, None], -torch.inf)


def _assert_logits(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got, want = got.float(), want.float()
    hidden = torch.isneginf(want)
    wrong = torch.isneginf(got) != hidden
    assert not wrong.any(), (f"{what}: {int(wrong.sum())} entries -inf where the other is not (or the reverse), "
                             f"first at (row, key) {wrong.nonzero().tolist()[:4]}")
    scale = want[~hidden].abs().max().clamp(min=1.0)
    err = (got[~hidden] - want[~hidden]).abs().max()
    assert err <= rtol * scale, f"{what}: max |diff| {err:.4g} over visible keys (scale {scale:.4g})"


# (heads, next_n): 16 heads are outside DeepGEMM's SM120 MXFP4 kernels (32 and 64 only).
PAGED_CASES = [(64, 1), (32, 1), (64, 2), (32, 2), (16, 2)]


@pytest.mark.parametrize("heads,next_n", PAGED_CASES)
def test_paged_logits_through_sglang(routed, heads: int, next_n: int):
    """``deep_gemm_fp4_paged_mqa_logits`` on ``DeepGEMMDecodeData.paged_logits_args`` rows (``next_n`` rows per
    request, lengths ``[B, next_n]``), and the V4 indexer's positional call (one row per query token, lengths
    ``[rows, 1]``): both equal the reference and SGLang's scorer; ``-inf`` past each row's length."""
    ctx = [70, 150, 9]  # compressed keys per request: 2, 3 and 1 pages
    cache, table, _ = _pool(ctx, seed=heads + next_n)
    B = len(ctx)
    rows = B * next_n
    q_fp4, q_sf, weights = _queries(rows, heads, seed=7 * heads + next_n)
    # Row j of a request sees the compressed keys of its own position: the last row all of them, earlier rows
    # one fewer or (the compressed length not grown between the two tokens) as many.
    lens = torch.tensor([[n if b % 2 else n - next_n + 1 + j for j in range(next_n)] for b, n in enumerate(ctx)],
                        dtype=torch.int32)
    max_len = 3 * PAGE + 5  # wider than every row: the extra columns are -inf
    data = DeepGEMMDecodeData(q_fp4.view(rows, 1, heads, 64), q_sf.view(rows, 1, heads), weights,
                              cache.view(-1, PAGE, 1, SLOT_BYTES))
    metadata = types.SimpleNamespace(rows_per_request=next_n, compressed_seq_lens=lens.view(-1),
                                     page_table=table.repeat_interleave(next_n, dim=0))
    q, row_lens, row_table = data.paged_logits_args(metadata)
    schedule = nsa_backend.get_paged_mqa_logits_metadata(row_lens, PAGE, 8)
    got = deep_gemm_fp4_paged_mqa_logits(q, data.k_cache, data.weights, row_lens, row_table, schedule, max_len)

    want = ref.fp8_fp4_paged_mqa_logits(*_q_bytes(q_fp4.view(B, next_n, heads, 64), q_sf.view(B, next_n, heads)),
                                        data.k_cache, weights, lens, table, None, max_len)
    _assert_logits(got, want, 1e-4, f"paged H={heads} next_n={next_n} vs reference")
    t = torch.arange(max_len)
    slots = table.repeat_interleave(next_n, dim=0)[:, (t // PAGE).clamp(max=table.shape[1] - 1)].long() * PAGE
    slots = slots + t % PAGE
    theirs = _sglang_scores(q_fp4, q_sf, weights, slots, lens.view(-1), cache)
    _assert_logits(got, theirs, 1e-4, f"paged H={heads} next_n={next_n} vs SGLang's torch scores")
    assert torch.isneginf(got[:, ctx[-1]:][-next_n:]).all() and torch.isneginf(got[:, max(ctx):]).all()

    if next_n == 1:
        # forward_c4_indexer's call: fn(q, cache, weights, lens [rows, 1], page_table, schedule, max_len, False).
        v4 = deep_gemm.fp8_fp4_paged_mqa_logits((q_fp4.unsqueeze(1), q_sf.unsqueeze(1)), data.k_cache, weights,
                                                lens, table, schedule, max_len, False)
        _assert_logits(v4, want, 1e-4, f"V4 indexer call H={heads} vs reference")


@pytest.mark.parametrize("heads", [64, 32, 16])
def test_ragged_logits_through_sglang(routed, heads: int):
    """``flat_index_logits_tiles`` over two requests' flattened K (``gather_fp4_index_k`` of the pool), rows
    of a request seeing a growing prefix from the request's first column; split into row tiles when the
    budget is small. Columns ``j`` of row ``i`` score ``kv[start_i + j]``: equal to the reference's
    compressed output and to SGLang's scorer over the same pool slots, ``-inf`` past each row's length."""
    ctx = [70, 100]
    cache, _, slots = _pool(ctx, seed=heads)
    k_fp4, k_sf = gather_fp4_index_k(cache, slots, page_size=PAGE)
    lengths = torch.tensor([33, 70, 1, 64, 100], dtype=torch.int32)
    starts = torch.tensor([0, 0, 70, 70, 70], dtype=torch.int32)
    q_fp4, q_sf, weights = _queries(lengths.numel(), heads, seed=3 * heads)
    width = 128  # max(ctx) aligned to 64, as flat_index_logits_tiles sizes it
    tiles = list(flat_index_logits_tiles(q=(q_fp4, q_sf), kv=(k_fp4, k_sf), weights=weights, starts=starts,
                                         lengths=lengths, context_lengths=ctx, budget_bytes=1 << 30))
    assert [t for t, _ in tiles] == [slice(0, lengths.numel())]
    got = tiles[0][1]

    want = ref.fp8_fp4_mqa_logits(*_q_bytes(q_fp4, q_sf), k_fp4.view(torch.uint8),
                                  k_sf.view(torch.uint8).view(-1, 4), weights, starts, starts + lengths, True, width)
    _assert_logits(got, want, 1e-4, f"ragged H={heads} vs reference")
    cols = (starts[:, None].long() + torch.arange(width)).clamp(max=slots.numel() - 1)
    theirs = _sglang_scores(q_fp4, q_sf, weights, slots[cols], lengths, cache)
    _assert_logits(got, theirs, 1e-4, f"ragged H={heads} vs SGLang's torch scores")
    assert torch.isneginf(got[0, 33:]).all() and torch.isneginf(got[2, 1:]).all()

    # A small budget splits the rows into tiles; each tile's rows equal the same rows of the whole.
    budget = 2 * 128 // heads * width * 4
    small = list(flat_index_logits_tiles(q=(q_fp4, q_sf), kv=(k_fp4, k_sf), weights=weights, starts=starts,
                                         lengths=lengths, context_lengths=ctx, budget_bytes=budget))
    assert len(small) == -(-lengths.numel() // (128 // heads))  # row tiles of 128 / H rows (the kernel's alignment)
    for rows, logits in small:
        _assert_logits(logits, want[rows], 1e-4, f"ragged H={heads} tile {rows}")


def test_replacements_reach_nsa_backend(routed, monkeypatch):
    """The calls above reach nsa-backend's public ops (not SGLang's DeepGEMM, absent on CPU)."""
    seen = []
    for name in ("fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits"):
        op = getattr(nsa_backend, name)
        monkeypatch.setattr(nsa_backend, name, lambda *a, _op=op, _n=name, **k: seen.append(_n) or _op(*a, **k))
    cache, table, slots = _pool([9], seed=1)
    q_fp4, q_sf, weights = _queries(1, 32, seed=2)
    lens = torch.tensor([9], dtype=torch.int32)
    deep_gemm_fp4_paged_mqa_logits((q_fp4.unsqueeze(1), q_sf.unsqueeze(1)), cache.view(-1, PAGE, 1, SLOT_BYTES),
                                   weights, lens, table, nsa_backend.get_paged_mqa_logits_metadata(
                                       lens.unsqueeze(-1), PAGE, 8), 16)
    k_fp4, k_sf = gather_fp4_index_k(cache, slots, page_size=PAGE)
    list(flat_index_logits_tiles(q=(q_fp4, q_sf), kv=(k_fp4, k_sf), weights=weights, starts=lens * 0,
                                 lengths=lens, context_lengths=[9], budget_bytes=1 << 20))
    assert seen == ["fp8_fp4_paged_mqa_logits", "fp8_fp4_mqa_logits"]


@pytest.fixture
def bf16_logits(monkeypatch):
    """SGLang's index logits in bf16 (its SM100 choice, forced by its own setting); its cached choice reset."""
    monkeypatch.setenv("SGLANG_OPT_DSV41_BF16_INDEX_LOGITS", "1")
    index_logits.index_logits_dtype.cache_clear()
    index_logits.index_weights_dtype.cache_clear()
    assert index_logits.index_logits_dtype() == torch.bfloat16
    yield
    index_logits.index_logits_dtype.cache_clear()
    index_logits.index_weights_dtype.cache_clear()


def test_bf16_logits_dtype_reaches_op(routed, bf16_logits):
    """SGLang passes ``logits_dtype`` by keyword after the positional ``clean_logits``: bf16 logits come back
    from both replacements, equal to the reference to bf16 precision."""
    cache, table, slots = _pool([70], seed=5)
    q_fp4, q_sf, weights = _queries(2, 32, seed=6)
    lens = torch.tensor([69, 70], dtype=torch.int32)
    paged = deep_gemm_fp4_paged_mqa_logits((q_fp4.view(1, 2, 32, 64), q_sf.view(1, 2, 32)),
                                           cache.view(-1, PAGE, 1, SLOT_BYTES), weights, lens.view(1, 2), table,
                                           nsa_backend.get_paged_mqa_logits_metadata(lens.view(1, 2), PAGE, 8), 72)
    assert paged.dtype == torch.bfloat16
    want = ref.fp8_fp4_paged_mqa_logits(*_q_bytes(q_fp4.view(1, 2, 32, 64), q_sf.view(1, 2, 32)),
                                        cache.view(-1, PAGE, 1, SLOT_BYTES), weights, lens.view(1, 2), table, None, 72)
    _assert_logits(paged, want, 1e-2, "bf16 paged vs reference")
    k_fp4, k_sf = gather_fp4_index_k(cache, slots, page_size=PAGE)
    [(_, flat)] = flat_index_logits_tiles(q=(q_fp4, q_sf), kv=(k_fp4, k_sf), weights=weights, starts=lens * 0,
                                          lengths=lens, context_lengths=[70], budget_bytes=1 << 30)
    assert flat.dtype == torch.bfloat16
    want = ref.fp8_fp4_mqa_logits(*_q_bytes(q_fp4, q_sf), k_fp4.view(torch.uint8), k_sf.view(torch.uint8).view(-1, 4),
                                  weights, lens * 0, lens, True, 128)
    _assert_logits(flat, want, 1e-2, "bf16 ragged vs reference")
