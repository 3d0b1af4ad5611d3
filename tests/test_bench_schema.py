"""The benchmark JSON holds every figure docs/benchmarks.md quotes (and the README's headline
table, which quotes some of them), each with its min, median and max over rounds.

Benchmarks are not tests: nothing here times anything or runs a benchmark. docs/benchmarks.md's
Benchmarks section names the JSON keys its figures come from in one HTML comment per results
file, which renders as nothing:

    <!-- bench keys: `steady_step_ratio_vs_torch_with_ray`, `median_step_s.elastic`, ... -->
    <!-- scale keys: `recovery_ratio_16_vs_2`, `scaling.16.recovery_s`, ... -->

A dotted key names a nested figure. These tests read the committed
benchmarks/results/bench.json and scale.json; ELASTIC_BENCH_JSON and ELASTIC_SCALE_JSON point
them at other files, such as a smoke run's:

    .venv/bin/python -m benchmarks.bench --quick --out /tmp/bench-smoke.json
    ELASTIC_BENCH_JSON=/tmp/bench-smoke.json .venv/bin/python -m pytest tests/test_bench_schema.py
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import pytest

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_PATH = os.path.join(REPO_ROOT, "docs", "benchmarks.md")  # where the README's figures are told in full
# Each results file: the environment variable that overrides its path, and its committed path.
RESULTS = {
    "bench": ("ELASTIC_BENCH_JSON", os.path.join(REPO_ROOT, "benchmarks", "results", "bench.json")),
    "scale": ("ELASTIC_SCALE_JSON", os.path.join(REPO_ROOT, "benchmarks", "results", "scale.json")),
}
KEYS_LINE = re.compile(r"<!--\s*(\w+) keys:(.*?)-->", re.DOTALL)
SPREAD_FIELDS = ("min", "median", "max")

# The keys the README's Benchmarks section quotes, per results file; its keys lines must name exactly these.
QUOTED_KEYS = {
    "bench": (
        "protocol.recovery.fast.recovery_s",
        "protocol.recovery.slow.recovery_s",
        "protocol.grow_pause.fast.pause_s",
        "protocol.grow_pause.slow.pause_s",
        "protocol.full_size_after_death.spare.seconds",
        "protocol.full_size_after_death.no_spare.seconds",
        "techniques.step_ratio_vs_ddp.bf16",
        "techniques.step_ratio_vs_ddp.fp16",
        "techniques.step_ratio_vs_ddp.compress_fp16",
        "techniques.step_ratio_vs_ddp.compress_bf16",
        "techniques.step_ratio_vs_ddp.powersgd_r4",
        "techniques.step_ratio_vs_ddp.zero1",
        "techniques.step_ratio_vs_ddp.zero2",
        "techniques.step_ratio_vs_ddp.zero3",
        "techniques.zero_state_over_formula.zero1.2",
        "techniques.zero_state_over_formula.zero1.3",
        "techniques.zero_state_over_formula.zero2.2",
        "techniques.zero_state_over_formula.zero2.3",
        "techniques.zero_state_over_formula.zero3.2",
        "techniques.zero_state_over_formula.zero3.3",
        "techniques.step_ratio_vs_ddp.local_sgd_h8",
        "techniques.step_ratio_vs_ddp.diloco_h8",
        "techniques.comm_bytes_per_step_ratio.compress_fp16",
        "techniques.comm_bytes_per_step_ratio.compress_bf16",
        "techniques.comm_bytes_per_step_ratio.powersgd_r4",
        "techniques.comm_bytes_per_step_ratio.diloco_h8",
        "steady_step_ratio_vs_torch_with_ray",
        "steady_step_ratio_vs_torch",
        "steady_step_overhead_us",
        "report_every_step_ratio",
        "elastic_recovery_s",
        "checkpoint_stall_ratio_500mb",
        "checkpoint_write_ratio_500mb",
        "hang_detect_s",
        "goodput_chaos",
        "goodput.per_60s.elastic", "goodput.per_60s.elastic_spare", "goodput.per_60s.ray_train",
        "goodput.per_60s.torchft", "goodput.per_15s.elastic", "goodput.per_15s.elastic_spare",
        "goodput.per_15s.ray_train", "goodput.per_15s.torchft",
        "loader_samples_s_ratio_vs_pyarrow",
        "step_ratio_slow_dataset_prefetch",
        "step_ratio_slow_dataset_no_prefetch",
        "prefetch_hidden_fraction",
        "worker_peak_rss_mb.1x",
        "worker_peak_rss_mb.10x",
        "worker_peak_rss_ratio_10x_vs_1x",
        "worker_rss_before_read_mb",
        "techniques.lm_final_loss_ratio_vs_fp32.bf16",
        "techniques.lm_final_loss_ratio_vs_fp32.fp16",
        "techniques.lm_final_loss_ratio_vs_fp32.compress_bf16",
        "techniques.lm_final_loss_ratio_vs_fp32.powersgd_r4",
        "techniques.lm_final_loss_ratio_vs_fp32.zero1",
        "techniques.lm_final_loss_ratio_vs_fp32.local_sgd_h8",
        "techniques.lm_final_loss_ratio_vs_fp32.diloco_h8",
        "techniques.lm_final_loss_ratio_vs_fp32.zero3",
        "zero_reshard_s",
        "zero_checkpoint_write_read_s",
        "zero_reshard_ratio_vs_checkpoint",
        "zero3_reshard_s",
        "zero3_checkpoint_write_read_s",
        "zero3_reshard_ratio_vs_checkpoint",
        "pipeline_bubble_measured.gpipe.m4",
        "pipeline_bubble_measured.gpipe.m8",
        "pipeline_bubble_measured.1f1b.m4",
        "pipeline_bubble_measured.1f1b.m8",
        "pipeline_bubble_ratio_vs_theory.gpipe.m4",
        "pipeline_bubble_ratio_vs_theory.gpipe.m8",
        "pipeline_bubble_ratio_vs_theory.1f1b.m4",
        "pipeline_bubble_ratio_vs_theory.1f1b.m8",
        "lm_samples_s.dp4",
        "lm_samples_s.dp2_pp2",
        "lm_samples_s_ratio_dp2_pp2_vs_dp4",
        "replica_heal_s",
        "replica_join_s",
        "replica_join_sync_s",
        "partition_recovery_s.50ms",
        "partition_recovery_s.1s",
        "partition_sigkill_recovery_s.50ms",
        "partition_sigkill_recovery_s.1s",
        "partition_detect_s.50ms",
        "partition_detect_s.1s",
        "partition_recovery_s.3s",
        "partition_sigkill_recovery_s.3s",
        "partition_detect_s.3s",
        "partial_partition_recovery_s",
        "partial_partition_detect_s",
        "death_inside_connect_recovery_s",
        "death_inside_connect_fixed_deadline_s",
        "p2p_wait_overhead_us",
        "p2p_wait_ratio",
        "hook_cost_ratio_2_ranks",
        "abortable_hook_cost_ratio_2_ranks",
        "store_stall_60s_longest_gap_steps",
        "network.1gbit.ddp.floor_fraction",
        "network.1gbit.bf16.samples_s_ratio_vs_ddp",
        "network.1gbit.powersgd_r4.samples_s_ratio_vs_ddp",
        "network.1gbit.local_sgd_h8.samples_s_ratio_vs_ddp",
        "network.1gbit.diloco_h8.samples_s_ratio_vs_ddp",
        "network.1gbit.zero1.samples_s_ratio_vs_ddp",
        "network.unshaped.ddp.floor_fraction",
        "network.hierarchical_vs_flat_ratio",
        "network.time_to_target_loss_ratio_vs_ddp",
        "network.1gbit.stale_s2.samples_s_ratio_vs_ddp", "network.1gbit.stale_s2.floor_fraction",
        "network.10gbit.stale_s2.samples_s_ratio_vs_ddp",
        "network.1gbit.ddp_overlap.samples_s_ratio_vs_ddp", "network.1gbit.ddp_overlap.floor_fraction",
        "network.1gbit.bf16_overlap.samples_s_ratio_vs_ddp",
        "network.10gbit.ddp.floor_fraction", "network.10gbit.bf16.samples_s_ratio_vs_ddp",
        "network.10gbit.local_sgd_h32.samples_s_ratio_vs_ddp", "network.1gbit.local_sgd_h32.samples_s_ratio_vs_ddp",
    ),
    "scale": (
        "scaling.2.recovery_s",
        "scaling.4.recovery_s",
        "scaling.8.recovery_s",
        "scaling.16.recovery_s",
        "scaling.2.grow_pause_s",
        "scaling.16.grow_pause_s",
    ),
}


def readme_keys(readme: str) -> dict[str, tuple[str, ...]]:
    """The keys named by the `<!-- <file> keys: `a`, `b` -->` comments of the README's Benchmarks section."""
    section = re.search(r"^## Benchmarks\n(.*?)(?=^## |\Z)", readme, re.MULTILINE | re.DOTALL)
    if section is None:
        raise ValueError("README.md has no '## Benchmarks' section")
    found: dict[str, tuple[str, ...]] = {}
    for name, body in KEYS_LINE.findall(section.group(1)):
        if name not in RESULTS:
            raise ValueError(f"<!-- {name} keys: ... --> names no results file; known: {', '.join(RESULTS)}")
        if name in found:
            raise ValueError(f"the Benchmarks section has two <!-- {name} keys: ... --> comments; keep one")
        keys = tuple(re.findall(r"`([^`]+)`", body))
        stray = re.sub(r"`[^`]*`", "", body).replace(",", "").strip()
        if stray or not keys:
            raise ValueError(f"<!-- {name} keys: ... --> should list backticked keys separated by commas, "
                             f"like <!-- {name} keys: `a`, `b.c` -->; found {body.strip()!r}")
        found[name] = keys
    return found


