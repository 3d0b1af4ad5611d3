"""A run of replicas' refusals in the train loop's own calls, on a real TrainContext (no Ray, no group)."""

import pytest
import torch
from torch import nn

from elastic.comm.group import GenerationSpec
from elastic.config import DataConfig, Strategy
from elastic.errors import ElasticError
from elastic.parallel.pipelined_replica import concatenated
from elastic.parallel.replicas import ReplicaShape
from elastic.parallel.tensor_parallel import mlp_plan
from elastic.worker.context import TrainContext
from elastic.worker.mailbox import GenerationMailbox


# A step's generation, for the steps these tests make by hand (no generation forms in them).
_SPEC = GenerationSpec(generation=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       store_host="127.0.0.1", store_port=0, backend="gloo", reason="start", collective_timeout_s=60)


def _context(stages, tensor_parallel=1):
    mailbox = GenerationMailbox(on_waiting=lambda: None, on_broken=lambda g: None, on_formed=lambda g, o: None)
    return TrainContext(DataConfig(global_batch_size=8, micro_batch_size=4, max_steps=1), mailbox, [], lambda r: None,
                        False, strategy=Strategy(), shape=ReplicaShape(stages, tensor_parallel), slot=1)


def _layers():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def test_a_pipelined_run_needs_the_loss_function_its_last_stage_computes():
    with pytest.raises(ElasticError, match=r"pipeline_stages\(2\) the last stage computes the loss: call "
                                           r"ctx.prepare_model\(model, loss_fn=...\)"):
        _context(2).prepare_model(_layers())


def test_a_run_without_pipeline_stages_refuses_a_loss_function():
    with pytest.raises(ElasticError, match=r"takes a loss_fn only in a pipelined run"):
        _context(1).prepare_model(_layers(), loss_fn=nn.functional.mse_loss)


def test_a_worker_keeps_only_the_layers_of_its_stage_under_the_whole_models_names():
    ctx = _context(2)
    model = ctx.prepare_model(_layers(), loss_fn=nn.functional.mse_loss)
    assert list(model.state_dict()) == ["2.weight", "2.bias"]  # stage 1 of (Linear, Tanh) + (Linear)
    with pytest.raises(ElasticError, match=r"prepare_model\(\) was called twice"):
        ctx.prepare_model(_layers(), loss_fn=nn.functional.mse_loss)


def test_a_replicas_share_is_joined_from_its_micro_batches_whatever_they_collate_to():
    parts = [(torch.zeros(2, 3), {"y": torch.ones(2)}), (torch.ones(1, 3), {"y": torch.zeros(1)})]
    x, y = concatenated(parts)
    assert x.shape == (3, 3) and torch.equal(y["y"], torch.tensor([1.0, 1.0, 0.0]))
    with pytest.raises(ElasticError, match="cannot join str"):
        concatenated(["a", "b"])


def test_a_pipelined_step_is_one_batch_and_a_plain_steps_are_micro_batches():
    from elastic.data.order import DataCursor
    from elastic.worker.step import Step

    with pytest.raises(ElasticError, match=r"use `batch = step.batch\(\)` and `model.step\(batch\)`"):
        next(Step(_context(2), _SPEC, 0, DataCursor(), 8).micro_batches())
    with pytest.raises(ElasticError, match=r"iterate step.micro_batches\(\) and call mb.backward\(loss\) instead"):
        Step(_context(1), _SPEC, 0, DataCursor(), 8).batch()


def test_a_pipelined_run_over_a_dataset_whose_epochs_end_short_is_refused_when_its_steps_start():
    dataset = torch.utils.data.TensorDataset(torch.zeros(12, 4), torch.zeros(12, 1))  # 8 + a short step of 4
    with pytest.raises(ElasticError, match=r"the dataset has 12 samples, so each epoch ends with a step of 4, short "
                                           r"of global_batch_size\(8\).*DataConfig\(drop_last=True\)"):
        next(_context(2).steps(dataset))


def test_a_tensor_parallel_run_needs_a_plan_and_only_it_takes_one():
    with pytest.raises(ElasticError, match=r"tensor_parallel\(2\) the model's layers are cut by a plan: call "
                                           r"ctx.prepare_model\(model, tensor_parallel_plan=...\)"):
        _context(1, 2).prepare_model(_layers())
    with pytest.raises(ElasticError, match=r"takes a plan only in a tensor-parallel run"):
        _context(1).prepare_model(_layers(), tensor_parallel_plan=mlp_plan("0", "2"))


def test_a_tensor_parallel_workers_optimizer_is_built_over_the_given_model_before_any_generation():
    ctx = _context(1, 2)
    model = ctx.prepare_model(_layers(), tensor_parallel_plan=mlp_plan("0", "2"))
    assert ctx.tensor_parallel_rank == 1 and ctx.pipeline_stage == 0
    ctx.prepare_optimizer(torch.optim.AdamW(model.parameters()))  # re-pointed at the first generation's bind
    with pytest.raises(ElasticError, match=r"runs once the first generation formed"):
        model(torch.zeros(1, 4))


def test_a_pipelined_run_cuts_its_stages_where_the_split_points_say():
    layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 1))
    model = _context(2).prepare_model(layers, loss_fn=nn.functional.mse_loss, split_points=[3])
    assert list(model.state_dict()) == ["3.weight", "3.bias"]  # evenly, stage 1 would hold layers 2 and 3
    with pytest.raises(ElasticError, match=r"split_points \[3\] must increase strictly within 1..2"):
        _context(2).prepare_model(_layers(), loss_fn=nn.functional.mse_loss, split_points=[3])
    with pytest.raises(ElasticError, match=r"takes split points only in a pipelined run"):
        _context(1).prepare_model(_layers(), split_points=[1])


def test_a_stage_keeps_the_plan_keys_that_name_its_own_modules_and_a_key_naming_none_is_refused():
    from elastic.parallel.pipelined_replica import stage_plan
    from torch.distributed.tensor.parallel import ColwiseParallel

    blocks = nn.Sequential(nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.Linear(4, 8)))
    stage = nn.Module()
    stage.add_module("1", blocks[1])  # stage 1 holds layer "1" under the whole model's name
    assert list(stage_plan({"*.0": ColwiseParallel(), "0.0": ColwiseParallel()}, stage)) == ["*.0"]
    with pytest.raises(ElasticError, match=r"Plan key 'typo' matches no submodule"):
        _context(2, 2).prepare_model(_layers(), loss_fn=nn.functional.mse_loss,
                                     tensor_parallel_plan={"typo": ColwiseParallel()})


def test_a_second_backward_after_the_replicas_averaged_is_refused():
    from elastic.data.order import DataCursor
    from elastic.worker.step import MicroBatch, Step

    step = Step(_context(1, 2), _SPEC, 0, DataCursor(), 8)
    step.averaged = True
    batch = MicroBatch(data=None, indices=torch.arange(2), weight=1.0, step=step)
    with pytest.raises(ElasticError, match=r"mb.backward\(\) after the step's gradients were averaged"):
        batch.backward(torch.zeros((), requires_grad=True))
