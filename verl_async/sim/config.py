"""Simulator settings (verl key names where one exists) and the named policies.

Policies are two orthogonal choices: the pipeline (``sync``: staleness 0 and a sync
after every step, i.e. the colocated generate -> train -> sync loop; ``async``:
the given staleness/trigger/partial_rollout) and the dispatch (``plain``: every
response to any replica; ``pdsr``: probe, rank, offload, cap, breaker).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from verl_async.sim.speed import ConstantSpeed, SpeedModel
from verl_async.staleness import max_required_samples

KV_ADMISSION = ("reserve", "actual")


@dataclass(frozen=True)
class PDSRConfig:
    offload_ratio: float = 0.2
    cap_factor: float = 1.5
    cap_mode: str = "l_cut"              # l_cut (the documented rule) | probe (cap per prompt's own probe)
    heavy_replicas: int = 1              # the LAST heavy_replicas replica indices are heavy
    fast_max_num_seqs: int | None = None  # None: max_num_seqs
    restart: bool = False                # moved responses restart instead of continuing
    batch_size: int | None = None        # prompts per P-DSR batch; None: required_samples
    probe_on_heavy: bool = True          # heavy replicas also run probes (after heavy work)
    fast_steal_heavy: bool = False       # not P-DSR as documented: idle fast replicas also take heavy work
    truth: str = "mean"                  # top-k precision ground truth: mean | max


@dataclass(frozen=True)
class SimConfig:
    # batch shape (verl names)
    n: int = 8                                  # actor_rollout_ref.rollout.n
    ppo_mini_batch_size: int = 16               # groups per mini-batch
    require_batches: int = 1
    num_steps: int | None = None                # None: as many as the workload allows
    max_response_length: int = 4096             # data.max_response_length
    # pipeline (async_training.*)
    staleness_threshold: float = 0.0
    trigger_parameter_sync_step: int = 1
    partial_rollout: bool = True
    queue_capacity: int | None = None           # None: max_required_samples
    max_inflight_groups: int | None = None      # None: only the staleness gate limits
    # replicas
    replicas: int = 1
    speed: SpeedModel = field(default_factory=lambda: ConstantSpeed(1.0))
    max_num_seqs: int = 64
    kv_budget_tokens: int | None = None         # per replica; None: unbounded
    kv_admission: str = "reserve"               # reserve: prompt + max_tokens; actual: prompt + final length
    # trainer
    train_a: float = 0.0                        # step time = train_a + train_b * tokens
    train_b: float = 0.0                        # tokens = sum over responses of prompt_len + len
    sync_time: float = 0.0                      # seconds per parameter sync
    # dispatch
    dispatch: str = "plain"                     # plain | pdsr
    pdsr: PDSRConfig = field(default_factory=PDSRConfig)

    @property
    def required_samples(self) -> int:
        return self.ppo_mini_batch_size * self.require_batches

    @property
    def max_required(self) -> int:
        return max_required_samples(self.required_samples, self.trigger_parameter_sync_step,
                                    self.staleness_threshold)

    def validate(self) -> "SimConfig":
        ints = {"n": 1, "ppo_mini_batch_size": 1, "require_batches": 1,
                "max_response_length": 1, "trigger_parameter_sync_step": 1, "replicas": 1,
                "max_num_seqs": 1}
        for key, lo in ints.items():
            if int(getattr(self, key)) < lo:
                raise ValueError(f"{key} must be >= {lo}, got {getattr(self, key)}")
        for key in ("num_steps", "queue_capacity", "max_inflight_groups", "kv_budget_tokens"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ValueError(f"{key} must be >= 1 or null, got {v}")
        for key in ("staleness_threshold", "train_a", "train_b", "sync_time"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.kv_admission not in KV_ADMISSION:
            raise ValueError(f"kv_admission must be one of {KV_ADMISSION}, got {self.kv_admission!r}")
        if self.queue_capacity is not None and self.queue_capacity < self.required_samples:
            raise ValueError(f"queue_capacity {self.queue_capacity} < required_samples "
                             f"{self.required_samples}: the trainer could never take a batch")
        if self.dispatch not in ("plain", "pdsr"):
            raise ValueError(f"dispatch must be 'plain' or 'pdsr', got {self.dispatch!r}")
        if self.dispatch == "pdsr":
            p = self.pdsr
            if not 1 <= p.heavy_replicas < self.replicas:
                raise ValueError(f"pdsr.heavy_replicas must be in [1, replicas-1] = [1, {self.replicas - 1}], "
                                 f"got {p.heavy_replicas} (P-DSR needs a fast and a heavy replica)")
            if not 0 <= p.offload_ratio <= 1:
                raise ValueError(f"pdsr.offload_ratio must be in [0, 1], got {p.offload_ratio}")
            if not p.cap_factor > 0:
                raise ValueError(f"pdsr.cap_factor must be > 0, got {p.cap_factor}")
            if p.cap_mode not in ("l_cut", "probe"):
                raise ValueError(f"pdsr.cap_mode must be 'l_cut' or 'probe', got {p.cap_mode!r}")
            if p.truth not in ("mean", "max"):
                raise ValueError(f"pdsr.truth must be 'mean' or 'max', got {p.truth!r}")
            for key in ("fast_max_num_seqs", "batch_size"):
                v = getattr(p, key)
                if v is not None and v < 1:
                    raise ValueError(f"pdsr.{key} must be >= 1 or null, got {v}")
        return self


POLICIES = ("sync", "async", "pdsr", "sync-pdsr")


def policy_config(base: SimConfig, policy: str) -> SimConfig:
    """The settings of a named policy, derived from ``base``.

    sync: staleness 0, sync every step (generate a batch, train, sync); async: base
    pipeline settings; pdsr: async + P-DSR; sync-pdsr: sync + P-DSR.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} unknown: one of {POLICIES}")
    cfg = base
    if policy.startswith("sync"):
        cfg = replace(cfg, staleness_threshold=0.0, trigger_parameter_sync_step=1)
    cfg = replace(cfg, dispatch="pdsr" if policy.endswith("pdsr") else "plain")
    return cfg.validate()