def spread_problem(report: dict[str, Any], key: str) -> str | None:
    """Why `report` does not give `key` with min, median and max; None if it does.

    Two shapes pass: the key's value is itself a dict with numeric min <= median <= max; or the
    value is a number and `report["spread"][key]` is such a dict whose median equals it.
    """
    value = _at(report, key)
    spread = report.get("spread", {}).get(key) if isinstance(report.get("spread"), dict) else None
    if spread is None and isinstance(value, dict):
        spread = value
    elif spread is not None and value is not _MISSING and not _is_number(value):
        return f"{key} is {value!r}, not the median of its spread"
    if value is _MISSING and spread is None:
        return f"{key} is missing"
    if not isinstance(spread, dict):
        return f"{key} has no min, median and max: no spread[{key!r}], and its value is {value!r}"
    absent = [field for field in SPREAD_FIELDS if not _is_number(spread.get(field))]
    if absent:
        return f"{key}'s spread lacks a number for {', '.join(absent)}: {spread!r}"
    low, median, high = (spread[field] for field in SPREAD_FIELDS)
    if not low <= median <= high:
        return f"{key}'s spread is out of order: min {low} <= median {median} <= max {high} does not hold"
    if value is _MISSING:
        return f"{key} has a spread but no value of its own; it should hold the median {median}"
    if _is_number(value) and not math.isclose(value, median, rel_tol=1e-9):
        return f"{key} is {value}, but its spread's median is {median}"
    return None


