"""On-policy distillation's teachers on the rollout side (verl's `distillation.*`, docs/verl_v1.md).

`model.py` scores a sequence with an HF causal LM (per-token log-probs, top-k); `pool.py` runs replicas
(Ray actors or in-process), batches their requests and routes each response by `distillation.teacher_key`.
The config side (keys, verl's rules) is verl_async/config/distillation.py; the losses verl_async/algos/distillation.py.
"""
