"""Attention-relevant excerpts of the HF ``config.json`` of supported models, for offline use
(``nsa-backend plan --model glm-5``). Only the fields that shape attention are kept."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent

# Shipped name -> file in this directory.
SHIPPED: dict[str, str] = {
    "deepseek-v3.2": "deepseek-v3.2.json",
    "glm-5": "glm-5.json",
    "deepseek-v4": "deepseek-v4.json",
}


def shipped_path(name: str) -> Path:
    """Path of a shipped config by name (``deepseek-v3.2``, ``glm-5``, ``deepseek-v4``)."""
    if name not in SHIPPED:
        raise ValueError(f"unknown shipped model {name!r}; shipped models: {list(SHIPPED)}")
    return _HERE / SHIPPED[name]


def load_model_config(name_or_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read an HF ``config.json``: a shipped name, a ``config.json`` path, or a model directory."""
    text = os.fspath(name_or_path)
    if text in SHIPPED:
        path = shipped_path(text)
    else:
        path = Path(text)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"model config {text!r}: not a shipped model ({', '.join(SHIPPED)}) and no such "
                             f"file")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"model config {path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model config {path}: expected a JSON object")
    return data
