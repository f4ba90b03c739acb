"""Lightning indexer: fp8 MQA logits over ragged (prefill) and paged (decode) keys.

Signatures and semantics match DeepGEMM's ``fp8_mqa_logits``, ``get_paged_mqa_logits_metadata``
and ``fp8_paged_mqa_logits`` so callers can swap implementations without renaming.
Dimensions: S query rows, N keys, H indexer heads, D head dim (64 or 128), B requests,
next_n query tokens per request (1, or 2-4 with MTP).
"""

from __future__ import annotations

import torch

from nsa_backend._checks import FP8, check_bool, check_int, check_tensor
from nsa_backend._dispatch import custom_op, get_impl, resolve_impl
from nsa_backend._replay import ReplayCache

HEAD_DIMS = (64, 128)
MAX_HEADS = 128
BLOCK_KV_CHOICES = (32, 64)
MAX_NEXT_N = 4
# Recorded eager calls of the decode-path ops (nsa_backend._replay).
_metadata_replays = ReplayCache("get_paged_mqa_logits_metadata")
_paged_logits_replays = ReplayCache("fp8_paged_mqa_logits")


# ----------------------------------------------------------------------------------------------
# Ragged logits (prefill)
# ----------------------------------------------------------------------------------------------

@custom_op("nsa_backend::fp8_mqa_logits", mutates_args=())
def _fp8_mqa_logits_op(q: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, weights: torch.Tensor,
                       ks: torch.Tensor, ke: torch.Tensor, clean_logits: bool, max_seqlen_k: int,
                       impl: str) -> torch.Tensor:
    out = get_impl("fp8_mqa_logits", impl)(q, (k, k_scale), weights, ks, ke, clean_logits, max_seqlen_k)
    return out if out.is_contiguous() else out.contiguous()


@_fp8_mqa_logits_op.register_fake
def _(q, k, k_scale, weights, ks, ke, clean_logits, max_seqlen_k, impl):
    cols = max_seqlen_k if max_seqlen_k > 0 else k.shape[0]
    return q.new_empty((q.shape[0], cols), dtype=torch.float32)


