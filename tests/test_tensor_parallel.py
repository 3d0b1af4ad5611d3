"""Tensor parallelism (`elastic.parallel.tensor_parallel`) against the plain model, in real processes on gloo, no Ray.

Two processes form one tensor-parallel group and train in turn a Megatron MLP (colwise Linear,
GELU, rowwise Linear, then a plain Tanh head), a pre-norm causal self-attention block (q, k, v
cut by heads, the output projection rowwise, Tanh), and the demo's TinyLM built with
ModelConfig(attention="split"), all in float64. Beside it, every process trains a plain copy of
the model on the same batch. The output, the gradient of every parameter (a DTensor's gathered
with full_tensor) and every parameter after each AdamW step must equal the plain run's within
1e-12: 3 steps over a subgroup of the world, then a rebind to a fresh group (the default group
destroyed and formed again, as a heal does; the subgroup's name is gone) and 2 steps more. One
spawn runs every model, then the bad inputs that need a group; the constructor's refusals run
here.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from elastic.demo.model import ModelConfig, TinyLM
from elastic.errors import ElasticError
from elastic.parallel.tensor_parallel import SelfAttention, TensorParallelModel, attention_plan, mlp_plan
from gloo_processes import client, join, refused, spawn

pytestmark = pytest.mark.timeout(120)
TOLERANCE = 1e-12
STEPS, STEPS_AFTER_REBIND = 3, 2
TINY = ModelConfig(seq_len=8, d_model=16, n_layers=2, n_heads=4, attention="split")


class _AttentionBlock(nn.Module):
    def __init__(self, d_model: int = 8, n_heads: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.attn = SelfAttention(d_model, n_heads, causal=True)
        self.out = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(x + self.attn(self.norm(x))))


def _mlp(hidden: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, 6), nn.Tanh(), nn.Linear(6, 1)).double()


def _attention(n_heads: int = 4, d_model: int = 8) -> _AttentionBlock:
    torch.manual_seed(0)
    return _AttentionBlock(d_model, n_heads).double()


def _tiny() -> TinyLM:
    return TinyLM(TINY, seed=0).double()


def _regression(shape: tuple[int, ...]):
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(step)
        return (torch.randn(*shape, generator=generator, dtype=torch.float64),
                torch.randn(*shape[:-1], 1, generator=generator, dtype=torch.float64))
    return batch


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (4, TINY.seq_len + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# name: (model, its plan, a step's batch, the loss)
CASES = {
    "mlp": (_mlp, lambda model: mlp_plan("0", "2"), _regression((8, 6)), nn.functional.mse_loss),
    "attention": (_attention, lambda model: attention_plan("attn"), _regression((4, 5, 8)), nn.functional.mse_loss),
    "tinylm": (_tiny, lambda model: model.tensor_parallel_plan(), _tokens, _next_token_loss),
}


def _locals(module: nn.Module) -> dict[str, DTensor]:
    return {name: p for name, p in module.named_parameters() if isinstance(p, DTensor)}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _train_beside_plain(store, process: int, generation: int, case: str) -> tuple[dict, int]:
    """The tensor-parallel model and a plain copy, both AdamW: STEPS steps, a rebind, STEPS_AFTER_REBIND more."""
    build, plan, batch, loss_fn = CASES[case]
    model = build()
    plain = copy.deepcopy(model)
    tp = TensorParallelModel(model, plan(model), size=2)
    tp.bind(dist.new_group([0, 1]))  # a subgroup, as a replica's tensor-parallel group is
    optimizer = tp.adopt(torch.optim.AdamW(tp.module.parameters(), lr=1e-2, weight_decay=0.1))
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1)
    twins = dict(plain.named_parameters())
    errors = {"output": 0.0, "grad": 0.0, "param": 0.0}
    kept_locals = None
    for step in range(STEPS + STEPS_AFTER_REBIND):
        if step == STEPS:
            before = _locals(tp.module)
            generation += 1
            join(store, generation, process, 2)
            tp.bind()  # the new world; the first group's name is gone with it
            after = _locals(tp.module)
            kept_locals = {n: p.to_local().data_ptr() for n, p in before.items()} == \
                {n: p.to_local().data_ptr() for n, p in after.items()}
        x, y = batch(step)
        optimizer.zero_grad()
        output = tp.module(x)
        loss_fn(output, y).backward()
        plain_optimizer.zero_grad()
        plain_output = plain(x)
        loss_fn(plain_output, y).backward()
        errors["output"] = max(errors["output"], (_full(output) - plain_output).abs().max().item())
        held = dict(tp.module.named_parameters())  # read again: each bind builds a new module
        for name, param in held.items():
            errors["grad"] = max(errors["grad"], (_full(param.grad) - twins[name].grad).abs().max().item())
        optimizer.step()
        plain_optimizer.step()
        for name, param in held.items():
            errors["param"] = max(errors["param"], (_full(param) - twins[name]).abs().max().item())
    # Every DTensor the step left (parameters, gradients, AdamW's moments) is on the last bound group, the world.
    dtensors = [t for p in held.values() if isinstance(p, DTensor)
                for t in (p, p.grad, *optimizer.state[p].values()) if isinstance(t, DTensor)]
    on_world = len(dtensors) > 0 and all(t.device_mesh.get_group() is dist.group.WORLD for t in dtensors)
    whole = torch.cat([p.detach().reshape(-1) for p in held.values() if not isinstance(p, DTensor)])
    gathered = [torch.empty_like(whole) for _ in range(2)]
    dist.all_gather(gathered, whole)
    cuts = {name: (tuple(p.to_local().shape), str(p.placements[0])) for name, p in held.items()
            if isinstance(p, DTensor)}
    return {**errors, "cuts": cuts, "kept_locals": kept_locals, "on_world": on_world, "rank": tp.rank,
            "plain_alike": torch.equal(gathered[0], gathered[1]), "plain_names": len(held) - len(cuts)}, generation


def _tensor_parallel_member(process, port, results):
    store = client(port)
    generation = 0
    for case in CASES:
        generation += 1
        join(store, generation, process, 2)
        results[(case, process)], generation = _train_beside_plain(store, process, generation, case)
    generation += 1
    join(store, generation, process, 2)
    results[("four on two ranks", process)] = refused(
        lambda: TensorParallelModel(_mlp(), mlp_plan("0", "2"), size=4).bind())
    model = _mlp()
    reference = dict(copy.deepcopy(model).named_parameters())
    if process == 1:
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1.0)  # another process built other weights
    tp = TensorParallelModel(model, mlp_plan("0", "2"), size=2)
    results[("module before bind", process)] = refused(lambda: tp.module)
    tp.bind()
    results[("rank 0's weights", process)] = max((_full(param) - reference[name]).abs().max().item()
                                                  for name, param in tp.module.named_parameters())
    results[("freed", process)] = [name for name, param in model.named_parameters() if param.numel() == 0]
    results[("foreign optimizer", process)] = refused(lambda: tp.adopt(torch.optim.AdamW(model.parameters())))
    results[("foreach optimizer", process)] = refused(
        lambda: tp.adopt(torch.optim.AdamW(tp.module.parameters(), foreach=True)))
    generation += 1
    join(store, generation, 1 - process, 2)
    results[("rebind at another rank", process)] = refused(tp.bind)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tensor_parallel():
    return spawn(_tensor_parallel_member, nprocs=2)


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_output_gradients_and_adamw_steps_equal_the_plain_model_through_a_rebind(
        tensor_parallel, case):
    for process in range(2):
        outcome = tensor_parallel[(case, process)]
        assert outcome["rank"] == process
        assert max(outcome["output"], outcome["grad"], outcome["param"]) <= TOLERANCE, outcome


@pytest.mark.parametrize("case", list(CASES))
def test_a_rebind_moves_to_the_new_group_with_the_same_local_slices_and_unplanned_parameters_stay_alike(
        tensor_parallel, case):
    for process in range(2):
        outcome = tensor_parallel[(case, process)]
        assert outcome["on_world"] is True and outcome["kept_locals"] is True, outcome
        assert outcome["plain_alike"] is True, outcome
        assert outcome["plain_names"] > 0, outcome


def test_each_rank_holds_half_of_every_planned_projection(tensor_parallel):
    assert tensor_parallel[("mlp", 0)]["cuts"] == {
        "0.weight": ((8, 6), "S(0)"), "0.bias": ((8,), "S(0)"),  # colwise: half the hidden features
        "2.weight": ((6, 8), "S(1)"), "2.bias": ((6,), "R")}  # rowwise: half the inputs, the bias whole
    attention = tensor_parallel[("attention", 1)]["cuts"]
    assert attention["attn.q_proj.weight"] == ((4, 8), "S(0)")  # 2 of the 4 heads of width 2
    assert attention["attn.out_proj.weight"] == ((8, 4), "S(1)") and len(attention) == 7  # k_proj has no bias
    tiny = tensor_parallel[("tinylm", 0)]["cuts"]
    assert len(tiny) == 2 * 11  # per block: q, k, v, out_proj, linear1, linear2, weight and bias each (k no bias)
    assert tiny["blocks.1.linear1.weight"] == ((32, 16), "S(0)") and tiny["blocks.0.self_attn.v_proj.bias"] == \
        ((8,), "S(0)")


def test_every_rank_starts_from_rank_0s_weights_and_the_given_models_cut_weights_are_freed(tensor_parallel):
    for process in range(2):
        assert tensor_parallel[("rank 0's weights", process)] == 0.0
        # The plain head (layer 4) lives on in tp.module.
        assert tensor_parallel[("freed", process)] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_group_of_another_size_is_refused(tensor_parallel):
    for process in range(2):
        assert "The tensor-parallel group has 2 ranks and the model is cut for size(4)" in \
            tensor_parallel[("four on two ranks", process)]


def test_a_rebind_at_another_rank_is_refused_since_the_slices_are_elsewhere(tensor_parallel):
    assert "holds tensor-parallel rank 0's slices but is rank 1" in tensor_parallel[("rebind at another rank", 0)]
    assert "holds tensor-parallel rank 1's slices but is rank 0" in tensor_parallel[("rebind at another rank", 1)]


def test_the_module_before_bind_and_an_optimizer_over_other_parameters_or_with_foreach_are_refused(tensor_parallel):
    for process in range(2):
        assert "runs torch's foreach kernel, which takes plain tensors or DTensors but not both in one call" in \
            tensor_parallel[("foreach optimizer", process)]
        assert "build it with foreach=False" in tensor_parallel[("foreach optimizer", process)]
        assert "module is built by bind(group)" in tensor_parallel[("module before bind", process)]
        assert "The optimizer steps 4 parameters that are not tp.module's: build it over tp.module.parameters()" \
            " after bind(group) (or over the given model's before the first bind)" == \
            tensor_parallel[("foreign optimizer", process)]


# --- without processes ----------------------------------------------------------------------

@pytest.mark.parametrize("model, plan, message", [
    (lambda: _attention(n_heads=3, d_model=12), attention_plan("attn"),
     r"SelfAttention 'attn' has n_heads\(3\), which the tensor-parallel size\(2\) does not divide, and each rank "
     r"computes whole heads: use a size dividing 3, or a head count that is a multiple of 2"),
    (lambda: _mlp(hidden=15), mlp_plan("0", "2"),
     r"ColwiseParallel cuts '0' \(Linear\(in_features=6, out_features=15, bias=True\)\) into size\(2\) slices of its "
     r"15 output features, and 2 does not divide 15: .* \(e.g. 16\)"),
    (lambda: _mlp(hidden=15), {"2": RowwiseParallel()},
     r"RowwiseParallel cuts '2' \(.*\) into size\(2\) slices of its 15 input features, and 2 does not divide 15"),
    (lambda: _mlp(), {"mlp.up": ColwiseParallel()}, r"Plan key 'mlp.up' matches no submodule of Sequential"),
    (lambda: _mlp(), {"1": ColwiseParallel()}, r"ColwiseParallel cuts nn.Linear and nn.Embedding, and plan key '1' "
                                               r"names a GELU"),
    (lambda: TinyLM(ModelConfig(seq_len=8, d_model=16)), {"blocks.layers.*.self_attn.out_proj": RowwiseParallel()},
     r"Plan key 'blocks.layers.0.self_attn.out_proj' is in nn.MultiheadAttention 'blocks.layers.0.self_attn', which "
     r"tensor parallelism cannot cut: it keeps q, k and v in one fused in_proj_weight .* "
     r"ModelConfig\(attention='split'\)"),
])
def test_a_plan_it_cannot_cut_is_refused_naming_the_problem_and_the_fix(model, plan, message):
    with pytest.raises(ElasticError, match=message):
        TensorParallelModel(model(), plan, size=2)


def test_a_size_below_one_is_refused():
    with pytest.raises(ElasticError, match=r"size\(0\) counts the ranks of a tensor-parallel group: it must be at "
                                           r"least 1"):
        TensorParallelModel(_mlp(), mlp_plan("0", "2"), size=0)


def test_the_demo_lms_default_blocks_have_no_tensor_parallel_plan_and_the_split_ones_keep_the_default_intact():
    with pytest.raises(ElasticError, match=r"nn.MultiheadAttention, whose fused in_proj_weight tensor parallelism "
                                           r"cannot cut by heads: build it with ModelConfig\(attention='split'\)"):
        TinyLM(ModelConfig()).tensor_parallel_plan()
    default = TinyLM(ModelConfig(), seed=0)
    assert "blocks.layers.0.self_attn.in_proj_weight" in dict(default.named_parameters())
    split = dict(TinyLM(ModelConfig(attention="split"), seed=0).named_parameters())
    assert {"blocks.0.self_attn.q_proj.weight", "blocks.0.linear1.weight", "blocks.1.norm2.bias"} <= set(split)
    # The same but k's bias (n_layers x d_model), which softmax ignores: SelfAttention leaves it out.
    assert sum(p.numel() for p in split.values()) + 2 * 128 == sum(p.numel() for p in default.parameters())
