"""The prepared model's outputs under mixed precision keep their type and structure: only the
bf16 and fp16 tensors inside are cast back to fp32; and fp16's scaler unscales a redone step's
gradients after a step that failed past its unscale (no Ray)."""

import collections
import dataclasses

import torch

from elastic.techniques.precision import Precision

Pair = collections.namedtuple("Pair", "loss logits")


@dataclasses.dataclass
class CausalOutput(collections.OrderedDict):
    """Shaped like Hugging Face's ModelOutput: a dataclass that is an OrderedDict of its set fields,
    read as attributes, by key and by index."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, int) else super().__getitem__(key)


@dataclasses.dataclass
class Plain:
    hidden: torch.Tensor
    names: list


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        logits = self.linear(x)
        loss = logits.square().mean()
        return {"hf": CausalOutput(loss=loss, logits=logits), "pair": Pair(loss, [logits, 7]),
                "plain": Plain(logits, ["kept"]), "ordered": collections.OrderedDict(logits=logits),
                "ids": torch.arange(3)}


def test_outputs_under_bf16_keep_their_types_and_only_floating_tensors_come_back_in_fp32():
    out = Precision("bf16", torch.device("cpu")).forward(Model(), torch.randn(2, 4))
    hf = out["hf"]
    assert type(hf) is CausalOutput and hf.loss.dtype == torch.float32 and hf[0] is hf.loss
    assert hf["logits"].dtype == torch.float32 and list(hf) == ["loss", "logits"]
    assert type(out["pair"]) is Pair and out["pair"].loss.dtype == torch.float32
    assert out["pair"].logits[0].dtype == torch.float32 and out["pair"].logits[1] == 7
    assert type(out["plain"]) is Plain and out["plain"].hidden.dtype == torch.float32 and out["plain"].names == ["kept"]
    assert type(out["ordered"]) is collections.OrderedDict and out["ordered"]["logits"].dtype == torch.float32
    assert out["ids"].dtype == torch.int64, "an integer tensor was cast"
    hf.loss.backward()  # the cast stays in the graph


def test_under_bf16_the_model_really_ran_in_bf16_and_fp32_is_left_alone():
    model = Model()
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(x)["hf"].logits.dtype == torch.bfloat16  # what the cast undoes
    out = Precision("fp32", torch.device("cpu")).forward(model, x)
    assert type(out["hf"]) is CausalOutput and out["hf"].logits.dtype == torch.float32


def test_an_fp16_step_that_failed_after_its_unscale_unscales_the_redone_steps_gradients():
    # A peer's failure can end `optimizer.step()` after GradScaler unscaled the gradients (ZeRO's
    # gather, NCCL's landing check); the step is redone on new gradients, which must be unscaled too.
    precision = Precision("fp16", torch.device("cpu"))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    precision.wrap_step(optimizer)
    failures = [RuntimeError("a peer died inside the step")]

    def fail_once(*_):
        if failures:
            raise failures.pop()

    optimizer.register_step_pre_hook(fail_once)
    scale = precision.scaler.get_scale()

    def backward_and_step():
        optimizer.zero_grad()
        precision.backward((weight * torch.tensor([1.0, 2.0, 3.0])).sum())
        optimizer.step()

    try:
        backward_and_step()
    except RuntimeError:
        pass
    assert torch.equal(weight.detach(), torch.ones(3)), "the failed step stepped"
    backward_and_step()  # the redo, with gradients scaled anew
    assert precision.scaler.get_scale() == scale  # no overflow: the scale stays for the growth interval
    torch.testing.assert_close(weight.detach(), torch.tensor([0.0, -1.0, -2.0]))
