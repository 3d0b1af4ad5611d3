"""Techniques as plug-ins (`elastic.techniques.technique`): built once from the Strategy into a list,
their refusals generated from what each declares it combines with (`elastic.config.COMBINATIONS`),
their spec strings parsed once into typed values, and no module outside `elastic/techniques/`
asking which technique a run holds. Pure: no process group, no Ray.
"""

import pickle
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from elastic.comm.state_sync import RunState
from elastic.config import (COMBINATIONS, DiLoCoSpec, PowerSGDSpec, StaleSpec, Strategy, parse_compression,
                            parse_sync)
from elastic.techniques.strategy import TECHNIQUES, Techniques
from elastic.techniques.technique import Technique

ROOT = Path(__file__).resolve().parent.parent

# One Strategy per declared refusal, in COMBINATIONS' order.
REFUSED = [
    {"sync": "stale:bound=2", "zero": 1},
    {"sync": "stale:bound=2", "compression": "fp16"},
    {"sync": "stale:bound=2", "precision": "fp16"},
    {"compression": "bf16", "sync": "local_sgd:every=4"},
    {"zero": 1, "sync": "diloco:every=8"},
    {"zero_replicas": 0},
    {"zero": 2, "precision": "fp16"},
    {"zero": 3, "compression": "powersgd:rank=2"},
    {"overlap_optimizer": True, "sync": "easgd:every=4"},
    {"overlap_optimizer": True, "zero": 1},
    {"overlap_optimizer": True, "precision": "fp16"},
    {"precision": "fp16", "sync": "diloco:every=4"},
]


def _settings(fields: dict) -> SimpleNamespace:
    """What a refusal reads of a Strategy, for settings no Strategy can be built with."""
    given = {name: field.default for name, field in Strategy.model_fields.items()} | fields
    return SimpleNamespace(**given, sync_options=parse_sync(given["sync"]),
                           compression_options=parse_compression(given["compression"]))


def test_every_refusal_a_strategy_raises_is_one_a_technique_declares_with_its_message():
    declared = [(combination, refusal) for combination in COMBINATIONS for refusal in combination.refuses]
    assert len(declared) == len(REFUSED)
    for (combination, refusal), fields in zip(declared, REFUSED):
        settings = _settings(fields)
        assert combination.on(settings) and refusal.given(settings), (combination.technique, fields)
        with pytest.raises(ValidationError) as raised:
            Strategy(**fields)
        assert refusal.message.format(s=settings) in str(raised.value)


def test_a_strategy_that_no_declared_refusal_holds_for_is_accepted():
    Strategy(precision="bf16", compression="powersgd:rank=2", overlap_optimizer=True, all_reduce="flat")
    Strategy(precision="bf16", sync="stale:bound=1")
    Strategy(precision="fp16", zero=1, zero_replicas=0)


def test_a_spec_string_is_parsed_once_at_validation_into_a_typed_value_that_also_reads_as_a_dict():
    strategy = Strategy(sync="diloco:every=8")
    sync = strategy.sync_options
    assert isinstance(sync, DiLoCoSpec) and (sync.every, sync.outer_lr, sync.outer_momentum) == (8, 0.7, 0.9)
    assert strategy.sync_options is sync  # kept, not parsed again at each access
    assert sync == {"kind": "diloco", "every": 8, "outer_lr": 0.7, "outer_momentum": 0.9}
    assert sync.get("bound") is None and sync["kind"] == "diloco"
    compression = Strategy(compression="powersgd:rank=4").compression_options
    assert isinstance(compression, PowerSGDSpec) and (compression.rank, compression.start_iter) == (4, 10)
    assert strategy.sync == "diloco:every=8"  # the string stays as given, as the CLI passes it
    sent = pickle.loads(pickle.dumps(Strategy(sync="stale:bound=2")))  # as Ray sends it to the workers
    assert isinstance(sent.sync_options, StaleSpec) and sent.sync_options.bound == 2


@pytest.mark.parametrize("fields, built", [
    ({}, ["GradientCompression", "Precision"]),
    ({"zero": 1, "precision": "fp16"}, ["ZeRO", "GradientCompression", "Precision"]),
    ({"zero": 3}, ["ZeRO", "GradientCompression", "Precision"]),
    ({"sync": "stale:bound=2"}, ["StaleSynchrony", "GradientCompression", "Precision"]),
    ({"sync": "easgd:every=4"}, ["PeriodicSync", "GradientCompression", "Precision"]),
    ({"compression": "powersgd:rank=2", "overlap_optimizer": True},
     ["PowerSGDCompression", "Precision", "OptimizerOverlap"]),
])
def test_the_techniques_are_built_once_from_the_strategy_in_the_order_their_hooks_run(fields, built):
    techniques = Techniques(Strategy(**fields), torch.device("cpu"), max_steps=10, seed=0)
    assert [type(technique).__name__ for technique in techniques._all] == built


