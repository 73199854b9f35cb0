"""What each actor's module loads when a Ray worker imports it: start-up time of every run (issue 39).

A Ray actor's worker process imports the module that defines its class before the actor starts.
torch is ~2 s there, tensordict another ~2 s (it loads torch._dynamo), pandas ~1 s (pyarrow's
dataset layer). The queue needs none of them; the Rollouter, the driver and the trainer's driver
need no tensordict before the first batch (their model and tokenizer load torch when they must).
One fresh interpreter walks the modules from the lightest up and reports what each added.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from verl_async.data import write_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch", "tensordict", "torch._dynamo", "transformers", "pandas", "pyarrow.dataset")

PROBE = r"""
import json, sys
import ray  # every Ray worker has it already
heavy = {heavy}
seen = {{}}
for module in {modules}:
    __import__(module)
    seen[module] = sorted(m for m in heavy if m in sys.modules)
from verl_async.data.dataset import read_table
read_table({parquet!r})
seen["read_table"] = sorted(m for m in heavy if m in sys.modules)
print(json.dumps(seen))
"""


def loaded_after_each(modules: list[str], parquet: str) -> dict[str, list[str]]:
    code = PROBE.format(heavy=HEAVY, modules=modules, parquet=parquet)
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=REPO))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_actor_modules_load_only_what_they_use(tmp_path):
    parquet = str(tmp_path / "rows.parquet")
    write_rows([{"prompt": [{"role": "user", "content": "hi"}]}], parquet)  # here: writing loads pandas
    seen = loaded_after_each([
        "verl_async.queue",  # MessageQueue's worker
        "verl_async.rollout.service",  # RolloutService's worker
        "verl_async.rollout.replica",  # EngineReplica's worker (its model loads transformers later)
        "verl_async.trainer.trainer",  # the trainer's driver
        "verl_async.trainer.fsdp_worker",  # FSDPWorker's worker
        "verl_async.trainer.megatron.worker_group",
        "verl_async.pipeline",  # the entry point's driver
    ], parquet)
    assert seen["verl_async.queue"] == [], seen
    assert "tensordict" not in seen["verl_async.pipeline"], seen  # the whole driver, every actor class included
    assert "torch._dynamo" not in seen["verl_async.pipeline"], seen
    assert "transformers" not in seen["verl_async.pipeline"], seen
    assert "pandas" not in seen["read_table"] and "pyarrow.dataset" not in seen["read_table"], seen
