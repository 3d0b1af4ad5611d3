"""Pipeline parallelism (`elastic.parallel.pipeline`) against the unpipelined model, in real processes on gloo, no Ray.

Two processes form the stage group of one replica and train in turn under GPipe (an even split),
1F1B (split at layer 2) and Interleaved1F1B (two parts per stage): 2 stages, 4 micro-batches,
float64 with Tanh. Beside the pipeline, every process trains a plain copy of the whole model on
the whole batch. The gradients of every step, the loss, and the parameters after each AdamW
step must equal the plain run's within 1e-12: 3 steps, then a rebind to a fresh group (the
default group destroyed and formed again, as a heal does) and 2 steps more. One spawn runs
every schedule, then the bad inputs that need a group; the constructor's checks run here.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from elastic.errors import ElasticError
from elastic.parallel.pipeline import PipelinedModel, even_split_points
from gloo_processes import client, join, refused, spawn

pytestmark = pytest.mark.timeout(120)
TOLERANCE = 1e-12
STEPS, STEPS_AFTER_REBIND = 3, 2
BATCH, MICROBATCHES = 16, 4
RUNS = (("gpipe", None), ("1f1b", [2]), ("interleaved1f1b", None))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                         nn.Linear(8, 1)).double()  # 7 layers


def _pipelined(schedule: str = "1f1b", stages: int = 2, split_points=None, microbatches: int = MICROBATCHES,
               model=None) -> PipelinedModel:
    return PipelinedModel(_model() if model is None else model, stages, nn.functional.mse_loss,
                          microbatches=microbatches, schedule=schedule, split_points=split_points)


def _batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (torch.randn(rows, 6, generator=generator, dtype=torch.float64),
            torch.randn(rows, 1, generator=generator, dtype=torch.float64))


def _train_beside_plain(store, process: int, generation: int, schedule: str, split_points) -> tuple[dict, int]:
    """The pipeline and a plain model, both AdamW, through STEPS steps, a rebind, and STEPS_AFTER_REBIND more."""
    model = _model()
    plain = copy.deepcopy(model)
    pipe = _pipelined(schedule, split_points=split_points, model=model)
    pipe.bind()
    optimizer = torch.optim.AdamW(pipe.module.parameters(), lr=1e-2, weight_decay=0.1)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    twins = dict(plain.named_parameters())
    errors = {"grad": 0.0, "loss": 0.0, "param": 0.0}
    losses = 0
    for step in range(STEPS + STEPS_AFTER_REBIND):
        if step == STEPS:
            generation += 1
            join(store, generation, process, 2)
            pipe.bind()
        x, y = _batch(step)
        loss = pipe.step(x, y)
        plain_optimizer.zero_grad()
        plain_loss = nn.functional.mse_loss(plain(x), y)
        plain_loss.backward()
        held = dict(pipe.module.named_parameters())  # read again: a rebind must keep the very same parameters
        for name, param in held.items():
            errors["grad"] = max(errors["grad"], (param.grad - twins[name].grad).abs().max().item())
        if loss is not None:
            errors["loss"] = max(errors["loss"], abs(loss.item() - plain_loss.item()))
            losses += 1
        optimizer.step()
        plain_optimizer.step()
        for name, param in held.items():
            errors["param"] = max(errors["param"], (param - twins[name]).abs().max().item())
    return {**errors, "held": sorted(held), "losses": losses, "stage": pipe.stage_rank}, generation


def _stage_member(process, port, results):
    store = client(port)
    generation = 0
    for schedule, split_points in RUNS:
        generation += 1
        join(store, generation, process, 2)
        results[(schedule, process)], generation = _train_beside_plain(store, process, generation, schedule,
                                                                       split_points)
    generation += 1
    join(store, generation, process, 2)
    pipe = _pipelined()
    pipe.bind()
    results[("uneven batch", process)] = refused(lambda: pipe.step(*_batch(0, rows=10)))
    pipe.step(*_batch(0))
    results[("another shape", process)] = refused(lambda: pipe.step(*_batch(1, rows=8)))
    results[("three stages on two ranks", process)] = refused(lambda: _pipelined(stages=3).bind())
    generation += 1
    join(store, generation, 1 - process, 2)
    results[("rebind at another rank", process)] = refused(pipe.bind)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def pipelined():
    return spawn(_stage_member, nprocs=2)


@pytest.mark.parametrize("schedule", [schedule for schedule, _ in RUNS])
def test_pipelined_gradients_and_adamw_steps_equal_the_plain_model_through_a_rebind(pipelined, schedule):
    for process in range(2):
        outcome = pipelined[(schedule, process)]
        assert outcome["stage"] == process
        assert outcome["grad"] <= TOLERANCE and outcome["param"] <= TOLERANCE, outcome
    last = pipelined[(schedule, 1)]
    assert last["losses"] == STEPS + STEPS_AFTER_REBIND and last["loss"] <= TOLERANCE, last
    assert pipelined[(schedule, 0)]["losses"] == 0


def test_each_stage_holds_its_parts_layers_under_the_whole_models_names(pipelined):
    held = {(schedule, process): pipelined[(schedule, process)]["held"] for schedule, _ in RUNS for process in (0, 1)}
    assert held[("gpipe", 0)] == ["0.bias", "0.weight", "2.bias", "2.weight"]  # layers 0-3 of 7
    assert held[("1f1b", 0)] == ["0.bias", "0.weight"]  # split at layer 2
    assert held[("interleaved1f1b", 0)] == ["0.bias", "0.weight", "4.bias", "4.weight"]  # parts 0 and 2 of 4
    assert held[("interleaved1f1b", 1)] == ["2.bias", "2.weight", "6.bias", "6.weight"]  # parts 1 and 3


def test_a_batch_that_the_microbatches_do_not_divide_is_refused_on_every_stage(pipelined):
    for process in range(2):
        assert "A batch of 10 inputs does not cut into microbatches(4) equal micro-batches" in \
            pipelined[("uneven batch", process)]
    assert "multiple of 4, e.g. 8" in pipelined[("uneven batch", 0)]


def test_a_batch_of_another_shape_within_one_binding_is_refused_naming_bind(pipelined):
    for process in range(2):
        message = pipelined[("another shape", process)]
        assert message is not None and "the first step since bind() had (16, " in message
        assert "call bind(group) on every stage" in message


def test_a_stage_group_of_another_size_is_refused(pipelined):
    for process in range(2):
        assert "The stage group has 2 ranks and the model is cut for stages(3)" in \
            pipelined[("three stages on two ranks", process)]


def test_a_rebind_at_another_rank_is_refused_since_the_stage_parameters_are_elsewhere(pipelined):
    assert "This process holds stage 0's parameters but is rank 1" in pipelined[("rebind at another rank", 0)]
    assert "This process holds stage 1's parameters but is rank 0" in pipelined[("rebind at another rank", 1)]


# --- without processes ----------------------------------------------------------------------

def test_an_even_split_gives_the_first_parts_one_layer_more_and_split_points_cut_where_given():
    assert even_split_points(7, 2) == [4] and even_split_points(7, 4) == [2, 4, 6] and even_split_points(4, 4) == [1, 2, 3]
    assert _pipelined("gpipe").spans == [(0, 4), (4, 7)]
    assert _pipelined("interleaved1f1b").spans == [(0, 2), (2, 4), (4, 6), (6, 7)]
    assert _pipelined("1f1b", split_points=[5]).spans == [(0, 5), (5, 7)]
    assert _pipelined("GPipe", model=list(_model())).schedule == "gpipe"


@pytest.mark.parametrize("arguments, message", [
    (dict(schedule="zerobubble"),
     r"Unknown pipeline schedule 'zerobubble': choose one of 'gpipe', '1f1b', 'interleaved1f1b'"),
    (dict(stages=8), r"8 pipeline parts \(stages\(8\)\) need at least 8 layers and the model has 7: use at most 7 "
                     r"stages"),
    (dict(schedule="interleaved1f1b", stages=4),
     r"8 pipeline parts \(stages\(4\) x 2 parts per stage of 'interleaved1f1b'\) need at least 8 layers and the model "
     r"has 7: use at most 3 stages"),
    (dict(split_points=[0]), r"split_points \[0\] must increase strictly within 1..6"),
    (dict(split_points=[7]), r"split_points \[7\] must increase strictly within 1..6"),
    (dict(stages=3, split_points=[3, 3]), r"split_points \[3, 3\] must increase strictly"),
    (dict(split_points=[2, 4]), r"split_points \[2, 4\] cut the model into 3 parts, and '1f1b' with stages\(2\) runs "
                                r"2: give 1 split points"),
    (dict(microbatches=1), r"Schedule '1f1b' needs at least one micro-batch per stage: microbatches\(1\) < "
                           r"stages\(2\); use microbatches >= 2"),
    (dict(schedule="interleaved1f1b", microbatches=5),
     r"runs the micro-batches in 2 rounds of 2, and microbatches\(5\) is not a multiple of 2: use a multiple of "
     r"stages\(2\), e.g. 4"),
    (dict(stages=0), r"stages\(0\) and microbatches\(4\) must each be at least 1"),
    (dict(model=nn.Linear(2, 2)), r"cuts an nn.Sequential or a list of modules, got Linear: write the model as "
                                  r"nn.Sequential"),
])
def test_a_pipeline_it_cannot_build_is_refused_naming_the_problem_and_the_fix(arguments, message):
    with pytest.raises(ElasticError, match=message):
        _pipelined(**arguments)


def test_stepping_or_reading_the_module_before_bind_is_refused_naming_bind():
    pipe = _pipelined()
    with pytest.raises(ElasticError, match=r"step\(\) before bind\(group\)"):
        pipe.step(*_batch(0))
    with pytest.raises(ElasticError, match=r"module is known once bind\(group\)"):
        pipe.module
