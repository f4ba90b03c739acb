"""Triton kernels (``@triton.jit`` bodies and their launchers), one module per op family.

Modules here import ``triton`` at import time; the public ops import them only when a call
routes to ``impl="triton"``.
"""
