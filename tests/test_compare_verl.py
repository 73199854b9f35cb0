"""scripts/compare_verl.py on small runs written here: verl's console/file-logger format and ours (issue 27)."""

from __future__ import annotations

import json
import os
import runpy
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("tensorboard")


@pytest.fixture(scope="module")
def cv():
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        return runpy.run_path(os.path.join(ROOT, "scripts", "compare_verl.py"), run_name="compare_verl")
    finally:
        sys.path.remove(os.path.join(ROOT, "scripts"))


ACC = "val-core/verl_async/arithmetic/acc/mean@1"


def write(folder, **texts):
    for name, text in texts.items():
        with open(os.path.join(folder, name.replace("_dot_", ".")), "w") as f:
            f.write(text)


def verl_line(ts, step, **metrics):
    body = " - ".join(f"{k}:{v}" for k, v in metrics.items())
    return f"{ts:.3f} (TaskRunner pid=4242) step:{step} - {body}\n"


def write_verl_run(folder):
    """Launch at 1000; val before training at 1100 (0.1); 4 steps of 10 s (gen 6, update_weights 1),
    validating after steps 2 and 4 (3 s each, printed after it)."""
    os.makedirs(folder)
    step = {"timing_s/gen": 6.0, "timing_s/update_weights": 1.0, "timing_s/step": 10.0,
            "perf/total_num_tokens": 5000, "response_length/mean": 20.0}
    lines = ["1000.500 (TaskRunner pid=4242) Creating file logger at /tmp/x\n",
             verl_line(1100, 0, **{ACC: "np.float64(0.1)"})]
    files = [{"step": 0, "data": {ACC: 0.1}}]
    t = 1100.0
    for n, acc in ((1, None), (2, 0.3125), (3, None), (4, 0.5)):
        t += 10.0
        data = dict(step)
        if acc is not None:
            t += 3.0
            data.update({"timing_s/testing": 3.0, ACC: acc})  # the file logger has the exact value ...
        shown = {k: f"np.float64({v})" for k, v in data.items()}
        if acc is not None:
            shown[ACC] = f"np.float64({acc:.2f})"  # ... where the console may show another
        lines.append(verl_line(t, n, **shown))
        files.append({"step": n, "data": data})
    write(folder, console_dot_log="".join(lines), metrics_dot_jsonl="".join(json.dumps(r) + "\n" for r in files),
          launch_epoch="1000.000\n", gpu_mem_dot_csv="512\n30123\n29000\n")


def span(lane, kind, start, end, version=0, **info):
    return {"lane": lane, "kind": kind, "start": start, "end": end, "version": version, "info": info}


def write_ours_run(folder):
    """Launch at 2000, run clock zero at 2010; validation before training (0.2), 3 steps, validation of version 2
    beside training (0.5, logged late, at step 2)."""
    from torch.utils.tensorboard import SummaryWriter

    os.makedirs(folder)
    zero = 2010.0
    spans = [span("sync", "sync", 40, 41), span("rollout/validation", "validate", 41, 45),
             span("rollout/replica0", "generate", 45, 70, tokens=300),
             span("trainer/driver", "wait", 45, 50)]
    writer = SummaryWriter(os.path.join(folder, "tensorboard"))
    writer.add_scalar("val/mean@1/acc", 0.2, 0, walltime=zero + 45)
    for v, (train_start, sync_end) in enumerate(((50, 54), (54, 58), (58, 62)), start=1):
        spans += [span("trainer/driver", "train", train_start, sync_end - 1, v - 1, tokens=4000),
                  span("sync", "sync", sync_end - 1, sync_end, v)]
        for tag, value in (("fully_async/param_version", v), ("timing_s/step", 3.0), ("response_length/mean", 25.0)):
            writer.add_scalar(tag, value, v, walltime=zero + sync_end + 0.01)
    spans.append(span("rollout/validation", "validate", 58, 61, 2))
    writer.add_scalar("val/mean@1/acc", 0.5, 2, walltime=zero + 61.5)  # late: logged during version 3
    writer.close()
    write(folder, timeline_dot_jsonl="".join(json.dumps(s) + "\n" for s in spans), launch_epoch="2000.0\n",
          gpu_mem_dot_csv="100\n20480\n")


