"""Framework integrations of nsa-backend (installed as ``nsa_backend_integrations``).

Each sub-package imports its framework lazily, so importing this package never pulls in
SGLang or vLLM.
"""
