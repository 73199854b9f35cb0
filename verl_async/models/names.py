"""The model paths verl_async understands besides HF ids and folders (no heavy imports: config uses it)."""

from __future__ import annotations

SCHEME = "builtin://"
DEMO_MODELS = ("tiny", "tiny-random")  # built locally (models/builtin.py)
REAL_MODELS = ("smollm2-135m-instruct",)  # converted from a PyPI wheel's GGUF file (models/gguf.py)
BUILTIN_MODELS = DEMO_MODELS + REAL_MODELS


def is_builtin(path: str) -> bool:
    return str(path).startswith(SCHEME)


def is_demo_model(path: str) -> bool:
    """The tiny built-in models, whose config defaults differ (verl_async.config.resolvers)."""
    return is_builtin(path) and str(path)[len(SCHEME):] in DEMO_MODELS


def is_gguf(path: str) -> bool:
    return str(path).lower().endswith(".gguf")
