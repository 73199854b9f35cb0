"""The native torch inference engine (continuous batching on the trainer's HF model class)."""

from verl_async.versions import check_transformers

check_transformers()  # before any model is built: outside the supported range, say so (verl_async/versions.py)

from verl_async.rollout.native.engine import NativeEngine
from verl_async.rollout.native.weights import WeightUpdateError

__all__ = ["NativeEngine", "WeightUpdateError"]
