"""Calibrate the simulator from one run's logs and predict another run's wall time.

Decode speed: continuous batching spends one engine step per token of every
running sequence, so a response of ``len`` tokens that ran for ``d`` seconds (sync
pauses removed) obeys ``d = c0 * len + c1 * sum over its tokens of batch``, with
batch = responses running on its replica at that token. The batch is rebuilt from
all responses' [start, end] on each replica; the token-weighted mean batch needs
the speed itself, so the fit iterates a few times from the time-weighted mean.
Caveats for real logs: ``start`` should be when the engine admitted the response
(queue wait inside [start, end] reads as slower decoding), and moved (P-DSR)
responses are left out, because one record cannot say when it changed replica.

Trainer: least squares ``duration = a + b * info.tokens`` over ``train`` spans
(``b = 0`` when the spans carry no ``info.tokens``); sync: mean ``sync`` span.

Run settings come from ``<run_dir>/config.yaml`` (or ``.hydra/config.yaml``) in
verl key names when present, and from the logs (n, replicas, P-DSR probe flags).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from verl_async.sim.config import PDSRConfig, SimConfig
from verl_async.sim.runlog import RunLogError, read_lengths, read_timeline
from verl_async.sim.speed import StepLatencySpeed

# SimConfig field -> verl key (config.yaml of a run)
VERL_KEYS = {
    "n": "actor_rollout_ref.rollout.n",
    "ppo_mini_batch_size": "actor_rollout_ref.actor.ppo_mini_batch_size",
    "require_batches": "async_training.require_batches",
    "staleness_threshold": "async_training.staleness_threshold",
    "trigger_parameter_sync_step": "async_training.trigger_parameter_sync_step",
    "partial_rollout": "async_training.partial_rollout",
    "queue_capacity": "async_training.queue_capacity",
    "max_response_length": "data.max_response_length",
    "max_num_seqs": "actor_rollout_ref.rollout.max_num_seqs",
    "kv_budget_tokens": "actor_rollout_ref.rollout.kv_cache_tokens",
}
LONG_TAIL_PREFIX = "async_training.long_tail"
# PDSRConfig field -> key under async_training.long_tail
LONG_TAIL_KEYS = {"offload_ratio": "offload_ratio", "cap_factor": "cap_factor", "cap_mode": "cap_mode",
                  "heavy_replicas": "heavy_replicas", "fast_max_num_seqs": "fast_max_num_seqs",
                  "restart": "restart", "batch_size": "batch_size"}


@dataclass
class Calibration:
    c0: float
    c1: float
    train_a: float
    train_b: float
    sync_time: float
    replicas: int
    max_concurrency: int
    details: dict = field(default_factory=dict)

    @property
    def speed(self) -> StepLatencySpeed:
        return StepLatencySpeed(self.c0, self.c1)

    def apply(self, cfg: SimConfig) -> SimConfig:
        return replace(cfg, speed=self.speed, train_a=self.train_a, train_b=self.train_b,
                       sync_time=self.sync_time)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: not a calibration file ({e})") from e


def _responses_by_replica(groups: list[dict]) -> dict[int, list[dict]]:
    by = defaultdict(list)
    for g in groups:
        for r in g["responses"]:
            by[r["replica"]].append(r)
    return by


def _fit_linear(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Weighted least squares y = p0 + p1 * x with p0 > 0 and p1 >= 0."""
    sw = np.sqrt(w)
    if len(x) >= 2 and np.ptp(x) > 0:
        (p0, p1), *_ = np.linalg.lstsq(np.stack([sw, sw * x], 1), sw * y, rcond=None)
    else:
        p0, p1 = float(np.average(y, weights=w)), 0.0
    if p1 < 0:
        p0, p1 = float(np.average(y, weights=w)), 0.0
    if p0 <= 0:
        p0 = 1e-9
        p1 = max(0.0, float(np.sum(w * (y - p0) * x) / max(np.sum(w * x * x), 1e-30)))
    return float(p0), float(p1)


