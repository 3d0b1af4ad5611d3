"""benchmarks/network.py takes its figures over every kept round (`--add-rounds`): a round that did
not run a strategy leaves a gap instead of shifting the others' rounds."""

from __future__ import annotations

import pytest

from benchmarks.network import rate_figures


def _round(compute_s: float, runs: dict[str, tuple[float, float, float]]) -> dict:
    return {"compute_step_s": compute_s, "compute_together_step_s": 2 * compute_s,
            "runs": {name: {"samples_s": samples_s, "step_s": step_s, "link_bytes_per_step": link_bytes}
                     for name, (samples_s, step_s, link_bytes) in runs.items()}}


def test_each_round_gives_its_own_ratio_and_floor_and_a_missing_strategy_a_gap():
    rounds = [
        _round(0.1, {"ddp": (200.0, 0.5, 42e6), "bf16": (300.0, 0.4, 21e6)}),
        _round(0.2, {"ddp": (100.0, 1.0, 42e6)}),  # a round that ran DDP alone
    ]
    figures = rate_figures("network", "1gbit", rounds, ["ddp", "bf16"])
    assert figures["network.1gbit.bf16.samples_s_ratio_vs_ddp"] == [1.5, None]
    # The floor at 1 Gbit/s: max(compute, bytes * 8 / 1e9) over the step time.
    assert figures["network.1gbit.ddp.floor_fraction"] == pytest.approx([0.336 / 0.5, 0.336 / 1.0])
    assert figures["network.1gbit.bf16.floor_fraction"] == pytest.approx([0.168 / 0.4, None])
    assert figures["network.1gbit.ddp.floor_fraction_together"] == pytest.approx([0.336 / 0.5, 0.4 / 1.0])
    assert "network.1gbit.ddp.samples_s_ratio_vs_ddp" not in figures


def test_unshaped_rounds_have_the_compute_as_their_floor():
    figures = rate_figures("network_4nodes", "unshaped", [_round(0.1, {"ddp": (500.0, 0.2, 42e6)})], ["ddp"])
    assert figures == {"network_4nodes.unshaped.ddp.floor_fraction": [0.5],
                       "network_4nodes.unshaped.ddp.floor_fraction_together": [1.0]}