def test_values_as_verl_prints_them(cv):
    parse = cv["parse_value"]
    assert parse("0.25") == 0.25 and parse("np.float64(0.25)") == 0.25 and parse("np.int64(7)") == 7.0
    assert parse("1e-05") == 1e-5 and parse("True") == 1.0 and parse("nan") != parse("nan")
    assert parse("'text'") is None and parse("[1, 2]") is None


def test_console_lines_with_and_without_time_prefix(cv):
    text = ("1.500 (TaskRunner pid=1) step:3 - actor/pg_loss:np.float64(-0.5) - a/b@1:2 - note:x\n"
            "noise line\n"
            "step:4 - timing_s/step:1.25\n")
    steps = cv["parse_verl_console"](text)
    assert [(s.ts, s.step) for s in steps] == [(1.5, 3), (None, 4)]
    assert steps[0].metrics == {"actor/pg_loss": -0.5, "a/b@1": 2.0} and steps[1].metrics == {"timing_s/step": 1.25}


def test_verl_run_times_values_and_split(cv, tmp_path):
    write_verl_run(tmp_path / "verl-1")
    run = cv["verl_run"]("verl-1", str(tmp_path / "verl-1"), 128)
    # step 2 printed at 1123 after 3 s of validation: its weights existed at 1120; values from the file logger
    assert run.acc == [(100.0, 0, 0.1), (120.0, 2, 0.3125), (1146.0 - 3.0 - 1000.0, 4, 0.5)]
    assert run.steps == 4 and run.window == pytest.approx((100.0, 143.0))
    assert run.trained_tokens == 20000 and run.generated_tokens == 4 * 20 * 128
    assert run.split == pytest.approx({"gen": 6.0, "train": 3.0, "sync": 1.0, "val": 1.5, "wait": 0.0})
    assert run.peak_mib == 30123


def test_ours_run_attributes_a_late_validation_to_its_version(cv, tmp_path):
    write_ours_run(tmp_path / "ours-1")
    run = cv["ours_run"]("ours-1", str(tmp_path / "ours-1"), 128)
    acc = [(round(t, 2), v, a) for t, v, a in run.acc]
    assert acc == [(55.0, 0, pytest.approx(0.2)), (68.01, 2, pytest.approx(0.5))]  # version 2's weights, not 71.5
    assert run.steps == 3 and run.window == pytest.approx((55.0, 72.01), abs=0.02)
    assert run.trained_tokens == 12000 and run.generated_tokens == 3 * 25 * 128
    assert run.split["train"] == pytest.approx(3.0) and run.split["val"] == pytest.approx(4 / 3)
    assert run.peak_mib == 20480


def test_table_and_plot_from_archives(cv, tmp_path):
    import tarfile

    write_verl_run(tmp_path / "verl-1")
    write_ours_run(tmp_path / "ours-1")
    with tarfile.open(tmp_path / "verl-1.tar.gz", "w:gz") as tar:
        for name in os.listdir(tmp_path / "verl-1"):
            tar.add(tmp_path / "verl-1" / name, arcname=name)
    out = tmp_path / "out"
    assert cv["main"](["--verl", str(tmp_path / "verl-1.tar.gz"), "--ours", str(tmp_path / "ours-1"),
                       "--out-dir", str(out), "--prefix", "t"]) == 0
    lines = (out / "t_table.md").read_text().splitlines()
    assert lines[0].startswith("| run | system | steps | first step (s) | to acc>=0.3 (s) | to acc>=0.45 (s) | final acc")
    assert lines[2] == "| verl-1 | verl | 4 | 100.0 | 120.0 | 143.0 | 0.500 | 0.500 | 465 | 238 | 10.75 | 6.00 | 3.00 | 1.00 | 1.50 | 0.00 | 30123 |"
    assert lines[3].startswith("| ours-1 | ours | 3 | 55.0 | 68.0 | 68.0 | 0.500 | 0.500 |")
    assert (out / "t_accuracy.png").stat().st_size > 1000


def test_time_to_a_threshold(cv):
    points = [(10.0, 0, 0.1), (30.0, 2, 0.45), (20.0, 1, 0.3)]
    assert cv["time_to"](points, 0.3) == 20.0 and cv["time_to"](points, 0.45) == 30.0
    assert cv["time_to"](points, 0.6) is None
