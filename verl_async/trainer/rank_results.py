"""What a rank's `compute_log_prob` and `update` calls return, gathered over micro-batches and optimizer steps."""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

import numpy as np
import torch

from verl_async.utils import device as device_layer

METRIC_KEYS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl", "actor/entropy",
               "actor/kl_loss", "actor/loss", "distillation/loss", "distillation/abs_loss", "distillation/student_mass",
               "distillation/teacher_mass")


class LogProbRows:
    """Rows and their log-probs (and entropy) over a call's micro-batches, in `compute_log_prob`'s result form."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.logps: list[torch.Tensor] = []
        self.ents: list[torch.Tensor] = []

    def add(self, rows: Iterable[int], logp: torch.Tensor, ent: Optional[torch.Tensor]) -> None:
        rows = list(rows)
        if rows:  # an empty micro-batch is a dummy that kept this rank in step
            self.rows.extend(rows)
            self.logps.append(logp.float().cpu())
            if ent is not None:
                self.ents.append(ent.float().cpu())

    def result(self, width: int, calculate_entropy: bool) -> dict[str, Any]:
        empty = torch.zeros(0, width)
        return {"rows": self.rows, "log_probs": torch.cat(self.logps) if self.logps else empty,
                "entropy": (torch.cat(self.ents) if self.ents else empty) if calculate_entropy else None}


def no_reference_model() -> RuntimeError:
    return RuntimeError("compute_ref_log_prob: no reference model (actor.use_kl_loss and "
                        "algorithm.use_kl_in_reward are both false)")


class UpdateStats:
    """One `update()` call's bookkeeping: per-optimizer-step loss metrics, grad norms, skipped steps.

    Loss-type metrics arrive per step as exact mini-batch values (shares summed over
    micro-batches and ranks); the result averages the finite ones over the steps.
    """

    def __init__(self) -> None:
        self.values: dict[str, list[float]] = {k: [] for k in METRIC_KEYS}
        self.grad_norms: list[float] = []
        self.skipped = 0
        self.steps = 0
        self.errors: list[str] = []
        self.tokens = 0
        self.first_ratio_dev: Optional[float] = None  # max |PPO ratio - 1| over the first mini-batch
        self.t0 = time.perf_counter()

    def add_step(self, step_metrics: dict[str, float], grad_norm: float, skipped: bool) -> None:
        self.steps += 1
        self.skipped += int(skipped)
        self.grad_norms.append(grad_norm)
        for k in METRIC_KEYS:
            if np.isfinite(step_metrics[k]):  # a skipped (overflowed) step would turn the mean into inf
                self.values[k].append(step_metrics[k])

    def metrics(self, settings: Any, *, lr: float, total_skipped: int, global_step: int) -> dict[str, Any]:
        s = settings
        out: dict[str, Any] = {k: float(np.mean(v)) if v else float("nan") for k, v in self.values.items()}
        if not s.use_kl_loss:
            out.pop("actor/kl_loss")
        if s.entropy_coeff == 0:
            out.pop("actor/entropy")
        distillation = getattr(s, "distillation", None)
        topk = distillation is not None and distillation.uses_topk
        for key, shown in (("distillation/loss", distillation is not None), ("distillation/abs_loss", not topk
                           and distillation is not None), ("distillation/student_mass", topk),
                           ("distillation/teacher_mass", topk)):
            if not shown:
                out.pop(key)
        finite_norms = [g for g in self.grad_norms if np.isfinite(g)]
        out.update({
            "actor/grad_norm": float(np.mean(finite_norms)) if finite_norms else float("nan"),
            "actor/lr": lr,
            "actor/skipped_steps": float(self.skipped),
            "actor/total_skipped_steps": float(total_skipped),
            "actor/optimizer_steps": float(self.steps - self.skipped),
            "actor/global_step": float(global_step),
            "perf/forward_tokens_rank": float(self.tokens),
            "perf/train_time_s": time.perf_counter() - self.t0,
            "perf/max_memory_allocated_gb": device_layer.peak_memory_bytes(s.device) / 2**30,
        })
        if self.first_ratio_dev is not None:
            out["actor/first_minibatch_ratio_dev_max"] = self.first_ratio_dev
        if s.use_kl_loss:
            out["actor/kl_coef"] = s.kl_loss_coef
        if self.errors:
            out["actor/skip_reasons"] = self.errors[:4]
        return out


def nonfinite_grads(named_params: Iterable[tuple[str, torch.nn.Parameter]], limit: int = 5) -> list[str]:
    """Names of parameters whose (local shard of the) gradient holds inf/NaN: the first `limit`, then a count."""
    bad = []
    for name, p in named_params:
        grad = p.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        if local.numel() and not bool(torch.isfinite(local).all()):
            bad.append(name)
    return bad[:limit] + ([f"... {len(bad) - limit} more"] if len(bad) > limit else [])
