"""Command line of scripts/simulate_schedule.py (kept here so tests call ``main(argv)``).

Modes:
  (default)            run the policies (--policy) on one workload, print a table
  --sweep              also P-DSR over --offload-ratios x --cap-factors
  --stats              the workload's length statistics (the reference notes' measures)
  --calibrate RUN_DIR  fit speed / trainer / sync from a run's logs (--save-calibration)
  --predict RUN_DIR2   predicted vs measured wall time of another run
Settings precedence: command line > calibration > the replayed run's config.yaml > defaults.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields, replace
from pathlib import Path

from verl_async.sim.calibrate import (Calibration, calibrate, predict, run_settings,
                                      write_simulated_run)
from verl_async.sim.config import POLICIES, PDSRConfig, SimConfig, policy_config
from verl_async.sim.pipeline import simulate
from verl_async.sim.speed import parse_speed
from verl_async.sim.workload import PRESETS, groups_from_log, length_stats, synthetic_groups


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simulate_schedule.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--log", help="run dir or lengths.jsonl to replay")
    w.add_argument("--synthetic", default="reference", choices=sorted(PRESETS))
    w.add_argument("--groups", type=int, help="synthetic groups (default: enough for --steps)")
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("pipeline (verl names; unset = config.yaml of --log, else defaults)")
    c.add_argument("--n", type=int)
    c.add_argument("--ppo-mini-batch-size", type=int)
    c.add_argument("--require-batches", type=int)
    c.add_argument("--steps", type=int, dest="num_steps")
    c.add_argument("--max-response-length", type=int)
    c.add_argument("--staleness-threshold", type=float)
    c.add_argument("--trigger-parameter-sync-step", type=int)
    c.add_argument("--partial-rollout", type=_bool)
    c.add_argument("--queue-capacity", type=int)
    c.add_argument("--max-inflight-groups", type=int)
    r = p.add_argument_group("replicas and trainer")
    r.add_argument("--replicas", type=int)
    r.add_argument("--speed", type=parse_speed, help="const:TPS | latency:C0,C1 | table:B=TPS,...")
    r.add_argument("--max-num-seqs", type=int)
    r.add_argument("--kv-budget-tokens", type=int)
    r.add_argument("--kv-admission", choices=["reserve", "actual"])
    r.add_argument("--train-a", type=float)
    r.add_argument("--train-b", type=float)
    r.add_argument("--sync-time", type=float)
    d = p.add_argument_group("P-DSR")
    d.add_argument("--offload-ratio", type=float)
    d.add_argument("--cap-factor", type=float)
    d.add_argument("--cap-mode", choices=["l_cut", "probe"])
    d.add_argument("--heavy-replicas", type=int)
    d.add_argument("--fast-max-num-seqs", type=int)
    d.add_argument("--restart", type=_bool)
    d.add_argument("--pdsr-batch-size", type=int, dest="batch_size")
    d.add_argument("--probe-on-heavy", type=_bool)
    d.add_argument("--fast-steal-heavy", type=_bool, help="variant, not P-DSR as documented: idle fast replicas take heavy work")
    m = p.add_argument_group("modes and output")
    m.add_argument("--policy", default="sync,async,pdsr", help=f"comma list of {POLICIES}")
    m.add_argument("--sweep", action="store_true")
    m.add_argument("--offload-ratios", type=_floats, default=[0.1, 0.2, 0.3])
    m.add_argument("--cap-factors", type=_floats, default=[1.25, 1.5, 2.0, 3.0])
    m.add_argument("--stats", action="store_true")
    m.add_argument("--calibrate", metavar="RUN_DIR")
    m.add_argument("--calibration", metavar="FILE", help="a saved calibration to use")
    m.add_argument("--save-calibration", metavar="FILE")
    m.add_argument("--predict", metavar="RUN_DIR2", action="append", default=[])
    m.add_argument("--json", metavar="OUT")
    m.add_argument("--trace-dir", metavar="DIR", help="write each simulated run as a run dir")
    m.add_argument("--markdown", action="store_true", help="print tables as markdown")
    return p


_SIM_FIELDS = {f.name for f in fields(SimConfig)}
_PDSR_FIELDS = {f.name for f in fields(PDSRConfig)}


def _explicit(args: argparse.Namespace, names: set[str]) -> dict:
    return {k: v for k, v in vars(args).items() if k in names and v is not None}


def base_config(args: argparse.Namespace, calib: Calibration | None) -> SimConfig:
    settings = run_settings(args.log) if args.log and Path(args.log).is_dir() else {}
    pdsr = settings.pop("pdsr", PDSRConfig())
    settings.pop("dispatch", None)        # the policy list decides
    cfg = replace(SimConfig(), **settings)
    if calib is not None:
        cfg = calib.apply(cfg)
    cfg = replace(cfg, **_explicit(args, _SIM_FIELDS),
                  pdsr=replace(pdsr, **_explicit(args, _PDSR_FIELDS)))
    return cfg


def workload_for(args: argparse.Namespace, cfg: SimConfig):
    if args.log:
        return groups_from_log(args.log)
    groups = args.groups
    if groups is None:
        steps = cfg.num_steps or 16
        groups = steps * cfg.required_samples + 2 * cfg.max_required
    return synthetic_groups(groups, cfg.n, args.synthetic, args.seed)


COLUMNS = [
    ("policy", "policy", "{}"), ("offload", "offload_ratio", "{}"), ("cap", "cap_factor", "{}"),
    ("wall s", "wall_time", "{:.1f}"), ("saving vs async", "saving_vs_async", "{:+.1%}"),
    ("rollout busy", "rollout_busy_ratio", "{:.2f}"), ("trainer idle", "trainer_idle_ratio", "{:.2f}"),
    ("efficiency", "pipeline_efficiency", "{:.2f}"), ("breaker", "pdsr/breaker_rate", "{:.1%}"),
    ("brk prompts", "pdsr/breaker_prompt_rate", "{:.1%}"),
    ("offloaded", "pdsr/offload_count", "{}"), ("precision", "pdsr/topk_precision", "{:.2f}"),
    ("regen tok", "regenerated_tokens", "{}"), ("lat p50", "lat_p50", "{:.1f}"),
    ("lat p95", "lat_p95", "{:.1f}"), ("lat p99", "lat_p99", "{:.1f}"),
    ("stale mean", "stale_mean", "{:.2f}"), ("stale max", "stale_max", "{}"),
]


def format_table(rows: list[dict], columns=COLUMNS, markdown: bool = True) -> str:
    def cell(row, key, fmt):
        v = row.get(key)
        return "-" if v is None else fmt.format(v)

    body = [[cell(r, k, f) for _, k, f in columns] for r in rows]
    heads = [h for h, _, _ in columns]
    width = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(heads)]
    line = lambda cells: "| " + " | ".join(c.rjust(wd) for c, wd in zip(cells, width)) + " |"
    out = [line(heads)]
    if markdown:
        out.append("|" + "|".join("-" * (wd + 2) for wd in width) + "|")
    out += [line(b) for b in body]
    return "\n".join(out)


def table_row(policy: str, cfg: SimConfig, summary: dict) -> dict:
    row = {"policy": policy, **summary}
    if cfg.dispatch == "pdsr":
        row["offload_ratio"], row["cap_factor"] = cfg.pdsr.offload_ratio, cfg.pdsr.cap_factor
    for q in ("p50", "p95", "p99"):
        row[f"lat_{q}"] = summary["group_latency"][q]
    row["stale_mean"], row["stale_max"] = summary["staleness"]["mean"], summary["staleness"]["max"]
    return row


def run_policies(args: argparse.Namespace, base: SimConfig, workload) -> list[dict]:
    runs: list[tuple[str, SimConfig]] = []
    for name in [x for x in args.policy.split(",") if x]:
        runs.append((name, policy_config(base, name)))
    if args.sweep:
        if "async" not in [n for n, _ in runs]:
            runs.insert(0, ("async", policy_config(base, "async")))
        for ratio in args.offload_ratios:
            for cap in args.cap_factors:
                pc = replace(base, pdsr=replace(base.pdsr, offload_ratio=ratio, cap_factor=cap))
                runs.append(("pdsr", policy_config(pc, "pdsr")))
    rows = []
    for i, (name, cfg) in enumerate(runs):
        res = simulate(cfg, workload)
        rows.append(table_row(name, cfg, res.summary))
        if args.trace_dir:
            write_simulated_run(Path(args.trace_dir) / f"{i:02d}-{name}", cfg, res)
    async_wall = next((r["wall_time"] for r in rows if r["policy"] == "async"), None)
    for r in rows:
        r["saving_vs_async"] = 1 - r["wall_time"] / async_wall if async_wall else None
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    out: dict = {}
    calib = Calibration.load(args.calibration) if args.calibration else None
    if args.calibrate:
        calib = calibrate(args.calibrate)
        out["calibration"] = {k: v for k, v in vars(calib).items()}
        lo, hi = calib.details["batch_p5_p95"]
        print(f"calibration from {args.calibrate}: step latency = {calib.c0:.6g} + {calib.c1:.6g} * batch "
              f"s/token (rel. err rms {calib.details['rel_err_rms']:.3f}, "
              f"{calib.details['responses_fitted']} responses, batch p5..p95 {lo:.0f}..{hi:.0f}); "
              f"train = {calib.train_a:.4g} + {calib.train_b:.4g} * tokens s; sync = {calib.sync_time:.4g} s")
        if args.save_calibration:
            calib.save(args.save_calibration)
    if args.predict:
        if calib is None:
            raise SystemExit("--predict needs --calibrate RUN_DIR or --calibration FILE")
        overrides = _explicit(args, _SIM_FIELDS - {"num_steps"})
        out["predictions"] = []
        for run2 in args.predict:
            pr = predict(calib, run2, overrides)
            out["predictions"].append(pr)
            print(f"predict {run2}: measured {pr['measured_wall']:.2f} s, predicted "
                  f"{pr['predicted_wall']:.2f} s over {pr['steps']} steps, error {pr['error']:+.1%}")
    elif not args.calibrate or args.log or args.sweep or args.stats:
        base = base_config(args, calib).validate()
        workload = workload_for(args, base)
        if args.stats:
            out["stats"] = length_stats(workload, base.pdsr.batch_size or base.required_samples,
                                        base.pdsr.offload_ratio, base.pdsr.cap_factor,
                                        max_response_length=base.max_response_length,
                                        cap_mode=base.pdsr.cap_mode)
            print(json.dumps(out["stats"], indent=2))
        rows = run_policies(args, base, workload)
        out["runs"] = rows
        print(format_table(rows, markdown=args.markdown))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return out


if __name__ == "__main__":
    main()
