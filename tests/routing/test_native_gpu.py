"""Native wrappers on a real GPU against the plain-PyTorch reference (skipped where the package does
not load). On the H200, FlashMLA (``sgl-flash-mla``) loads: see ../shared/tools/native-wheels.sh."""

from __future__ import annotations

import pytest
import torch

import nsa_backend as nb
from nsa_backend import reference, routing

pytestmark = pytest.mark.gpu


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity gap 1 - 2 sum(xy) / sum(x^2 + y^2)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-30))


def _require(name: str) -> None:
    status = routing.probe_natives()[name]
    if not status.available:
        pytest.skip(f"{name} does not load here: {status.error}")


@pytest.fixture(autouse=True)
def _fresh():
    routing.reset_config()
    yield
    routing.reset_config()


def test_detect_arch_on_this_gpu():
    arch = routing.detect_arch()
    major, minor = torch.cuda.get_device_capability()
    assert arch == routing.family_from_capability(major, minor) or torch.version.hip is not None
    assert routing.hardware_arch(torch.device("cuda")) == arch


@pytest.mark.parametrize(("h_q", "d_qk", "topk"), [
    (128, 576, 2048),    # DeepSeek-V3.2 TP=1
    (64, 576, 2048),     # GLM-5 TP=1
    (16, 576, 2048),     # DeepSeek-V3.2 TP=8: padded to 64
    (64, 512, 512),      # DeepSeek-V4
    (64, 576, 100),      # top-k not a multiple of the kernel block: padded with -1
])
def test_flash_mla_prefill_matches_reference(h_q, d_qk, topk):
    _require("flash_mla")
    if routing.detect_arch() not in ("sm90", "sm100", "sm103"):
        pytest.skip("FlashMLA has kernels for sm90 and sm100/sm103 only")
    s_q, s_kv = 256, 4096
    q = torch.randn(s_q, h_q, d_qk, device="cuda").bfloat16()
    kv = torch.randn(s_kv, 1, d_qk, device="cuda").bfloat16()
    idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32)
    idx[::7, :, topk // 2:] = -1
    sink = torch.randn(h_q, device="cuda")
    scale = d_qk ** -0.5
    out, max_logits, lse = nb.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, impl="flash_mla")
    r_out, r_max, r_lse = reference.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sink, None)
    assert out.shape == r_out.shape and lse.shape == r_lse.shape
    assert calc_diff(out, r_out) < 1e-4, (h_q, d_qk, topk)
    assert torch.allclose(lse, r_lse, atol=1e-3, rtol=1e-3)
    assert torch.allclose(max_logits, r_max, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(("h_q", "s_q", "topk"), [(128, 1, 2048), (16, 1, 2048), (32, 2, 2048), (64, 2, 512),
                                             (64, 1, 200)])
def test_flash_mla_decode_matches_reference(h_q, s_q, topk):
    _require("flash_mla")
    if routing.detect_arch() not in ("sm90", "sm100", "sm103"):
        pytest.skip("FlashMLA has kernels for sm90 and sm100/sm103 only")
    page, blocks, batch = 64, 96, 8
    tokens = page * blocks
    kv = torch.randn(tokens, 576, device="cuda").bfloat16()
    cache = nb.pack_fp8_ds_mla(kv, "pow2").view(blocks, page, 656)
    q = torch.randn(batch, s_q, h_q, 576, device="cuda").bfloat16()
    idx = torch.randint(0, tokens, (batch, s_q, topk), device="cuda", dtype=torch.int32)
    idx[0, :, topk // 3:] = -1
    idx[1, :, :5] = tokens + 10     # outside the cache: invalid
    topk_length = torch.full((batch,), topk, device="cuda", dtype=torch.int32)
    topk_length[2] = topk // 2
    out, lse = nb.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla", None, topk_length,
                                    impl="flash_mla")
    r_out, r_lse = reference.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla", None, topk_length)
    assert calc_diff(out, r_out) < 1e-3
    assert torch.allclose(lse, r_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize("warm", [True, False], ids=["schedule-kept-before-capture", "first-call-captured"])
def test_flash_mla_decode_schedule_under_cuda_graph(warm):
    """The wrapper's FlashMLA schedule, kept per shape, gives the same outputs eagerly and in graph
    replays, whether the shape was first seen eagerly or first inside a capture."""
    _require("flash_mla")
    if routing.detect_arch() not in ("sm90", "sm100", "sm103"):
        pytest.skip("FlashMLA has kernels for sm90 and sm100/sm103 only")
    from nsa_backend.native import flash_mla as fm_wrap

    fm_wrap.clear_decode_schedules()
    page, blocks, batch, topk = 64, 40, 5, 512
    kv = torch.randn(page * blocks, 576, device="cuda").bfloat16()
    cache = nb.pack_fp8_ds_mla(kv, "pow2").view(blocks, page, 656)
    q = torch.randn(batch, 2, 64, 576, device="cuda").bfloat16()
    idx = torch.randint(-1, page * blocks + 9, (batch, 2, topk), device="cuda", dtype=torch.int32)
    length = torch.tensor([topk, 100, 3, 511, 7], device="cuda", dtype=torch.int32)

    def run():
        return fm_wrap.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla", None, length)

    if warm:
        want = run()
    else:  # only the schedule is new to the capture, not the index kernel
        from nsa_backend.kernels.slots import mask_invalid_slots
        mask_invalid_slots(idx, page * blocks, length, topk)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        got = run()
    torch.cuda.current_stream().wait_stream(s)
    g.replay()
    torch.cuda.synchronize()
    if not warm:
        want = run()
    r_out, r_lse = reference.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla", None, length)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert calc_diff(want[0], r_out) < 1e-3
    fin = torch.isfinite(r_lse)
    assert torch.equal(fin, torch.isfinite(want[1])) and torch.allclose(want[1][fin], r_lse[fin], atol=1e-2, rtol=1e-3)
    fm_wrap.clear_decode_schedules()


def test_deep_gemm_indexer_matches_reference():
    _require("deep_gemm")
    if routing.detect_arch() not in ("sm90", "sm100", "sm103"):
        pytest.skip("DeepGEMM's indexer runs on sm90 and sm100/sm103 only")
    s, n, h, d = 128, 2048, 32, 128
    q = torch.randn(s, h, d, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(n, d, device="cuda").to(torch.float8_e4m3fn)
    k_scale = torch.rand(n, device="cuda") + 0.1
    w = torch.randn(s, h, device="cuda")
    ks = torch.zeros(s, dtype=torch.int32, device="cuda")
    ke = torch.arange(n - s + 1, n + 1, dtype=torch.int32, device="cuda")
    out = nb.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, impl="deep_gemm")
    ref = reference.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, True, 0)
    mask = torch.isinf(ref)
    assert torch.equal(torch.isinf(out), mask)
    assert calc_diff(out[~mask], ref[~mask]) < 1e-3


def test_auto_routes_on_this_gpu():
    arch = routing.detect_arch()
    q = torch.randn(4, 64, 576, device="cuda").bfloat16()
    feats = {"device": q.device, "num_heads": 64, "d_qk": 576, "topk": 2048}
    impl = routing.select_impl("flash_mla_sparse_fwd", "auto", feats)
    if arch in ("sm90", "sm100", "sm103") and routing.probe_natives()["flash_mla"].available:
        assert impl == "flash_mla"
    else:
        assert impl in ("triton", "reference")


@pytest.mark.parametrize("h_q", [16, 24, 32, 64])
def test_auto_decode_route_on_this_gpu(h_q):
    """``impl="auto"`` decode with few heads: on sm_90 with Gluon it takes Triton up to 32 heads (faster
    than FlashMLA on padded heads), FlashMLA at 64; every route matches the reference."""
    from nsa_backend.routing import capabilities as caps

    page, blocks, batch = 64, 32, 4
    tokens = page * blocks
    kv = torch.randn(tokens, 576, device="cuda").bfloat16()
    cache = nb.pack_fp8_ds_mla(kv, "arbitrary").view(blocks, page, 656)
    q = torch.randn(batch, 1, h_q, 576, device="cuda").bfloat16()
    idx = torch.randint(-1, tokens, (batch, 1, 512), device="cuda", dtype=torch.int32)
    feats = {"device": q.device, "num_heads": h_q, "d_qk": 576, "topk": 512, "s_q": 1, "kv_format": "fp8_ds_mla",
             "page_size": page}
    impl = routing.select_impl("sparse_mla_decode", "auto", feats)
    arch = routing.detect_arch()
    if arch == "sm90" and routing.probe_natives()["flash_mla"].available:
        assert impl == ("triton" if h_q <= 32 and caps.gluon_usable(arch) else "flash_mla")
    out, lse = nb.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla")
    r_out, r_lse = reference.sparse_mla_decode(q, cache, idx, 576 ** -0.5, 512, "fp8_ds_mla")
    assert calc_diff(out, r_out) < 1e-3
    assert torch.allclose(lse, r_lse, atol=1e-2, rtol=1e-3)
