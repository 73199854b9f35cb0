"""What a run's start-up is made of on this machine, each piece alone in a fresh process (issue 37 item 6).

    python scripts/startup_probe.py --model DIR [--out probe.json] [--device cuda] [--skip ray,concurrent]

The run's breakdown (verl_async/utils/startup.py) says which phase of which process is long; this says why, on
the host at hand: the interpreter's bytecode cache, each actor module's import, `import transformers` and its
model stack (with the `-X importtime` modules that cost most), the tokenizer's load (its profile), the model's
load as a replica does it (bf16 on the host, then to the device; or straight onto the device) and as a rank does
it (fp32 on the host), a local `ray.init` with Ray's prestarted workers and without (and two levels of actors
after it, as a run starts them), and the replica's whole chain in 6 processes at once against one alone.
Prints a markdown summary; `--out` keeps every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ENV = r"""
import json, os, sys, glob
def pyc_share(pkg):
    try:
        mod = __import__(pkg)
    except Exception:
        return None
    root = os.path.dirname(mod.__file__)
    py = glob.glob(os.path.join(root, '**', '*.py'), recursive=True)
    tag = sys.implementation.cache_tag
    have = sum(os.path.exists(os.path.join(os.path.dirname(p), '__pycache__',
                                           os.path.basename(p)[:-3] + '.' + tag + '.pyc')) for p in py)
    return [have, len(py)]
print(json.dumps({"python": sys.version.split()[0], "dont_write_bytecode": sys.dont_write_bytecode,
                  "pycache_prefix": sys.pycache_prefix, "cpus": os.cpu_count(),
                  "sched_cpus": len(os.sched_getaffinity(0)), "sys_path": len(sys.path),
                  "pyc_have_of": {p: pyc_share(p) for p in ("ray", "verl_async", "transformers", "torch",
                                                            "hydra", "omegaconf", "tensordict")}}))
