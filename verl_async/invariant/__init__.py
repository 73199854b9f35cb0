"""True on-policy numerics: batch-invariant kernels shared by the native engine and the FSDP2 trainer.

`shapes` (the fixed call shapes and the process environment), `ops` (linear, RMSNorm, SiLU),
`attention` (one attention for KV-cache decode and packed training), `model` (patch an HF model
in place), `logprob` (the sampled token's log-prob, the trainer's recomputation of it).
"""

from verl_async.invariant.model import attention_span, invariant_problem, make_invariant
from verl_async.invariant.shapes import PROCESS_ENV, environment_problem, shapes_for

__all__ = ["PROCESS_ENV", "attention_span", "environment_problem", "invariant_problem", "make_invariant", "shapes_for"]
