"""No run succeeds at nothing (issue 42, item 4): what a finished run did against what it planned, in one line."""

from __future__ import annotations

import pytest

from verl_async.errors import PipelineError
from verl_async.outcome import RunCounts, shortfall, zero_steps_error


def test_every_group_filtered_is_a_failure_naming_the_filter_and_the_fix():
    c = RunCounts(trained=0, step=0, planned=2, per_step=8, queued=0, filtered=16)
    line = zero_steps_error(c)
    assert line == ("trained 0 steps: algorithm.filter_groups dropped every group generated (16): each group's "
                    "responses all scored the same, so no batch of 8 groups formed; set algorithm.filter_groups."
                    "enable=false, or train on prompts where a group's responses differ (a model that solves some but "
                    "not all; a larger actor_rollout_ref.rollout.n or temperature)")
    assert shortfall(c) is None  # the failure says it all


def test_the_largest_cause_gives_the_fix_and_every_cause_is_named():
    c = RunCounts(trained=0, step=0, planned=4, per_step=4, queued=3, filtered=2, failed_prompts=9, dropped_stale=3)
    line = zero_steps_error(c)
    assert line.startswith("trained 0 steps: 9 prompt(s) failed on every retry (rollout/failed_prompts.jsonl); "
                           "algorithm.max_staleness dropped 3 group(s); algorithm.filter_groups dropped 2 group(s) ")
    assert line.endswith("; fix the engine errors logged above (rollout/failed_prompts.jsonl has the last one per "
                         "prompt)")


def test_too_little_data_for_one_step():
    line = zero_steps_error(RunCounts(trained=0, step=0, planned=1, per_step=8, queued=5))
    assert line.startswith("trained 0 steps: only 5 group(s) reached the trainer, and one step takes 8; ")
    assert "rollout.total_rollout_steps" in line and "ppo_mini_batch_size" in line
    assert "no group reached" in zero_steps_error(RunCounts(trained=0, step=0, planned=1, per_step=8, queued=0))


def test_train_only_without_files_names_the_pattern():
    line = zero_steps_error(RunCounts(trained=0, step=0, planned=None, per_step=2, load_pattern="/d/r_{rollout_id}.pt"))
    assert line.startswith("trained 0 steps: debug.load_rollout_data=/d/r_{rollout_id}.pt has no file for step 0")


@pytest.mark.parametrize("counts", [
    RunCounts(trained=3, step=3, planned=3, per_step=2),  # as planned
    RunCounts(trained=0, step=8, planned=8, per_step=2, queued=0),  # resumed at its end: nothing left, not a failure
])
def test_a_run_that_trained_what_it_planned_is_neither(counts):
    assert zero_steps_error(counts) is None and shortfall(counts) is None


def test_fewer_steps_than_planned_say_why_in_the_last_line():
    c = RunCounts(trained=3, step=3, planned=8, per_step=8, queued=29, filtered=35)
    assert shortfall(c) == ("stopped at step 3 of 8 planned: algorithm.filter_groups dropped 35 group(s) whose "
                            "responses all scored the same; 5 group(s) were left over, fewer than the 8 one step "
                            "takes; set algorithm.filter_groups.enable=false, or train on prompts where a group's "
                            "responses differ (a model that solves some but not all; a larger "
                            "actor_rollout_ref.rollout.n or temperature)")


def test_the_pipelines_last_line_and_its_failure(tmp_path, capsys):
    from verl_async.pipeline import _summarise

    results = {"trainer": {"steps": 3, "start_step": 0, "version": 3},
               "rollouter": {"finished_groups": 29, "filtered_groups": 35}}
    _summarise(str(tmp_path), results, {}, {}, 9.0, planned=8, per_step=8)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("done in 9.0s: 3 steps trained, version 3, outputs in ") and "; stopped at step 3 of 8" in last
    with pytest.raises(PipelineError, match=r"^trained 0 steps: algorithm\.filter_groups dropped every group"):
        _summarise(str(tmp_path), {"trainer": {"steps": 0, "start_step": 0, "version": 0},
                                   "rollouter": {"finished_groups": 0, "filtered_groups": 16}}, {}, {}, 9.0,
                   planned=2, per_step=8)
