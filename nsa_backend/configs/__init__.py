"""Launch configurations of the Triton kernels, one module per op family, kept as data."""
