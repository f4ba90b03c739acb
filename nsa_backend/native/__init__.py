"""Thin wrappers that call DeepGEMM, FlashMLA and FlashInfer with nsa-backend's op signatures.

Each module imports its package only when one of its functions is first called; routing
(:mod:`nsa_backend.routing`) decides when a native kernel supports a call.
"""
