"""scripts/compare_verl2.py on small runs written here: verl's fully async recipe, its V1 separate_async and
main_ppo in the formats verl 0.9.1 prints and logs, and ours (issue 37 item 3). Values hand-computed."""

from __future__ import annotations

import json
import os
import sys
import tarfile

import pytest

from tests.test_compare_verl import verl_line, write, write_ours_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("tensorboard")
sys.path.insert(0, os.path.join(ROOT, "scripts"))  # compare_verl2 adds it too, for compare_verl and plot_runs
import compare_verl2 as cv2  # noqa: E402


def info(**kw):
    return json.dumps({"n": 8, "prompts_per_update": 16, "gpus": 2, **kw}) + "\n"


def jsonl(records):
    return "".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in records)


def write_verl_async_run(folder):
    """Launch at 1000; a sync before training (1011, excluded); the trainer starts at 1100; 8 steps at 1110..1180,
    syncs after steps 4 (1140.5, 0.2 s) and 8 (1180.4, 0.3 s), one more at the end of fit (1190, after the window).
    The file logger: version 0's rollouter record (start-up, excluded), versions 1-2 each a rollouter record and the
    aggregate of the steps before its sync (1-3, then 4-7: verl logs a step's metrics in the next cycle; step 8 never)."""
    os.makedirs(folder)
    trainer = "\x1b[36m(FullyAsyncTrainer pid=2)\x1b[0m [FullyAsyncTrainer]"
    lines = ["1010.000 (FullyAsyncTaskRunner pid=1) [ASYNC MAIN] Param sync before fit..\n",
             f"1011.000 {trainer} _fit_update_weights, timing_s/param_sync: 0.5000 seconds self.current_param_version: 0\n",
             "1100.000 (FullyAsyncTaskRunner pid=1) [ASYNC MAIN] Starting Rollouter and Trainer...\n"]
    for n in range(1, 9):
        lines.append(f"{1100 + 10 * n:.3f} {trainer} global_steps: {n} local_trigger_step: {(n - 1) % 4 + 1} "
                     f"trigger_parameter_sync_step: 4 12:00:00.000\n")
        if n in (4, 8):
            t, s = (1140.5, 0.2) if n == 4 else (1180.4, 0.3)
            lines.append(f"{t:.3f} {trainer} _fit_update_weights, timing_s/param_sync: {s:.4f} seconds "
                         f"self.current_param_version: {n // 4}\n")
    lines.append(f"1190.000 {trainer} _fit_update_weights, timing_s/param_sync: 0.2500 seconds self.current_param_version: 2\n")
    lines.append("1190.100 (TaskRunner pid=1) step:2 - fully_async/rollouter/idle_ratio:np.float64(0.2)\n")  # noise
    records = [(0, {"fully_async/rollouter/version_time": 50.0, "fully_async/rollouter/idle_ratio": 0.9}),
               (1, {"fully_async/rollouter/version_time": 40.5, "fully_async/rollouter/idle_ratio": 0.1}),
               (1, {"timing_s/step": 30.0, "timing_s/gen": 6.0, "perf/total_num_tokens": 3000,
                    "training/global_step": 3}),
               (2, {"fully_async/rollouter/version_time": 40.0, "fully_async/rollouter/idle_ratio": 0.2}),
               (2, {"timing_s/step": 40.0, "timing_s/gen": 4.0, "perf/total_num_tokens": 4000,
                    "training/global_step": 7})]
    write(folder, console_dot_log="".join(lines), metrics_dot_jsonl=jsonl(records), launch_epoch="1000.000\n",
          gpu_mem_dot_csv="100\n200\n60000\n30000\n50000\n41000\n",
          bench_info_dot_json=info(system="verl", recipe="async", layout="split 1+1", updates_per_step=1))


def write_verl_steps_run(folder, recipe, steps):
    """main_ppo-style step lines: (end time, timing_s/step, timing_s/gen, timing_s/update_weights, tokens) per step."""
    os.makedirs(folder)
    lines, records = [], []
    for n, (t, step, gen, sync, tokens) in enumerate(steps, start=1):
        data = {"timing_s/step": step, "timing_s/gen": gen, "timing_s/update_weights": sync,
                "perf/total_num_tokens": tokens}
        lines.append(verl_line(t, n, **{k: f"np.float64({v})" for k, v in data.items()}))
        records.append((n, data))
    layout = "split 1+1" if recipe == "v1" else "colocated 2"
    write(folder, console_dot_log="".join(lines), metrics_dot_jsonl=jsonl(records), launch_epoch="1000.000\n",
          gpu_mem_dot_csv="70000\n71000\n",
          bench_info_dot_json=info(system="verl", recipe=recipe, layout=layout, updates_per_step=4 if recipe == "v1" else 1))


