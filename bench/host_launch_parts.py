"""Host time of the parts of one eager decode-path call on a GPU, with the cached launches on.

For the sparse MLA decode (split kernel and merge) and the paged indexer logits at the eager family's
shapes: the public op, then per kernel launch the signature key of
:class:`nsa_backend.kernels._launch.CachedLauncher`, the compiled kernel's own ``run`` (Triton's launcher
alone), the cached launch (key, lookup and ``run``) and Triton's ``kernel[grid](...)``; beside them a
``torch.empty`` and a one-element torch op. Median microseconds of 300 calls, the GPU idle at each::

    DISABLE_MMA_V3=1 NSA_BACKEND_FORCE_ARCH=sm120 NSA_BACKEND_GLUON=0 python bench/host_launch_parts.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from triton.runtime.driver import driver

from nsa_backend.bench import eager
from nsa_backend.kernels.indexer import _launch_indexer_paged_logits
from nsa_backend.kernels.sparse_mla_decode import _launch_sparse_mla_fwd
from nsa_backend.kernels.sparse_mla_decode.merge import _launch_merge


def host_us(fn: Callable[[], object], calls: int = 300) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _recorded_launches(launchers, call) -> list[tuple]:
    """``(launcher, grid, args, kwargs)`` of the last call of ``call`` through each of ``launchers``."""
    seen = []
    for launcher in launchers:
        def spy(grid, *args, _launcher=launcher, _own=launcher._launch, **kwargs):
            seen.append((_launcher, grid, args, kwargs))
            return _own(grid, *args, **kwargs)
        launcher._launch = spy
    try:
        call()
        call()  # the second call of a signature takes the cached path
    finally:
        for launcher in launchers:
            del launcher._launch
    return seen[-len(launchers):]


def main() -> int:
    if not torch.cuda.is_available():
        print("host_launch_parts.py: it times launches on a GPU: no CUDA device is visible", file=sys.stderr)
        return 2
    os.environ["NSA_BACKEND_FAST_LAUNCH"] = "1"  # read at every launch
    dev = torch.device("cuda")
    cases = eager._cases(dev, quick=False)
    x = torch.zeros(16, device=dev)
    print(f"torch.empty bf16 [32, 1, 64, 512]: "
          f"{host_us(lambda: torch.empty(32, 1, 64, 512, dtype=torch.bfloat16, device=dev)):.1f} us")
    print(f"x.add_(1): {host_us(lambda: x.add_(1)):.1f} us")
    stream = driver.active.get_current_stream(torch.cuda.current_device())
    for op, launchers in (("sparse_mla_decode", (_launch_sparse_mla_fwd, _launch_merge)),
                          ("fp8_paged_mqa_logits", (_launch_indexer_paged_logits,))):
        call = cases[op][1]
        print(f"== {op}: public {host_us(lambda call=call: call('triton')):.1f} us")
        for launcher, grid, args, kwargs in _recorded_launches(launchers, lambda call=call: call("triton")):
            compiled, tail = launcher._plans[launcher._key(args, kwargs)]
            g1 = grid[1] if len(grid) > 1 else 1
            g2 = grid[2] if len(grid) > 2 else 1

            def run(c=compiled, grid=grid, g1=g1, g2=g2, args=args, tail=tail):
                c.run(grid[0], g1, g2, stream, c.function, c.packed_metadata, None, None, None, *args, *tail)

            key = host_us(lambda launcher=launcher, args=args, kwargs=kwargs: launcher._key(args, kwargs))
            cached = host_us(lambda launcher=launcher, grid=grid, args=args, kwargs=kwargs:
                             launcher._launch(grid, *args, **kwargs))
            own = host_us(lambda launcher=launcher, grid=grid, args=args, kwargs=kwargs:
                          launcher.kernel[grid](*args, **kwargs))
            print(f"  {len(args)} + {len(tail)} arguments: key {key:.1f} us, compiled run {host_us(run):.1f} us, "
                  f"cached launch {cached:.1f} us, Triton's launch {own:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