def fp8_mqa_logits(
    q: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    r"""Indexer logits of ragged queries against one key sequence (prefill).

    .. math::
        \text{logits}[i, n] = k\_scale[n] \sum_h \text{relu}(q[i, h] \cdot k[n]) \, w[i, h],
        \quad ks[i] \le n < ke[i]

    Parameters
    ----------
    q : torch.Tensor
        Queries, shape ``[S, H, D]``, dtype ``float8_e4m3fn``; ``H`` in 1..128, ``D`` in {64, 128}.
    kv : tuple of torch.Tensor
        ``(k, k_scale)``: keys ``[N, D]`` ``float8_e4m3fn`` and their per-token dequantisation
        scales ``[N]`` ``float32`` (arbitrary positive values, not only powers of two).
    weights : torch.Tensor
        Per-head weights ``[S, H]`` ``float32`` (the caller folds the q scale and softmax scale in).
    cu_seq_len_k_start, cu_seq_len_k_end : torch.Tensor
        ``[S]`` ``int32``: row ``i`` sees the half-open key window ``[ks[i], ke[i])``.
    clean_logits : bool
        Write ``-inf`` outside each row's window (with ``False`` those entries are unspecified).
    max_seqlen_k : int
        ``0``: output ``[S, N]``. ``> 0``: compressed output ``[S, max_seqlen_k]`` with
        ``out[i, j] = logits[i, ks[i] + j]`` for ``j < ke[i] - ks[i]``.
    impl : str
        ``"auto"``, ``"reference"``, ``"triton"`` or ``"deep_gemm"``.

    Returns
    -------
    torch.Tensor
        ``float32`` logits, ``[S, N]`` or ``[S, max_seqlen_k]``.

    Examples
    --------
    >>> import torch, nsa_backend
    >>> q = torch.randn(4, 8, 64).to(torch.float8_e4m3fn)
    >>> k = torch.randn(16, 64).to(torch.float8_e4m3fn)
    >>> ks = torch.zeros(4, dtype=torch.int32); ke = torch.full((4,), 16, dtype=torch.int32)
    >>> nsa_backend.fp8_mqa_logits(q, (k, torch.ones(16)), torch.ones(4, 8), ks, ke).shape
    torch.Size([4, 16])
    """
    dims: dict[str, int] = {}
    check_tensor(q, "q", dtype=FP8, shape=("S", "H", "D"), dims=dims)
    dev = q.device
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError(f"kv: expected a tuple (k [N, D] float8_e4m3fn, k_scale [N] float32), got "
                        f"{type(kv).__name__}" + (f" of length {len(kv)}" if isinstance(kv, (tuple, list)) else ""))
    k, k_scale = kv
    check_tensor(k, "kv[0] (k)", dtype=FP8, shape=("N", "D"), dims=dims, device=dev)
    check_tensor(k_scale, "kv[1] (k_scale)", dtype=torch.float32, shape=("N",), dims=dims, device=dev)
    check_tensor(weights, "weights", dtype=torch.float32, shape=("S", "H"), dims=dims, device=dev)
    check_tensor(cu_seq_len_k_start, "cu_seq_len_k_start", dtype=torch.int32, shape=("S",), dims=dims, device=dev)
    check_tensor(cu_seq_len_k_end, "cu_seq_len_k_end", dtype=torch.int32, shape=("S",), dims=dims, device=dev)
    check_int(dims["D"], "q.shape[2] (head dim D)", choices=HEAD_DIMS)
    check_int(dims["H"], "q.shape[1] (heads H)", min_value=1, max_value=MAX_HEADS)
    check_bool(clean_logits, "clean_logits")
    check_int(max_seqlen_k, "max_seqlen_k", min_value=0)
    name = resolve_impl("fp8_mqa_logits", impl, {"device": dev, "num_heads": dims["H"], "head_dim": dims["D"],
                                                 "compressed": max_seqlen_k > 0})
    return _fp8_mqa_logits_op(q.contiguous(), k.contiguous(), k_scale.contiguous(), weights.contiguous(),
                              cu_seq_len_k_start.contiguous(), cu_seq_len_k_end.contiguous(),
                              clean_logits, max_seqlen_k, name)


# ----------------------------------------------------------------------------------------------
# Paged logits (decode / MTP)
# ----------------------------------------------------------------------------------------------

@custom_op("nsa_backend::get_paged_mqa_logits_metadata", mutates_args=())
def _paged_metadata_op(context_lens: torch.Tensor, block_kv: int, num_sms: int, impl: str) -> torch.Tensor:
    return get_impl("get_paged_mqa_logits_metadata", impl)(context_lens, block_kv, num_sms)


@_paged_metadata_op.register_fake
def _(context_lens, block_kv, num_sms, impl):
    return context_lens.new_empty((num_sms + 1, 2), dtype=torch.int32)


def _check_context_lens(context_lens: torch.Tensor, dims: dict[str, int], device: torch.device | None) -> None:
    check_tensor(context_lens, "context_lens", dtype=torch.int32, ndim=(1, 2), device=device)
    if context_lens.dim() == 1:
        check_tensor(context_lens, "context_lens", shape=("B",), dims=dims)
    else:
        check_tensor(context_lens, "context_lens", shape=("B", "next_n"), dims=dims)


def get_paged_mqa_logits_metadata(context_lens: torch.Tensor, block_kv: int, num_sms: int, *,
                                  impl: str = "auto") -> torch.Tensor:
    """Work schedule of :func:`fp8_paged_mqa_logits` over ``num_sms`` workers.

    Parameters
    ----------
    context_lens : torch.Tensor
        ``int32``, ``[B]`` (tokens in each request's cache) or ``[B, next_n]`` (keys visible to
        each query row).
    block_kv : int
        Tokens per KV-cache page: 64 (or 32).
    num_sms : int
        Number of workers (streaming multiprocessors) to schedule over.

    Returns
    -------
    torch.Tensor
        ``int32`` ``[num_sms + 1, 2]``: the ``(request, segment)`` where each worker starts, then
        the end sentinel ``(B, 0)``. Segments are 256 keys long; a 2-D ``context_lens`` is
        scheduled by its last column (the longest row of a causal request), as DeepGEMM does.
    """
    values = (context_lens, block_kv, num_sms, impl)
    key = _metadata_replays.key(values)
    if (replay := _metadata_replays.get(key)) is not None:
        return replay(values)
    dims: dict[str, int] = {}
    _check_context_lens(context_lens, dims, None)
    check_int(block_kv, "block_kv", choices=BLOCK_KV_CHOICES)
    check_int(num_sms, "num_sms", min_value=1)
    name = resolve_impl("get_paged_mqa_logits_metadata", impl, {"device": context_lens.device,
                                                                "page_size": block_kv})
    return _metadata_replays.run(key, values, name,
                                 lambda: _paged_metadata_op(context_lens.contiguous(), block_kv, num_sms, name))


@custom_op("nsa_backend::fp8_paged_mqa_logits", mutates_args=())
def _fp8_paged_mqa_logits_op(q: torch.Tensor, kv_cache: torch.Tensor, weights: torch.Tensor,
                             context_lens: torch.Tensor, block_table: torch.Tensor, schedule_meta: torch.Tensor,
                             max_context_len: int, clean_logits: bool, impl: str) -> torch.Tensor:
    out = get_impl("fp8_paged_mqa_logits", impl)(q, kv_cache, weights, context_lens, block_table, schedule_meta,
                                                 max_context_len, clean_logits)
    return out if out.is_contiguous() else out.contiguous()


@_fp8_paged_mqa_logits_op.register_fake
def _(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits, impl):
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len), dtype=torch.float32)


