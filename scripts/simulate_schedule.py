#!/usr/bin/env python
"""Pipeline schedule simulator: what would async / P-DSR save on my length logs?

Examples:
  # synchronous vs async vs async + P-DSR on a synthetic long-tail workload
  python scripts/simulate_schedule.py --synthetic longtail --replicas 4 --steps 20 \
      --speed latency:0.02,0.0002 --kv-budget-tokens 140000 --staleness-threshold 0.5
  # sweep offload_ratio x cap_factor
  python scripts/simulate_schedule.py ... --sweep --offload-ratios 0.1,0.2,0.3 --cap-factors 1.25,1.5,2
  # calibrate on one run, predict another
  python scripts/simulate_schedule.py --calibrate runs/A --predict runs/B
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_async.sim.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
