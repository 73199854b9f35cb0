"""Pipeline schedule simulator: replays length logs to predict wall time and idle ratios
of the synchronous baseline, fully async and async + P-DSR (scripts/simulate_schedule.py)."""

from verl_async.sim.config import POLICIES, PDSRConfig, SimConfig, max_required_samples, policy_config
from verl_async.sim.pipeline import SimError, Simulation, simulate
from verl_async.sim.result import SimResult
from verl_async.sim.speed import ConstantSpeed, StepLatencySpeed, TableSpeed, parse_speed, speed_from_dict
from verl_async.sim.workload import GroupSpec, groups_from_log, length_stats, synthetic_groups

__all__ = [
    "POLICIES", "PDSRConfig", "SimConfig", "max_required_samples", "policy_config",
    "SimError", "Simulation", "simulate", "SimResult",
    "ConstantSpeed", "StepLatencySpeed", "TableSpeed", "parse_speed", "speed_from_dict",
    "GroupSpec", "groups_from_log", "length_stats", "synthetic_groups",
]