def test_verl_fully_async_recipe(tmp_path):
    write_verl_async_run(tmp_path / "verl2async-1")
    row = cv2.load(str(tmp_path / "verl2async-1"), str(tmp_path))
    assert (row.system, row.recipe, row.layout, row.updates) == ("verl", "async", "split 1+1", 8)
    assert row.startup_s == pytest.approx(100.0) and row.window_s == pytest.approx(80.4)  # to the sync after step 8
    assert row.sync_s == pytest.approx(0.25)  # 0.2 and 0.3: not the one before training, not the one after the window
    assert row.trained_tokens == pytest.approx(8000.0)  # 7000 over the 7 logged steps, x 8 / 7
    assert row.notes == ["tokens of 1 unlogged step(s) estimated from the 7 logged"]
    assert row.trainer_idle == pytest.approx(10 / 70)
    assert row.rollout_idle == pytest.approx((40.5 * 0.1 + 40.0 * 0.2) / 80.5)
    assert row.peak_mib == [60000.0, 41000.0] and not row.idle_from_timers


def test_verl_v1_separate_async_counts_four_updates_per_step(tmp_path):
    write_verl_steps_run(tmp_path / "verl2v1-1", "v1", [(1140.0, 40.0, 10.0, 0.5, 40000), (1180.0, 40.0, 6.0, 0.5, 40000)])
    row = cv2.load(str(tmp_path / "verl2v1-1"), str(tmp_path))
    assert (row.recipe, row.updates, row.startup_s, row.window_s) == ("v1", 8, 100.0, 80.0)
    assert row.trained_tokens == 80000 and row.sync_s == pytest.approx(0.5)
    assert row.trainer_idle == pytest.approx(1 - 31.5 / 40) and row.rollout_idle is None and row.idle_from_timers


def test_verl_colocated_sync_idles_from_its_timers(tmp_path):
    write_verl_steps_run(tmp_path / "verl2sync-1", "sync", [(1120.0, 20.0, 12.0, 1.0, 5000), (1140.0, 20.0, 12.0, 1.0, 5000)])
    row = cv2.load(str(tmp_path / "verl2sync-1"), str(tmp_path))
    assert (row.updates, row.startup_s, row.window_s, row.sync_s) == (2, 100.0, 40.0, 1.0)
    assert row.trainer_idle == pytest.approx(0.65) and row.rollout_idle == pytest.approx(0.4)
    assert row.peak_mib == [70000.0, 71000.0]


def test_table_from_archives(tmp_path):
    write_verl_async_run(tmp_path / "verl2async-1")
    write_ours_run(tmp_path / "ours2split-1")
    write(str(tmp_path / "ours2split-1"), bench_info_dot_json=info(system="ours", recipe="s0.5_p1_t4", layout="split 1+1"))
    with tarfile.open(tmp_path / "verl2async-1.tar.gz", "w:gz") as tar:
        for name in os.listdir(tmp_path / "verl2async-1"):
            tar.add(tmp_path / "verl2async-1" / name, arcname=name)
    out = tmp_path / "out" / "t.md"
    assert cv2.main([str(tmp_path / "verl2async-1.tar.gz"), str(tmp_path / "ours2split-1"), "--out", str(out)]) == 0
    lines = out.read_text().splitlines()
    assert lines[0] == ("| run | system | recipe | layout | updates | start-up s | trained tok/s | s/update | sync s | "
                        "trainer idle | rollout idle | peak MiB per GPU |")
    assert lines[2] == "| verl2async-1 | verl | async | split 1+1 | 8 | 100.0 | 100 | 10.05 | 0.250 | 0.14 | 0.15 | 60000 / 41000 |"
    # ours (tests/test_compare_verl.py's run): window 55-72.01 s (TensorBoard wall times: +-0.01), 12000 tokens,
    # no param_sync scalar; trainer busy 9 of the 16 s from the first generated token to the last update (0.44),
    # generating all of them (0.00); nvidia-smi's two lines taken as GPU 0 and GPU 1
    cells = lines[3].split(" | ")
    assert cells[:6] == ["| ours2split-1", "ours", "s0.5_p1_t4", "split 1+1", "3", "55.0"]
    assert cells[6] in ("705", "706") and cells[7:] == ["5.67", "-", "0.44", "0.00", "100 / 20480 |"]
    assert lines[-1] == "- verl2async-1: tokens of 1 unlogged step(s) estimated from the 7 logged"


def test_per_gpu_peaks():
    assert cv2.peaks_per_gpu("1\n2\n30\n4\n5\n60\n", 2) == [30.0, 60.0]
    assert cv2.peaks_per_gpu("7\n9\n", 1) == [9.0] and cv2.peaks_per_gpu("", 2) == []
