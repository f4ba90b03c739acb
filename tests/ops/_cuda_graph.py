"""CUDA-graph capture for the GPU tests of decode-type kernels."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Run ``fn`` once on a side stream (compiles and warms up outside the capture), then capture one
    call in a CUDA graph; returns the graph (not replayed yet) and the outputs its replays write."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out
