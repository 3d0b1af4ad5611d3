"""The `elastic demo` as a plain driver script: a byte-level LM on Python's stdlib, 2-3 workers.

    python examples/train_lm.py                                         # local Ray on this machine
    ray job submit --working-dir . -- python examples/train_lm.py \
        --use-gpu --storage-path s3://bucket/runs                       # on a running Ray cluster

The corpus (Python's standard-library source as byte windows in Parquet) and the model come
from `elastic.demo`; the train loop and the trainer set-up are spelled out here. Rank 1 is
killed at step 75 on purpose: the survivors heal in place, and the run grows back to 3 workers
once Ray has started a replacement (`--no-fault` trains without it).

The run's events and checkpoints go to `{--storage-path}/{--name}/`, and running the same pair
again resumes from its latest checkpoint. The default, `runs/` in the working directory, suits a
local run only: under `ray job submit` it is inside Ray's unpacked copy of the code on the head
(`.../runtime_resources/working_dir_files/_ray_pkg_<hash of the code>/runs`), which every job
with the same code shares and Ray may delete; a worker on another node, where that path is its
own disk, fails to start, saying so. On a cluster pass a lasting path that every node shares:
s3://, gs://, or an NFS mount at the same path on every node.
"""

import argparse
import os

import ray
import torch
import torch.nn.functional as F

import elastic
from elastic import CheckpointConfig, DataConfig, ElasticTrainer, Fault, RunConfig, ScalingConfig
from elastic.demo import ModelConfig, TinyLM, prepare_corpus
from elastic.demo.corpus import VOCAB_SIZE

SEQ_LEN = 128
FAULT = Fault(kind="kill", rank=1, step=75)


def train_loop(config):
    ctx = elastic.get_context()
    # Each worker prepares the corpus on its own node; where it exists already this is a no-op.
    dataset = elastic.ParquetDataset(str(prepare_corpus(seq_len=config["seq_len"])))
    model = ctx.prepare_model(TinyLM(ModelConfig(seq_len=config["seq_len"]), seed=0))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=config["lr"]))
    for step in ctx.steps(dataset):
        with step:
            for mb in step.micro_batches():
                tokens = mb.data["tokens"].long()
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), tokens[:, 1:].reshape(-1))
                mb.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            elastic.report({"loss": loss.item()})


def summary(result: elastic.Result, name: str, steps: int) -> str:
    """The job's last line: how the run went, and where its events are."""
    resumed_at = next((e["step"] for e in result.events_of("run_resumed")), None)
    events = f"events in {result.path}/events.jsonl"
    if "loss" not in result.metrics:
        # Every committed step reports a loss, so none was committed: the run resumed from a
        # checkpoint that had already reached --steps.
        return (f"nothing to train: run {name!r} resumed from its checkpoint of step {resumed_at}, which reached "
                f"--steps {steps}; give a larger --steps to train further, or another --name or --storage-path "
                f"to start afresh; {events}")
    sizes = " -> ".join(str(e["world_size"]) for e in result.events_of("generation_formed"))
    resumed = "" if resumed_at is None else f"resumed from step {resumed_at}, "
    return (f"{resumed}{result.step} steps, world sizes {sizes}, goodput {result.goodput:.2f}, "
            f"final loss {result.metrics['loss']:.3f}; {events}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage-path", default=os.path.abspath("runs"),
                        help="where the run folder goes; on a cluster an s3://, gs:// or NFS path that "
                             "every node shares (default: %(default)s)")
    parser.add_argument("--name", default="train_lm")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--use-gpu", action="store_true", help="one GPU per worker, NCCL instead of gloo")
    parser.add_argument("--no-fault", action="store_true", help="do not kill rank 1 at step 75")
    args = parser.parse_args()
    prepare_corpus(seq_len=SEQ_LEN)
    if "RAY_ADDRESS" not in os.environ:
        # A new local Ray (not a `ray start` cluster that may run here), with logical CPUs:
        # each worker asks for one, so a 2-core laptop still hosts 3 workers.
        ray.init(address="local", num_cpus=3)
    trainer = ElasticTrainer(
        train_loop,
        train_loop_config={"seq_len": SEQ_LEN, "lr": 3e-3},
        scaling_config=ScalingConfig(min_workers=2, max_workers=3, use_gpu=args.use_gpu),
        run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                             checkpoint_config=CheckpointConfig(every_steps=50)),
        data_config=DataConfig(global_batch_size=32, micro_batch_size=8, max_steps=args.steps),
        faults=[] if args.no_fault or FAULT.step >= args.steps else [FAULT],
    )
    print(summary(trainer.fit(), args.name, args.steps))