"""

STEPS = r"""
import json, sys, time
T = {}
def step(name, fn):
    t = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # one step that fails (an option this transformers lacks) leaves the others
        T[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        return None
    T[name] = round(time.perf_counter() - t, 3)
    return out
model, device, what = sys.argv[1], sys.argv[2], sys.argv[3]
if what == "modules":
    step("import_torch", lambda: __import__("torch"))
    for m in ("verl_async.queue", "verl_async.rollout.replica", "verl_async.trainer.fsdp_worker",
              "verl_async.rollout.service", "verl_async.pipeline"):
        step(m, lambda m=m: __import__(m))
elif what == "transformers":
    step("import_torch", lambda: __import__("torch"))
    step("import_ray", lambda: __import__("ray"))
    step("import_transformers", lambda: __import__("transformers"))
    step("from_transformers_AutoTokenizer", lambda: __import__("transformers", fromlist=["AutoTokenizer"]).AutoTokenizer)
    from verl_async.models.loading import load_tokenizer
    step("load_tokenizer", lambda: load_tokenizer(model))
    step("import_modeling_utils", lambda: __import__("transformers.modeling_utils"))
    step("AttentionInterface", lambda: __import__("transformers", fromlist=["AttentionInterface"]).AttentionInterface)
elif what == "load":
    import torch
    from verl_async.models.loading import load_causal_lm
    from verl_async.utils.preimport import import_model_stack
    step("model_stack_import", lambda: import_model_stack(model).wait())
    if device == "cuda":
        step("cuda_context", lambda: torch.zeros(1, device="cuda"))
    m = step("replica_bf16_on_host", lambda: load_causal_lm(model, dtype=torch.bfloat16, attn_implementation="sdpa"))
    if device == "cuda" and m is not None:
        step("replica_to_device", lambda: (m.to("cuda"), torch.cuda.synchronize()))
        del m; torch.cuda.empty_cache()
        from transformers import AutoModelForCausalLM
        step("bf16_straight_to_device", lambda: (AutoModelForCausalLM.from_pretrained(
            model, dtype=torch.bfloat16, attn_implementation="sdpa", device_map="cuda"), torch.cuda.synchronize()))
    step("rank_fp32_on_host", lambda: load_causal_lm(model, dtype=torch.float32, attn_implementation="sdpa"))
elif what == "replica_chain":  # what an engine replica's process imports and loads, start to model on the device
    t0 = time.perf_counter()
    import verl_async.rollout.replica  # noqa: F401
    import torch
    from verl_async.models.loading import load_causal_lm
    m = load_causal_lm(model, dtype=torch.bfloat16, attn_implementation="sdpa", device=device)
    T["replica_chain"] = round(time.perf_counter() - t0, 3)
print("PROBE " + json.dumps(T))
"""

PROFILE = r"""
import cProfile, io, pstats, sys
import verl_async.rollout.service  # the Rollouter's module, loaded before its tokenizer
from verl_async.models.loading import load_tokenizer
prof = cProfile.Profile(); prof.enable(); load_tokenizer(sys.argv[1]); prof.disable()
out = io.StringIO(); pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
print(out.getvalue())
"""

RAY = r"""
import json, os, sys, time
import ray
mode = sys.argv[1]
t0 = time.perf_counter()
ray.init(address="local", include_dashboard=False, logging_level="WARNING",
         _system_config=None if mode == "prestart" else {"prestart_worker_first_driver": False})
t1 = time.perf_counter()
def idle_workers():  # this driver's raylet's idle workers (their title is ray::IDLE)
    try:
        import psutil
        return sum(1 for p in psutil.Process().children(recursive=True) if "ray::IDLE" in " ".join(p.cmdline()))
    except Exception:  # no psutil here
        return None
idle = idle_workers()

@ray.remote(num_cpus=0)
class Leaf:
    def ready(self):
        return time.time()

@ray.remote(num_cpus=0)
class Parent:
    def __init__(self):
        self.kids = [Leaf.remote() for _ in range(2)]
    def ready(self):
        return max(ray.get([k.ready.remote() for k in self.kids]))

t2 = time.time()
parents = [Parent.remote() for _ in range(2)]
done = max(ray.get([p.ready.remote() for p in parents]))
print("PROBE " + json.dumps({"ray_init": round(t1 - t0, 3), "idle_workers_after_init": idle,
                             "two_levels_of_actors": round(done - t2, 3), "cpus": ray.cluster_resources().get("CPU")}))
ray.shutdown()
"""


def python(code: str, *args: str, env_extra: dict | None = None, flags: tuple[str, ...] = (), timeout: float = 600):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *flags, "-c", code, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def probe(code: str, *args: str, **kw: Any) -> dict:
    out = python(code, *args, **kw)
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBE ")]
    if out.returncode != 0 or not lines:
        return {"error": (out.stderr or out.stdout)[-1500:]}
    return json.loads(lines[-1][len("PROBE "):])


def importtime(statement: str, top: int = 25) -> list[tuple[float, str]]:
    """The modules with the largest cumulative import time (seconds) under `statement`, after torch and ray."""
    out = python(f"import torch, ray\n{statement}", flags=("-X", "importtime"))
    rows = []
    for line in out.stderr.splitlines():
        parts = line.split("|")
        if line.startswith("import time:") and len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    rows.sort(key=lambda r: -r[0])
    return [(round(s, 3), name) for s, name in rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model folder (save_pretrained layout)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--skip", default="", help="comma-separated: ray, concurrent, importtime, profile")
    parser.add_argument("--concurrent", type=int, default=6)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    model = os.path.abspath(args.model)
    result: dict[str, Any] = {"env": json.loads(python(ENV).stdout.strip().splitlines()[-1])}
    result["modules"] = probe(STEPS, model, args.device, "modules")
    result["transformers"] = probe(STEPS, model, args.device, "transformers")
    result["load"] = probe(STEPS, model, args.device, "load")
    if "importtime" not in skip:
        result["importtime_tokenizer"] = importtime(
            f"from verl_async.models.loading import load_tokenizer; load_tokenizer({model!r})")
        result["importtime_model_stack"] = importtime("import transformers.modeling_utils")
    if "profile" not in skip:
        result["tokenizer_profile"] = python(PROFILE, model).stdout[-6000:]
    if "ray" not in skip:
        result["ray"] = {mode: probe(RAY, mode) for mode in ("prestart", "none")}
    if "concurrent" not in skip:
        alone = probe(STEPS, model, args.device, "replica_chain")
        t = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", STEPS, model, args.device, "replica_chain"], cwd=REPO,
                                  env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(args.concurrent)]
        outs = [p.communicate(timeout=900)[0] for p in procs]
        each = [json.loads(line[len("PROBE "):]).get("replica_chain") for o in outs for line in o.splitlines()
                if line.startswith("PROBE ")]
        result["concurrent"] = {"alone": alone.get("replica_chain"), "n": args.concurrent, "each": each,
                                "wall": round(time.perf_counter() - t, 3)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(summary(result))


def summary(r: dict[str, Any]) -> str:
    lines = ["## start-up probe", "", f"environment: `{json.dumps(r['env'])}`", "", "| step | seconds |", "|---|---|"]
    for part in ("modules", "transformers", "load"):
        for k, v in r.get(part, {}).items():
            lines.append(f"| {part}: {k} | {v if not isinstance(v, str) else v[-200:]} |")
    for mode, v in (r.get("ray") or {}).items():
        lines.append(f"| ray ({mode}) | {json.dumps(v)} |")
    if "concurrent" in r:
        c = r["concurrent"]
        lines.append(f"| replica chain alone / {c['n']} at once (each) | {c['alone']} / {c['each']} |")
    for key in ("importtime_tokenizer", "importtime_model_stack"):
        if key in r:
            lines += ["", f"{key} (cumulative s, largest first):", "",
                      *[f"    {s:7.3f} {name}" for s, name in r[key]]]
    if r.get("tokenizer_profile"):
        lines += ["", "load_tokenizer profile (after the Rollouter's module):", "", "```", r["tokenizer_profile"].strip(),
                  "```"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