_MISSING = object()


def _at(report: dict[str, Any], key: str) -> Any:
    value: Any = report
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _results_path(name: str) -> str:
    variable, committed = RESULTS[name]
    return os.environ.get(variable) or committed


def test_the_readme_names_exactly_the_keys_listed_here():
    with open(README_PATH) as f:
        named = readme_keys(f.read())
    assert named, ("README.md's Benchmarks section names no keys; add one comment per results file, like "
                   "<!-- bench keys: `steady_step_ratio_vs_torch_with_ray`, `median_step_s.elastic` -->")
    differences = {}
    for name in sorted({*QUOTED_KEYS, *named}):
        in_readme, listed = set(named.get(name, ())), set(QUOTED_KEYS.get(name, ()))
        if in_readme != listed:
            differences[name] = {"only in README": sorted(in_readme - listed),
                                 "only in QUOTED_KEYS": sorted(listed - in_readme)}
    assert not differences, f"README.md's keys comments and QUOTED_KEYS disagree; change both together: {differences}"


def test_every_key_the_readme_quotes_has_min_median_and_max():
    with open(README_PATH) as f:
        named = readme_keys(f.read())
    if not named:
        pytest.skip("README.md names no keys yet; test_the_readme_names_exactly_the_keys_listed_here fails for it")
    problems = []
    for name, keys in named.items():
        path = _results_path(name)
        if not os.path.exists(path):
            problems.append(f"the README quotes {len(keys)} keys of {name}, but {path} does not exist")
            continue
        with open(path) as f:
            report = json.load(f)
        problems += [f"{os.path.relpath(path, REPO_ROOT)}: {problem}"
                     for problem in (spread_problem(report, key) for key in keys) if problem]
    assert not problems, "\n".join(problems)