def _check_indexer_cache(kv_cache: torch.Tensor, head_dim: int, device: torch.device) -> torch.Tensor:
    """Accept ``[P, block_kv, 1, D + 4]`` or ``[P, block_kv, D + 4]`` uint8; return the 4-D view."""
    return _check_paged_rows(kv_cache, head_dim + 4, f" (D + 4 = {head_dim + 4})", device)


def _check_paged_rows(kv_cache: torch.Tensor, width: int, what: str, device: torch.device) -> torch.Tensor:
    """A paged key cache of ``width``-byte token rows (``what``: what a row holds, for the error), as 4-D."""
    check_tensor(kv_cache, "kv_cache", dtype=torch.uint8, ndim=(3, 4), device=device)
    if kv_cache.dim() == 3:
        kv_cache = kv_cache.unsqueeze(2)
    _, block_kv, one, row = kv_cache.shape
    if one != 1 or row != width:
        raise ValueError(f"kv_cache: expected shape [num_blocks, block_kv, 1, {width}]{what}, "
                         f"got {tuple(kv_cache.shape)}")
    check_int(block_kv, "kv_cache.shape[1] (block_kv)", choices=BLOCK_KV_CHOICES)
    page_bytes = block_kv * width
    # Each page must be one contiguous run of bytes; pages may be spaced further apart.
    if kv_cache.stride(3) != 1 or kv_cache.stride(1) != width or kv_cache.stride(0) < page_bytes:
        raise ValueError(f"kv_cache: expected each page to be contiguous (strides [>= {page_bytes}, {width}, *, 1]), "
                         f"got strides {tuple(kv_cache.stride())}")
    return kv_cache


