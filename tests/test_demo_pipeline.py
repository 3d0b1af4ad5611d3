"""The demo's LM as pipeline layers (`TinyLM.pipeline_layers`): the same function as TinyLM, an
untied head, and a pipeline of two gloo processes (no Ray) that trains it as one process would.

The layers must compute what TinyLM computes from the same seed, for the default blocks (whose
causal mask nn.TransformerEncoder passed, and each `CausalBlock` now applies) and for the split
ones (causal themselves). The head's weight starts equal to the embedding's but is its own
parameter. Through `PipelinedModel` on 2 stages, integer token ids feed stage 0 and float
activations cross to stage 1; in float64 the loss and every gradient equal the unpipelined
layers' on the whole batch within 1e-12. Last, `elastic demo --pipeline-stages 2`'s train loop runs
on Ray with 2 replicas of 2 stages, fault-free (tests/test_pipeline_runs.py kills stage workers).
"""

import pytest
import torch
import torch.distributed as dist

from elastic.checkpoint.checkpoint import Checkpoint
from elastic.demo.model import ModelConfig, TinyLM, next_byte_loss, next_byte_pairs
from elastic.demo.train import DemoConfig, run_demo
from elastic.parallel.pipeline import PipelinedModel
from gloo_processes import client, join, spawn

pytestmark = pytest.mark.timeout(120)
TINY = dict(seq_len=12, d_model=16, n_heads=2)
WINDOWS, MICROBATCHES = 8, 4


def _windows(rows: int = WINDOWS, seq_len: int = TINY["seq_len"]) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq_len + 1), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


@pytest.mark.parametrize("attention", ["fused", "split"])
def test_the_pipeline_layers_compute_what_tiny_lm_computes_from_the_same_seed(attention):
    config = ModelConfig(**TINY, attention=attention)
    inputs, targets = next_byte_pairs(_windows())

    layers = TinyLM(config, seed=7).pipeline_layers()
    expected = TinyLM(config, seed=7)(inputs)

    assert list(layers._modules) == ["embed", "block0", "block1", "head"]
    assert torch.allclose(layers(inputs), expected, rtol=0, atol=1e-6)
    assert torch.allclose(next_byte_loss(layers(inputs), targets), next_byte_loss(expected, targets), rtol=0, atol=1e-6)


def test_each_position_sees_only_the_bytes_before_it():
    layers = TinyLM(ModelConfig(**TINY), seed=0).pipeline_layers()
    inputs, _ = next_byte_pairs(_windows())
    changed = inputs.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256

    assert torch.equal(layers(inputs)[:, :-1], layers(changed)[:, :-1])


def test_the_head_starts_as_a_copy_of_the_embedding_and_trains_apart_from_it():
    model = TinyLM(ModelConfig(**TINY), seed=0)
    layers = model.pipeline_layers()
    head, embed = layers.head.output.weight, layers.embed.embed.weight

    assert torch.equal(head, embed) and head is not embed
    assert sum(p.numel() for p in layers.parameters()) == sum(p.numel() for p in model.parameters()) + head.numel()
    head.grad = torch.ones_like(head)
    torch.optim.SGD([head], lr=1.0).step()
    assert torch.equal(embed, model.embed.weight) and not torch.equal(head, embed)


def _pipelined_step(process: int, port: int, results) -> None:
    torch.set_num_threads(1)
    join(client(port), 0, process, 2)
    plain = TinyLM(ModelConfig(**TINY), seed=0).double().pipeline_layers()
    pipe = PipelinedModel(TinyLM(ModelConfig(**TINY), seed=0).double().pipeline_layers(), 2, next_byte_loss,
                          microbatches=MICROBATCHES, schedule="1f1b")
    pipe.bind()
    inputs, targets = next_byte_pairs(_windows())
    loss = pipe.step(inputs, targets)
    plain_loss = next_byte_loss(plain(inputs), targets)
    plain_loss.backward()
    twins = dict(plain.named_parameters())
    held = dict(pipe.module.named_parameters())
    results[process] = {
        "held": sorted({name.split(".")[0] for name in held}),
        "grad": max((p.grad - twins[name].grad).abs().max().item() for name, p in held.items()),
        "loss": None if loss is None else abs(loss.item() - plain_loss.item()),
    }
    dist.destroy_process_group()


def test_two_stages_train_the_lm_from_token_ids_as_one_process_would():
    results = spawn(_pipelined_step, nprocs=2)

    assert results[0]["held"] == ["block0", "embed"] and results[1]["held"] == ["block1", "head"]
    assert results[0]["loss"] is None and results[1]["loss"] < 1e-12
    assert max(r["grad"] for r in results.values()) < 1e-12


@pytest.mark.soak  # the same run as tests/test_pipeline_runs.py's, on the demo's LM: 25 s of CI
def test_the_pipelined_demo_trains_two_replicas_of_two_stages_on_ray(local_ray, tmp_path):
    config = DemoConfig(pipeline_stages=2, min_workers=4, max_workers=4, steps=4, seq_len=TINY["seq_len"],
                        max_bytes=20_000, data_dir=str(tmp_path / "corpus"), storage_path=str(tmp_path),
                        checkpoint_every=4)

    summary = run_demo(config, show_progress=False)

    assert summary["steps"] == 4 and [h["world_size"] for h in summary["world_size_history"]] == [4]
    assert Checkpoint.from_path(summary["checkpoint"]).parts == ["stage-0", "stage-1"]
    assert summary["final_loss"] is not None
