"""The native torch inference engine (continuous batching on the trainer's HF model class)."""

from verl_async.rollout.native.engine import NativeEngine
from verl_async.rollout.native.weights import WeightUpdateError

__all__ = ["NativeEngine", "WeightUpdateError"]