def fp8_paged_mqa_logits(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = False,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Indexer logits of decode queries against a paged fp8 key cache.

    Parameters
    ----------
    q : torch.Tensor
        ``[B, next_n, H, D]`` ``float8_e4m3fn``; ``next_n`` in 1..4.
    kv_cache : torch.Tensor
        ``uint8`` ``[num_blocks, block_kv, 1, D + 4]`` (or without the unit axis). Page layout:
        ``block_kv * D`` fp8 values (token-major), then ``block_kv`` fp32 scales; ``stride(0)`` may
        exceed the page size.
    weights : torch.Tensor
        ``[B * next_n, H]`` ``float32``.
    context_lens : torch.Tensor
        ``int32`` ``[B, next_n]`` (row ``b*next_n+j`` sees keys ``t < ctx[b, j]``) or ``[B]``
        (row ``b*next_n+j`` sees keys ``t <= ctx[b] - next_n + j``).
    block_table : torch.Tensor
        ``[B, max_blocks]`` ``int32`` page ids; entries past a request's context are ignored.
    schedule_meta : torch.Tensor
        ``[num_sms + 1, 2]`` ``int32`` from :func:`get_paged_mqa_logits_metadata`.
    max_context_len : int
        Number of output columns.
    clean_logits : bool
        Write ``-inf`` for keys a row cannot see (implementations here always do).
    impl : str
        ``"auto"``, ``"reference"``, ``"triton"`` or ``"deep_gemm"``.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]`` ``float32``.
    """
    values = (q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, clean_logits, impl)
    key = _paged_logits_replays.key(values)
    if (replay := _paged_logits_replays.get(key)) is not None:
        return replay(values)
    dims: dict[str, int] = {}
    check_tensor(q, "q", dtype=FP8, shape=("B", "next_n", "H", "D"), dims=dims)
    dev = q.device
    check_int(dims["next_n"], "q.shape[1] (next_n)", min_value=1, max_value=MAX_NEXT_N)
    check_int(dims["D"], "q.shape[3] (head dim D)", choices=HEAD_DIMS)
    check_int(dims["H"], "q.shape[2] (heads H)", min_value=1, max_value=MAX_HEADS)
    kv_cache = _check_indexer_cache(kv_cache, dims["D"], dev)
    dims["rows"] = dims["B"] * dims["next_n"]
    check_tensor(weights, "weights", dtype=torch.float32, shape=("rows", "H"), dims=dims, device=dev)
    _check_context_lens(context_lens, dims, dev)
    check_tensor(block_table, "block_table", dtype=torch.int32, shape=("B", None), dims=dims, device=dev)
    check_tensor(schedule_meta, "schedule_meta", dtype=torch.int32, shape=(None, 2), device=dev)
    check_int(max_context_len, "max_context_len", min_value=0)
    check_bool(clean_logits, "clean_logits")
    name = resolve_impl("fp8_paged_mqa_logits", impl, {
        "device": dev, "num_heads": dims["H"], "head_dim": dims["D"], "next_n": dims["next_n"],
        "page_size": kv_cache.shape[1], "context_lens_2d": context_lens.dim() == 2})
    return _paged_logits_replays.run(key, values, name, lambda: _fp8_paged_mqa_logits_op(
        q.contiguous(), kv_cache, weights.contiguous(), context_lens.contiguous(), block_table.contiguous(),
        schedule_meta.contiguous(), max_context_len, clean_logits, name))


# ----------------------------------------------------------------------------------------------
# Indexer key cache packing
# ----------------------------------------------------------------------------------------------

@custom_op("nsa_backend::pack_indexer_k_cache", mutates_args=())
def _pack_indexer_k_cache_op(k: torch.Tensor, k_scale: torch.Tensor | None, block_kv: int,
                             impl: str) -> torch.Tensor:
    arg = (k, k_scale) if k_scale is not None else k
    return get_impl("pack_indexer_k_cache", impl)(arg, block_kv)


@_pack_indexer_k_cache_op.register_fake
def _(k, k_scale, block_kv, impl):
    N, D = k.shape
    return k.new_empty(((N + block_kv - 1) // block_kv, block_kv, 1, D + 4), dtype=torch.uint8)


def pack_indexer_k_cache(k, block_kv: int = 64, *, impl: str = "auto") -> torch.Tensor:
    """Quantise (if needed) and lay out indexer keys as a paged cache.

    Parameters
    ----------
    k : torch.Tensor or tuple of torch.Tensor
        Either float keys ``[N, D]`` (``bfloat16``, ``float16`` or ``float32``), quantised per
        token with ``scale = max(amax, 1e-4) / 448``, or a pre-quantised pair
        ``(k_fp8 [N, D] float8_e4m3fn, k_scale [N] float32)``.
    block_kv : int
        Tokens per page, 64 (or 32).

    Returns
    -------
    torch.Tensor
        ``uint8`` ``[ceil(N / block_kv), block_kv, 1, D + 4]``; token ``n`` lands in page
        ``n // block_kv``. Unused tail slots are zero.
    """
    dims: dict[str, int] = {}
    if isinstance(k, (tuple, list)):
        if len(k) != 2:
            raise TypeError(f"k: expected a tensor or a pair (k_fp8, k_scale), got a sequence of length {len(k)}")
        k_fp8, k_scale = k
        check_tensor(k_fp8, "k[0] (k_fp8)", dtype=FP8, shape=("N", "D"), dims=dims)
        check_tensor(k_scale, "k[1] (k_scale)", dtype=torch.float32, shape=("N",), dims=dims, device=k_fp8.device)
        k_fp8, k_scale = k_fp8.contiguous(), k_scale.contiguous()
    else:
        check_tensor(k, "k", dtype=(torch.bfloat16, torch.float16, torch.float32), shape=("N", "D"), dims=dims)
        k_fp8, k_scale = k.contiguous(), None
    check_int(dims["D"], "k.shape[1] (head dim D)", choices=HEAD_DIMS)
    check_int(block_kv, "block_kv", choices=BLOCK_KV_CHOICES)
    name = resolve_impl("pack_indexer_k_cache", impl, {"device": k_fp8.device})
    return _pack_indexer_k_cache_op(k_fp8, k_scale, block_kv, name)


# ----------------------------------------------------------------------------------------------
# MXFP4 key cache (DeepSeek-V4): fp8_fp4_mqa_logits / fp8_fp4_paged_mqa_logits
# ----------------------------------------------------------------------------------------------

FP4_HEAD_DIM = 128
# Bytes of one MXFP4 cache row at D = 128: 64 packed e2m1 bytes + 4 UE8M0 scale bytes.
FP4_ROW_BYTES = FP4_HEAD_DIM // 2 + FP4_HEAD_DIM // 32
_PACKED = (torch.uint8, torch.int8)
_LOGITS_DTYPES = (torch.float32, torch.bfloat16)


def _split_fp4_q(q, lead: tuple[str, ...], dims: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DeepGEMM's ``q = (values, scales or None)`` (or a bare tensor) -> (values, uint8 scales or None).

    e4m3 values ``[*lead, H, 128]`` take no scales (the caller folds the q scale into the weights);
    MXFP4 values ``[*lead, H, 64]`` (uint8 / int8, even element in the low nibble) take ``int32 [*lead, H]``
    scales, four UE8M0 bytes in little-endian order (byte ``j`` scales values ``32j .. 32j+31``)."""
    if isinstance(q, (tuple, list)):
        if len(q) != 2:
            raise TypeError(f"q: expected a tensor or a pair (q_values, q_scale or None), got a sequence of length "
                            f"{len(q)}")
        values, scale = q
    else:
        values, scale = q, None
    check_tensor(values, "q[0] (q values)", dtype=(FP8, *_PACKED), ndim=len(lead) + 2)
    if values.dtype == FP8:
        check_tensor(values, "q[0] (q values)", shape=(*lead, "H", "D"), dims=dims)
        if scale is not None:
            raise ValueError("q: e4m3 queries take no q_scale (fold the per-head q scale into weights); "
                             "got a q_scale tensor")
        check_int(dims["D"], "q[0].shape[-1] (head dim D)", choices=(FP4_HEAD_DIM,))
        return values.contiguous(), None
    check_tensor(values, "q[0] (q values, packed MXFP4)", shape=(*lead, "H", "half"), dims=dims)
    check_int(dims["half"], "q[0].shape[-1] (packed MXFP4 bytes D/2)", choices=(FP4_HEAD_DIM // 2,))
    if scale is None:
        raise ValueError("q: packed MXFP4 queries need q_scale (int32 [..., H], four UE8M0 bytes); got None")
    check_tensor(scale, "q[1] (q_scale)", dtype=torch.int32, shape=(*lead, "H"), dims=dims, device=values.device)
    return values.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8).view(*scale.shape, 4)


@custom_op("nsa_backend::fp8_fp4_mqa_logits", mutates_args=())
def _fp8_fp4_mqa_logits_op(q: torch.Tensor, q_scale: torch.Tensor | None, k: torch.Tensor, k_scale: torch.Tensor,
                           weights: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, max_seqlen_k: int,
                           bf16_out: bool, impl: str) -> torch.Tensor:
    out = get_impl("fp8_fp4_mqa_logits", impl)(q, q_scale, k, k_scale, weights, ks, ke, True, max_seqlen_k)
    return out.to(torch.bfloat16) if bf16_out else out.contiguous()


@_fp8_fp4_mqa_logits_op.register_fake
def _(q, q_scale, k, k_scale, weights, ks, ke, max_seqlen_k, bf16_out, impl):
    cols = max_seqlen_k if max_seqlen_k > 0 else k.shape[0]
    return q.new_empty((q.shape[0], cols), dtype=torch.bfloat16 if bf16_out else torch.float32)


def fp8_fp4_mqa_logits(
    q,
    kv: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    cu_seq_len_k_start: torch.Tensor,
    cu_seq_len_k_end: torch.Tensor,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    r"""Indexer logits of ragged queries against MXFP4 keys (DeepSeek-V4 prefill, DeepGEMM's ``fp8_fp4_mqa_logits``).

    .. math::
        \text{logits}[i, n] = \sum_h \text{relu}(q[i, h] \cdot k[n]) \, w[i, h], \quad ks[i] \le n < ke[i]

    with ``k[n]`` (and an MXFP4 ``q``) dequantised: e2m1 value times ``2^(byte - 127)`` of its 32-value block.

    Parameters
    ----------
    q : torch.Tensor or tuple
        ``(q_values, q_scale)`` as DeepGEMM takes it, or a bare e4m3 tensor. e4m3 ``[S, H, 128]`` with
        ``q_scale=None`` (the per-head q scale is folded into ``weights``), or packed MXFP4 ``[S, H, 64]``
        uint8 / int8 with ``q_scale`` ``int32 [S, H]`` (four UE8M0 bytes, byte ``j`` for values ``32j..32j+31``).
        ``H`` in 1..128 (no padding needed).
    kv : tuple of torch.Tensor
        ``(k, k_scale)``: packed e2m1 keys ``[N, 64]`` uint8 / int8 (value ``2j`` in the low nibble of byte
        ``j``) and their UE8M0 scales ``int32 [N]`` (or ``uint8 [N, 4]``).
    weights : torch.Tensor
        ``[S, H]`` ``float32`` or ``bfloat16`` (computed in fp32).
    cu_seq_len_k_start, cu_seq_len_k_end : torch.Tensor
        ``[S]`` ``int32``: row ``i`` sees keys ``[ks[i], ke[i])``.
    max_seqlen_k : int
        ``0``: output ``[S, N]``. ``> 0``: compressed output ``[S, max_seqlen_k]`` with
        ``out[i, j] = logits[i, ks[i] + j]``.
    logits_dtype : torch.dtype
        ``float32`` or ``bfloat16`` output.
    impl : str
        ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns
    -------
    torch.Tensor
        Logits ``[S, N]`` or ``[S, max_seqlen_k]``; every entry outside a row's window is ``-inf``.
    """
    dims: dict[str, int] = {}
    q_values, q_scale = _split_fp4_q(q, ("S",), dims)
    dev = q_values.device
    check_int(dims["H"], "q heads H", min_value=1, max_value=MAX_HEADS)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError(f"kv: expected a tuple (k [N, 64] uint8 packed e2m1, k_scale [N] int32 UE8M0 x4), got "
                        f"{type(kv).__name__}" + (f" of length {len(kv)}" if isinstance(kv, (tuple, list)) else ""))
    k, k_scale = kv
    if isinstance(k, torch.Tensor) and k.dtype == FP8:
        raise ValueError("kv[0] (k): e4m3 keys with an fp32 scale are served by fp8_mqa_logits; "
                         "fp8_fp4_mqa_logits takes packed MXFP4 keys [N, 64] uint8")
    check_tensor(k, "kv[0] (k, packed e2m1)", dtype=_PACKED, shape=("N", FP4_HEAD_DIM // 2), dims=dims, device=dev)
    check_tensor(k_scale, "kv[1] (k_scale)", dtype=(torch.int32, torch.uint8), ndim=(1, 2), device=dev)
    if k_scale.dtype == torch.int32:
        check_tensor(k_scale, "kv[1] (k_scale)", shape=("N",), dims=dims)
    else:
        check_tensor(k_scale, "kv[1] (k_scale)", shape=("N", FP4_HEAD_DIM // 32), dims=dims)
    k_bytes = k.contiguous().view(torch.uint8)
    k_sc = k_scale.contiguous().view(torch.uint8).reshape(dims["N"], FP4_HEAD_DIM // 32)
    check_tensor(weights, "weights", dtype=(torch.float32, torch.bfloat16), shape=("S", "H"), dims=dims, device=dev)
    check_tensor(cu_seq_len_k_start, "cu_seq_len_k_start", dtype=torch.int32, shape=("S",), dims=dims, device=dev)
    check_tensor(cu_seq_len_k_end, "cu_seq_len_k_end", dtype=torch.int32, shape=("S",), dims=dims, device=dev)
    check_int(max_seqlen_k, "max_seqlen_k", min_value=0)
    if logits_dtype not in _LOGITS_DTYPES:
        raise ValueError(f"logits_dtype: expected torch.float32 or torch.bfloat16, got {logits_dtype}")
    name = resolve_impl("fp8_fp4_mqa_logits", impl, {"device": dev, "num_heads": dims["H"],
                                                     "q_fp4": q_scale is not None, "compressed": max_seqlen_k > 0})
    return _fp8_fp4_mqa_logits_op(q_values, q_scale, k_bytes, k_sc, weights.float().contiguous(),
                                  cu_seq_len_k_start.contiguous(), cu_seq_len_k_end.contiguous(), max_seqlen_k,
                                  logits_dtype == torch.bfloat16, name)


@custom_op("nsa_backend::fp8_fp4_paged_mqa_logits", mutates_args=())
def _fp8_fp4_paged_mqa_logits_op(q: torch.Tensor, q_scale: torch.Tensor | None, kv_cache: torch.Tensor,
                                 weights: torch.Tensor, context_lens: torch.Tensor, block_table: torch.Tensor,
                                 schedule_meta: torch.Tensor, max_context_len: int, bf16_out: bool,
                                 impl: str) -> torch.Tensor:
    out = get_impl("fp8_fp4_paged_mqa_logits", impl)(q, q_scale, kv_cache, weights, context_lens, block_table,
                                                      schedule_meta, max_context_len, True)
    return out.to(torch.bfloat16) if bf16_out else out.contiguous()


@_fp8_fp4_paged_mqa_logits_op.register_fake
def _(q, q_scale, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len, bf16_out, impl):
    return q.new_empty((q.shape[0] * q.shape[1], max_context_len),
                       dtype=torch.bfloat16 if bf16_out else torch.float32)


def _check_fp4_cache(kv_cache: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Accept ``[P, block_kv, 1, 68]`` or ``[P, block_kv, 68]`` uint8 with contiguous pages; return 4-D."""
    return _check_paged_rows(kv_cache, FP4_ROW_BYTES, " (64 packed e2m1 bytes + 4 UE8M0 bytes per token)", device)


def fp8_fp4_paged_mqa_logits(
    q,
    kv_cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    schedule_meta: torch.Tensor,
    max_context_len: int,
    logits_dtype: torch.dtype = torch.float32,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """Indexer logits of decode queries against a paged MXFP4 key cache (DeepGEMM's ``fp8_fp4_paged_mqa_logits``).

    Parameters
    ----------
    q : torch.Tensor or tuple
        ``(q_values, q_scale)`` or a bare e4m3 tensor: e4m3 ``[B, next_n, H, 128]`` without scales, or
        packed MXFP4 ``[B, next_n, H, 64]`` with ``q_scale`` ``int32 [B, next_n, H]`` (see
        :func:`fp8_fp4_mqa_logits`). ``next_n`` in 1..4, ``H`` in 1..128.
    kv_cache : torch.Tensor
        ``uint8 [num_blocks, block_kv, 1, 68]`` (or without the unit axis), ``block_kv`` 32 or 64. Page
        layout: ``block_kv * 64`` packed e2m1 bytes (token-major), then ``block_kv * 4`` UE8M0 bytes;
        ``stride(0)`` may exceed the page size. :func:`pack_indexer_k_cache_fp4` writes it.
    weights : torch.Tensor
        ``[B * next_n, H]`` ``float32`` or ``bfloat16``.
    context_lens : torch.Tensor
        ``int32`` ``[B, next_n]`` (row ``b*next_n+j`` sees keys ``t < ctx[b, j]``) or ``[B]`` (row
        ``b*next_n+j`` sees keys ``t <= ctx[b] - next_n + j``).
    block_table : torch.Tensor
        ``[B, max_blocks]`` ``int32`` page ids; ids outside ``[0, num_blocks)`` give ``-inf``.
    schedule_meta : torch.Tensor
        ``[num_sms + 1, 2]`` ``int32`` from :func:`get_paged_mqa_logits_metadata` (accepted, not needed).
    max_context_len : int
        Number of output columns.
    logits_dtype : torch.dtype
        ``float32`` or ``bfloat16`` output.
    impl : str
        ``"auto"``, ``"reference"`` or ``"triton"``.

    Returns
    -------
    torch.Tensor
        ``[B * next_n, max_context_len]``; keys a row cannot see are ``-inf``.
    """
    dims: dict[str, int] = {}
    q_values, q_scale = _split_fp4_q(q, ("B", "next_n"), dims)
    dev = q_values.device
    check_int(dims["next_n"], "q.shape[1] (next_n)", min_value=1, max_value=MAX_NEXT_N)
    check_int(dims["H"], "q heads H", min_value=1, max_value=MAX_HEADS)
    kv_cache = _check_fp4_cache(kv_cache, dev)
    dims["rows"] = dims["B"] * dims["next_n"]
    check_tensor(weights, "weights", dtype=(torch.float32, torch.bfloat16), shape=("rows", "H"), dims=dims,
                 device=dev)
    _check_context_lens(context_lens, dims, dev)
    check_tensor(block_table, "block_table", dtype=torch.int32, shape=("B", None), dims=dims, device=dev)
    check_tensor(schedule_meta, "schedule_meta", dtype=torch.int32, shape=(None, 2), device=dev)
    check_int(max_context_len, "max_context_len", min_value=0)
    if logits_dtype not in _LOGITS_DTYPES:
        raise ValueError(f"logits_dtype: expected torch.float32 or torch.bfloat16, got {logits_dtype}")
    name = resolve_impl("fp8_fp4_paged_mqa_logits", impl, {
        "device": dev, "num_heads": dims["H"], "next_n": dims["next_n"], "page_size": kv_cache.shape[1],
        "q_fp4": q_scale is not None, "context_lens_2d": context_lens.dim() == 2})
    return _fp8_fp4_paged_mqa_logits_op(q_values, q_scale, kv_cache, weights.float().contiguous(),
                                        context_lens.contiguous(), block_table.contiguous(),
                                        schedule_meta.contiguous(), max_context_len,
                                        logits_dtype == torch.bfloat16, name)


@custom_op("nsa_backend::pack_indexer_k_cache_fp4", mutates_args=())
def _pack_indexer_k_cache_fp4_op(k: torch.Tensor, block_kv: int, impl: str) -> torch.Tensor:
    return get_impl("pack_indexer_k_cache_fp4", impl)(k, block_kv)


@_pack_indexer_k_cache_fp4_op.register_fake
def _(k, block_kv, impl):
    return k.new_empty(((k.shape[0] + block_kv - 1) // block_kv, block_kv, 1, FP4_ROW_BYTES), dtype=torch.uint8)


def pack_indexer_k_cache_fp4(k: torch.Tensor, block_kv: int = 64, *, impl: str = "auto") -> torch.Tensor:
    """Quantise float indexer keys to MXFP4 and lay them out as a paged cache (DeepSeek-V4's 68-byte rows).

    Per 32-value block: scale ``2^e``, ``e = ceil(log2(max(amax, 6 * 2^-126) / 6))`` clipped to
    ``[-127, 127]`` and stored as the UE8M0 byte ``e + 127``; values ``x / 2^e`` rounded to e2m1 (nearest,
    ties to even, saturating at 6), two per byte with the even element in the low nibble.

    Parameters
    ----------
    k : torch.Tensor
        ``[N, 128]`` ``bfloat16``, ``float16`` or ``float32``.
    block_kv : int
        Tokens per page, 64 (or 32).

    Returns
    -------
    torch.Tensor
        ``uint8 [ceil(N / block_kv), block_kv, 1, 68]``: each page ``block_kv`` rows of 64 packed bytes,
        then ``block_kv`` rows of 4 scale bytes; token ``n`` in page ``n // block_kv``; unused slots zero.
    """
    dims: dict[str, int] = {}
    check_tensor(k, "k", dtype=(torch.bfloat16, torch.float16, torch.float32), shape=("N", "D"), dims=dims)
    check_int(dims["D"], "k.shape[1] (head dim D)", choices=(FP4_HEAD_DIM,))
    check_int(block_kv, "block_kv", choices=BLOCK_KV_CHOICES)
    name = resolve_impl("pack_indexer_k_cache_fp4", impl, {"device": k.device})
    return _pack_indexer_k_cache_fp4_op(k.contiguous(), block_kv, name)