def test_a_figure_with_its_median_at_the_top_and_its_spread_beside_passes():
    report = {"ratio": 1.02, "median_step_s": {"elastic": 0.0135},
              "spread": {"ratio": {"min": 1.0, "median": 1.02, "max": 1.1},
                         "median_step_s.elastic": {"min": 0.013, "median": 0.0135, "max": 0.014}}}
    assert spread_problem(report, "ratio") is None
    assert spread_problem(report, "median_step_s.elastic") is None


def test_a_figure_that_is_itself_a_spread_passes():
    report = {"scaling": {"16": {"recovery_s": {"min": 0.1, "median": 0.12, "max": 0.2, "values": [0.1, 0.12, 0.2]}}}}
    assert spread_problem(report, "scaling.16.recovery_s") is None


@pytest.mark.parametrize("report, complaint", [
    ({}, "is missing"),
    ({"ratio": 1.02}, "has no min, median and max"),
    ({"ratio": 1.02, "spread": {"ratio": None}}, "has no min, median and max"),
    ({"ratio": 1.02, "spread": {"ratio": {"min": 1.0, "median": 1.02}}}, "lacks a number for max"),
    ({"ratio": None, "spread": {"ratio": {"min": 1.0, "median": 1.02, "max": 1.1}}}, "not the median"),
    ({"ratio": 1.05, "spread": {"ratio": {"min": 1.0, "median": 1.02, "max": 1.1}}}, "its spread's median is 1.02"),
    ({"spread": {"ratio": {"min": 1.0, "median": 1.02, "max": 1.1}}}, "no value of its own"),
    ({"ratio": {"min": 1.2, "median": 1.02, "max": 1.1}}, "out of order"),
])
def test_a_quoted_key_without_min_median_and_max_is_reported(report, complaint):
    assert complaint in spread_problem(report, "ratio")


def test_the_keys_comments_are_read_from_the_benchmarks_section_only():
    readme = ("## Usage\n<!-- bench keys: `elsewhere` -->\n"
              "## Benchmarks\ntext\n<!-- bench keys: `a`, `b.c`,\n  `d` -->\n<!-- scale keys: `e` -->\n"
              "## Layout\n")
    assert readme_keys(readme) == {"bench": ("a", "b.c", "d"), "scale": ("e",)}


@pytest.mark.parametrize("comment", ["<!-- bench keys: a, b -->", "<!-- bench keys: -->",
                                     "<!-- results keys: `a` -->"])
def test_a_malformed_keys_comment_is_refused(comment):
    with pytest.raises(ValueError):
        readme_keys(f"## Benchmarks\n{comment}\n")
