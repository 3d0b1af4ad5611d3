"""A Hugging Face causal LM trained elastically: a small GPT-2 built from its config (nothing is
downloaded), AdamW under `Strategy(precision="bf16")`, on windows of bytes of a Python source file.

    python examples/train_hf.py --storage-path /tmp/runs --inject kill:rank=1,step=20

The model is the `transformers` model as it comes: `ctx.prepare_model` takes it, the loop calls
it with `labels=` and backpropagates the `ModelOutput`'s `.loss`, and `result.model_state_dict()`
loads into a fresh `GPT2LMHeadModel` by its own names. `--inject` kills a worker (the spec of
`elastic.parse_fault`): the survivors heal in place, and a replacement joins when Ray has started
it. Needs `transformers` (the test extra).
"""

from __future__ import annotations

import argparse
import inspect

import torch
import transformers

import elastic
from elastic import DataConfig, ElasticTrainer, RunConfig, ScalingConfig, Strategy, parse_fault

WINDOW = 32  # bytes a sample


def gpt2_config() -> transformers.GPT2Config:
    return transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=256, n_positions=64)


class ByteWindows(torch.utils.data.Dataset):
    """Windows of WINDOW bytes of a Python source file: a tiny, fixed corpus with structure to learn."""

    def __init__(self) -> None:
        text = inspect.getsource(torch.nn.modules.linear).encode()
        self.tokens = torch.tensor(list(text), dtype=torch.long)

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * (len(self.tokens) - WINDOW) // len(self)
        return self.tokens[start:start + WINDOW]


def train_loop(config: dict) -> dict:
    ctx = elastic.get_context()
    torch.manual_seed(0)
    model = ctx.prepare_model(transformers.GPT2LMHeadModel(gpt2_config()))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3)))
    first = None
    for step in ctx.steps(ByteWindows()):
        with step:
            for mb in step.micro_batches():
                out = model(input_ids=mb.data, labels=mb.data)
                mb.backward(out.loss)
            optimizer.step()
            optimizer.zero_grad()
        first = out.loss.item() if first is None else first
        elastic.report({"loss": out.loss.item()})
    return {"first_loss": first}


def train(storage_path: str, name: str = "train-hf", steps: int = 60, min_workers: int = 1, max_workers: int = 2,
          faults: tuple[elastic.Fault, ...] = (), show_progress: bool = True) -> elastic.Result:
    return ElasticTrainer(
        train_loop,
        scaling_config=ScalingConfig(min_workers=min_workers, max_workers=max_workers),
        run_config=RunConfig(name=name, storage_path=storage_path),
        data_config=DataConfig(global_batch_size=32, micro_batch_size=8, max_steps=steps),
        strategy=Strategy(precision="bf16"),
        faults=list(faults),
        show_progress=show_progress,
    ).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", required=True, help="local path or URI that holds the run folder")
    parser.add_argument("--name", default="train-hf")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--min-workers", type=int, default=1)
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--inject", action="append", default=[], type=parse_fault, metavar="SPEC",
                        help="a fault, e.g. kill:rank=1,step=20; repeatable")
    args = parser.parse_args()
    result = train(args.storage_path, args.name, args.steps, args.min_workers, args.max_workers, tuple(args.inject))
    print(f"step {result.step}, loss {result.value['first_loss']:.3f} -> {result.metrics['loss']:.3f}, "
          f"goodput {result.goodput:.2f}")


if __name__ == "__main__":
    main()