def fit_speed(groups: list[dict], pauses: list[tuple[float, float]], iterations: int = 4) -> tuple[
        float, float, dict]:
    """(c0, c1, details) of the step-latency model from response intervals."""
    pieces = []          # per replica: (concurrency, running seconds) between consecutive cut times
    rows = []            # per response: (piece list index, first piece, end piece, len, seconds)
    max_conc = 0
    for replica, resps in sorted(_responses_by_replica(groups).items()):
        ivs = [(r["start"], r["end"]) for r in resps if not r["moved"]]
        cuts = np.array(sorted({t for iv in ivs for t in iv} | {t for p in pauses for t in p}))
        if len(cuts) < 2:
            continue
        mids = (cuts[:-1] + cuts[1:]) / 2
        conc = (np.searchsorted(np.sort([a for a, _ in ivs]), mids, "right")
                - np.searchsorted(np.sort([b for _, b in ivs]), mids, "right")).astype(float)
        run_dt = np.diff(cuts)
        for a, b in pauses:
            run_dt[(mids > a) & (mids < b)] = 0.0
        max_conc = max(max_conc, int(conc.max(initial=0)))
        pieces.append((conc, run_dt))
        for r in resps:
            if r["moved"] or r["len"] <= 0 or r["end"] <= r["start"]:
                continue
            i0, i1 = np.searchsorted(cuts, [r["start"], r["end"]])
            rows.append((len(pieces) - 1, int(i0), int(i1), float(r["len"])))
    if not rows:
        raise RunLogError("no usable responses (need len > 0, end > start, not moved) to fit the speed")
    idx, i0, i1, lens = (np.array(c) for c in zip(*rows))

    def integral(values_of) -> np.ndarray:
        """Per response: sum over its pieces of values_of(conc, run_dt), via prefix sums."""
        out = np.empty(len(rows))
        for k, (conc, run_dt) in enumerate(pieces):
            cum = np.concatenate([[0.0], np.cumsum(values_of(conc, run_dt))])
            m = idx == k
            out[m] = cum[i1[m]] - cum[i0[m]]
        return out

    secs = integral(lambda c, d: d)
    keep = secs > 0
    y, w = secs[keep] / lens[keep], lens[keep]
    c0, c1 = 1.0, 0.0
    for _ in range(iterations):
        # token-weighted mean batch: the tokens of a piece ~ seconds / step_latency(batch)
        lat0, lat1 = c0, c1
        tok = integral(lambda c, d: d / (lat0 + lat1 * c))
        bbar = (integral(lambda c, d: c * d / (lat0 + lat1 * c)) / np.maximum(tok, 1e-30))[keep]
        c0, c1 = _fit_linear(bbar, y, w)
    rel = (c0 + c1 * bbar - y) / y
    bins = np.rint(bbar).astype(int)
    table = [{"batch": int(b), "tokens_per_s": float(1 / np.average(y[bins == b], weights=w[bins == b])),
              "responses": int((bins == b).sum())} for b in np.unique(bins)]
    # a run whose batch hardly varied pins the speed at that batch only (c1 is then
    # a guess): the observed range tells how far a prediction extrapolates
    return c0, c1, {"responses_fitted": int(keep.sum()), "rel_err_rms": float(np.sqrt(np.mean(rel ** 2))),
                    "max_concurrency": max_conc,
                    "batch_p5_p95": [float(np.percentile(bbar, 5)), float(np.percentile(bbar, 95))],
                    "speed_table": table}


def fit_trainer(spans: list[dict]) -> tuple[float, float, float, dict]:
    """(train_a, train_b, sync_time, details) from timeline spans."""
    train = [s for s in spans if s["kind"] == "train"]
    if not train:
        raise RunLogError("timeline has no 'train' spans to fit the trainer")
    dur = np.array([s["end"] - s["start"] for s in train])
    tok = [s["info"].get("tokens") for s in train]
    details: dict = {"train_spans": len(train)}
    if all(isinstance(t, (int, float)) for t in tok):
        a, b = _fit_linear(np.array(tok, dtype=float), dur, np.ones_like(dur))
        if a <= 1e-9:
            a = 0.0
    else:
        a, b = float(dur.mean()), 0.0
        details["note"] = "train spans carry no info.tokens: step time fitted as a constant"
    syncs = [s["end"] - s["start"] for s in spans if s["kind"] == "sync"]
    details["sync_spans"] = len(syncs)
    return a, b, float(np.mean(syncs)) if syncs else 0.0, details


def calibrate(run_dir: str | Path) -> Calibration:
    groups = read_lengths(run_dir)
    spans = read_timeline(run_dir)
    pauses = [(s["start"], s["end"]) for s in spans if s["kind"] == "sync"]
    c0, c1, sdet = fit_speed(groups, pauses)
    a, b, sync, tdet = fit_trainer(spans)
    replicas = 1 + max(r["replica"] for g in groups for r in g["responses"])
    return Calibration(c0, c1, a, b, sync, replicas, sdet["max_concurrency"],
                       {"run_dir": str(run_dir), **sdet, **tdet})


