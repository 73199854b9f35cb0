"""Model-written code in an OS sandbox: the built-in runner, SandboxFusion's API (server and client).

    from verl_async.sandbox import SandboxLimits, run_code, isolation_problem
    result = await run_code("print(6 * 7)", SandboxLimits(wall_time_s=5))

* `limits.py`: what a run may use (`SandboxLimits`) and what came back (`SandboxResult`);
* `jail.py`: nsjail's namespaces, mounts, seccomp, rlimits and cgroups, and the one-line
  refusal where this machine cannot give them (`IsolationUnavailable`);
* `inside.py`: the run's first process inside the jail (runs the code, reports its status);
* `runner.py`: `run_code` (deadlines, output caps, kill and clean-up);
* `fusion.py`: SandboxFusion's `run_code` request and response; `server.py`
  (`python -m verl_async.sandbox.server`) serves it from this sandbox; `client.py` calls one.

docs/sandbox.md says what is isolated and what is not.
"""

from verl_async.sandbox.jail import IsolationUnavailable
from verl_async.sandbox.limits import ISOLATIONS, SandboxLimits, SandboxResult
from verl_async.sandbox.runner import isolation_problem, run_code

__all__ = ["ISOLATIONS", "IsolationUnavailable", "SandboxLimits", "SandboxResult", "isolation_problem", "run_code"]