def test_what_the_worker_asks_of_the_techniques_follows_from_the_strategy():
    def asked(**fields):
        techniques = Techniques(Strategy(**fields), torch.device("cpu"), max_steps=10, seed=0)
        return (techniques.replaces_ddp, techniques.hooks_gradients, techniques.keeps_torch_buckets,
                techniques.steps_on_bucket_views, techniques.reduces_within_nodes)

    assert asked() == (False, False, False, False, True)
    assert asked(all_reduce="flat") == (False, False, False, False, False)
    assert asked(compression="bf16") == (False, True, False, False, True)
    assert asked(compression="powersgd:rank=2") == (False, True, True, False, True)
    assert asked(overlap_optimizer=True) == (False, True, False, True, True)
    assert asked(zero=1) == (False, False, False, False, True)
    assert asked(zero=2) == (True, False, False, False, False)
    assert asked(sync="local_sgd:every=4") == (True, False, False, False, False)
    assert asked(sync="stale:bound=0") == (True, False, False, False, False)


def test_the_per_step_hooks_go_only_to_the_techniques_that_act_there():
    def acting(**fields):
        techniques = Techniques(Strategy(**fields), torch.device("cpu"), max_steps=10, seed=0)
        return [[type(t).__name__ for t in hooked] for hooked in (
            techniques._after_reduce, techniques._committed, techniques._failed, techniques._at_boundary,
            techniques._set_gradient_sync)]

    assert acting() == [[], [], [], [], []]  # a plain DDP step calls no technique
    assert acting(overlap_optimizer=True) == [["OptimizerOverlap"], ["OptimizerOverlap"], ["OptimizerOverlap"], [], []]
    assert acting(compression="powersgd:rank=2")[1:3] == [["PowerSGDCompression"], ["PowerSGDCompression"]]
    assert acting(sync="stale:bound=2")[3] == ["StaleSynchrony"]
    assert acting(zero=3)[4] == ["ZeRO"]


def test_the_bytes_counted_for_steps_ddp_synced_without_the_hook_are_each_steps_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    model[1].bias.requires_grad_(False)  # a frozen parameter sends nothing
    gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    plain = Techniques(Strategy(), torch.device("cpu"), max_steps=10, seed=0)
    plain.prepare_model(model, RunState(rng=None))
    assert plain.communication(unhooked_syncs=3) == {"sync_bytes": 3 * gradient_bytes, "outer_syncs": 0}
    local = Techniques(Strategy(sync="local_sgd:every=4"), torch.device("cpu"), max_steps=10, seed=0)
    local.prepare_model(model, RunState(rng=None))
    assert local.communication(unhooked_syncs=3)["sync_bytes"] == 0  # local SGD steps alone: no DDP


def test_every_technique_is_a_plug_in_built_by_its_own_module():
    for kind in TECHNIQUES:
        assert issubclass(kind, Technique) and kind.build is not Technique.build, kind
        assert kind.__module__.startswith("elastic.techniques.") and kind.__module__ != "elastic.techniques.strategy"
    assert len({kind.__module__ for kind in TECHNIQUES}) == len(TECHNIQUES)  # one module each


# What asking which technique a run holds looks like: a type test on a technique's class, or a read
# of one of `Techniques`' former optional members.
ASKING = re.compile(r"isinstance\([^)]*\b(PowerSGD|GradientCompression|OuterSync|StaleSync|ShardedOptimizer|"
                    r"FullyShardedModel|OptimizerOverlap)\b|techniques\.(codec|outer|stale|zero|sharded|overlap|"
                    r"backup)\b")


def test_no_module_outside_the_techniques_asks_which_technique_a_run_holds():
    assert ASKING.search("if isinstance(self.codec, PowerSGD):")  # the reader sees what it must judge
    assert ASKING.search("return self._techniques.overlap is not None")
    asking = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
              for top in ("elastic", "actors") for path in sorted((ROOT / top).rglob("*.py"))
              if "techniques" not in path.relative_to(ROOT).parts
              for number, line in enumerate(path.read_text().splitlines(), 1) if ASKING.search(line)]
    assert not asking, "\n".join(asking)