def _load_config(run_dir: Path):
    for p in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        if p.is_file():
            from omegaconf import OmegaConf

            return OmegaConf.load(p)
    return None


def run_settings(run_dir: str | Path) -> dict:
    """SimConfig keyword arguments a run dir tells: config.yaml keys, then its logs."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    out: dict = {}
    conf = _load_config(run_dir)
    if conf is not None:
        for key, path in VERL_KEYS.items():
            v = OmegaConf.select(conf, path, default=None)
            if v is not None:
                out[key] = v
        lt = OmegaConf.select(conf, LONG_TAIL_PREFIX, default=None)
        if lt is not None and lt.get("enable", False):
            out["dispatch"] = "pdsr"
            out["pdsr"] = PDSRConfig(**{f: lt[k] for f, k in LONG_TAIL_KEYS.items() if lt.get(k) is not None})
    groups = read_lengths(run_dir)
    sizes = {len(g["responses"]) for g in groups}
    if len(sizes) != 1:
        raise RunLogError(f"{run_dir}: groups have different response counts {sorted(sizes)}")
    n = sizes.pop()
    if out.get("n", n) != n:
        raise RunLogError(f"{run_dir}: config n={out['n']} but the length log has {n} responses per group")
    out["n"] = n
    out["replicas"] = 1 + max(r["replica"] for g in groups for r in g["responses"])
    if "dispatch" not in out and any(r["probe"] for g in groups for r in g["responses"]):
        out["dispatch"] = "pdsr"
    out.setdefault("max_response_length", max(r["len"] for g in groups for r in g["responses"]))
    return out


def verl_config(cfg: SimConfig) -> dict:
    """The nested verl-key config a simulated run dir records (inverse of run_settings)."""
    root: dict = {}

    def put(path: str, value) -> None:
        node = root
        *parents, leaf = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    for key, path in VERL_KEYS.items():
        put(path, getattr(cfg, key))
    put(f"{LONG_TAIL_PREFIX}.enable", cfg.dispatch == "pdsr")
    for f, k in LONG_TAIL_KEYS.items():
        put(f"{LONG_TAIL_PREFIX}.{k}", getattr(cfg.pdsr, f))
    return root


def measured_wall(run_dir: str | Path) -> tuple[float, int]:
    """(wall seconds from the first generation start to the last train end, train steps)."""
    spans = read_timeline(run_dir)
    train = [s for s in spans if s["kind"] == "train"]
    if not train:
        raise RunLogError(f"{run_dir}: timeline has no 'train' spans")
    first = min(r["start"] for g in read_lengths(run_dir) for r in g["responses"])
    return max(s["end"] for s in train) - first, len(train)


PREDICT_NEEDS = ("ppo_mini_batch_size", "staleness_threshold", "trigger_parameter_sync_step",
                 "partial_rollout")


def predict(calib: Calibration, run_dir: str | Path, overrides: dict | None = None) -> dict:
    """Replay ``run_dir``'s length log under its settings with the calibrated model.

    Returns measured and predicted wall time (first generation start -> last train
    end, same number of train steps) and the relative error.
    """
    from verl_async.sim.pipeline import simulate
    from verl_async.sim.workload import groups_from_log

    settings = run_settings(run_dir)
    if "ppo_mini_batch_size" not in settings:
        sizes = {s["info"].get("groups") for s in read_timeline(run_dir) if s["kind"] == "train"}
        if len(sizes) == 1 and isinstance(next(iter(sizes)), int):
            settings["ppo_mini_batch_size"] = next(iter(sizes)) // settings.get("require_batches", 1)
    settings.update(overrides or {})
    missing = [k for k in PREDICT_NEEDS if k not in settings]
    if missing:
        raise ValueError(f"{run_dir}: cannot tell {missing} (no config.yaml with "
                         f"{[VERL_KEYS[k] for k in missing]}); pass them on the command line")
    wall, steps = measured_wall(run_dir)
    cfg = calib.apply(replace(SimConfig(), **settings, num_steps=steps))
    res = simulate(cfg, groups_from_log(run_dir))
    pred = res.summary["wall_time"]
    return {"run_dir": str(run_dir), "steps": steps, "measured_wall": wall, "predicted_wall": pred,
            "error": (pred - wall) / wall, "summary": res.summary}


def write_simulated_run(run_dir: str | Path, cfg: SimConfig, result) -> Path:
    """A simulated run as a run dir in the binding log format (+ config.yaml)."""
    from verl_async.sim.runlog import write_run_dir

    return write_run_dir(run_dir, result.length_log(), result.timeline(), verl_config(cfg))
