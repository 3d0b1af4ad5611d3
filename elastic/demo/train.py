"""The demo run: a byte-level transformer LM trained on the stdlib corpus by 2-3 elastic workers.

    elastic demo                                  # the CLI front end, see elastic/cli.py
    elastic demo --pipeline-stages 2              # 1-2 replicas of 2 pipeline stages
    python -c "from elastic.demo import DemoConfig, run_demo; run_demo(DemoConfig())"

`train_loop` is an ordinary elastic train loop and reads top to bottom like the example in
`elastic.worker.context`; `pipelined_train_loop` is the same run with the LM cut into pipeline stages
(DemoConfig(pipeline_stages > 1)). `run_demo` prepares the corpus, starts Ray when no cluster is
given, runs `ElasticTrainer.fit()` and condenses the run's events into a summary dict.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import ray
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

import elastic
from elastic.config import (
    CheckpointConfig, DataConfig, RunConfig, ScalingConfig, Strategy, check_devices_fit, check_fits, check_replicas_fit,
    check_strategy_fits, replica_words,
)
from elastic.demo.corpus import DEFAULT_MAX_BYTES, DEFAULT_SEQ_LEN, prepare_corpus
from elastic.demo.model import ModelConfig, TinyLM, next_byte_loss, next_byte_pairs
from elastic.errors import ElasticError
from elastic.faults import Fault, check_faults
from elastic.journal.events import events_of
from elastic.parallel.pipeline import VIRTUAL_STAGES

# The demo's kill fires a quarter into the run: late enough that training is visibly under
# way, early enough that the replacement worker has time to start and the run grows back.
DEFAULT_FAULT_FRACTION = 0.25
# The demo's size: 2-3 workers; pipelined, 1-2 replicas, so that a death (which takes out its
# whole replica) leaves one replica training and a new one can join.
DEFAULT_WORKERS = (2, 3)
DEFAULT_REPLICAS = (1, 2)


class DemoConfig(BaseModel):
    """Everything one demo run needs; the defaults finish in about 1-2 minutes on 2 CPU cores."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("demo", description="Run name; a second demo of the same name resumes from its checkpoint.")
    storage_path: str = Field("./runs", description="Local path or URI that holds the run folder.")
    address: str | None = Field(None, description="Ray address to connect to; None starts a local Ray.")
    pipeline_stages: int = Field(1, gt=0, description=(
        "Workers per replica, each holding one pipeline stage of the LM (TinyLM.pipeline_layers()); above 1 a "
        "death takes out its replica, and min_workers and max_workers default to 1-2 replicas."))
    tensor_parallel: int = Field(1, gt=0, description=(
        "Workers per replica that cut each block of the LM between them (ModelConfig(attention='split') and its "
        "tensor_parallel_plan()); above 1 a death takes out its replica, and min_workers and max_workers default "
        "to 1-2 replicas."))
    min_workers: int = Field(DEFAULT_WORKERS[0], gt=0, description=(
        "Fewest workers training continues with (with replicas, a multiple of their size)."))
    max_workers: int = Field(DEFAULT_WORKERS[1], gt=0, description=(
        "Most workers the run grows to (with replicas, a multiple of their size)."))
    steps: int = Field(300, gt=0, description="Optimizer steps in the run.")
    global_batch_size: int = Field(32, gt=0, description="Windows per optimizer step, across all workers.")
    micro_batch_size: int = Field(8, gt=0, description="Most windows a worker puts through one forward pass.")
    seq_len: int = Field(DEFAULT_SEQ_LEN, gt=0, description="Tokens (bytes) the model sees per window.")
    max_bytes: int = Field(DEFAULT_MAX_BYTES, gt=0, description="Size cap of the stdlib corpus, in bytes.")
    data_dir: str | None = Field(None, description="Corpus folder; None uses ~/.cache/elastic/corpus-stdlib-<seq_len>.")
    lr: float = Field(3e-3, gt=0, description="AdamW learning rate.")
    seed: int = Field(0, description="Seed of the model's initial weights and of the data order.")
    checkpoint_every: int = Field(50, gt=0, description="Steps between durable checkpoints (one is also written at the end).")
    use_gpu: bool = Field(False, description=(
        "Train on GPUs over NCCL. Where the Ray cluster has fewer GPUs than max_workers, workers share them, each a "
        "host of its own to NCCL (its network transport: a mode for tests and small runs)."))
    faults: list[Fault] = Field(default_factory=list, description="Faults to inject (see elastic.faults).")
    strategy: Strategy = Field(default_factory=Strategy, description="Precision, compression and sync (docs/techniques.md).")

    @model_validator(mode="before")
    @classmethod
    def _default_sizes(cls, values: Any) -> Any:
        """Sizes not given (or None) default to DEFAULT_WORKERS, or in replicas to DEFAULT_REPLICAS whole replicas."""
        if not isinstance(values, dict):
            return values
        stages, tensor = values.get("pipeline_stages", 1), values.get("tensor_parallel", 1)
        # A bad value is the field validator's to report.
        size = stages * tensor if isinstance(stages, int) and isinstance(tensor, int) else 1
        defaults = [replicas * size for replicas in DEFAULT_REPLICAS] if size > 1 else DEFAULT_WORKERS
        return {**values, **{name: default for name, default in zip(("min_workers", "max_workers"), defaults)
                             if values.get(name) is None}}

    @model_validator(mode="after")
    def _check(self) -> "DemoConfig":
        # Surface every cross-field problem now, in the driver, before Ray starts anything.
        if self.replica_size > 1:
            self._check_replicas()
        scaling = self.scaling_config(gpus=self.max_workers)  # the GPUs are counted once Ray runs (run_demo)
        check_fits(scaling, self.data_config())
        check_strategy_fits(self.strategy, self.run_config().checkpoint_config)
        check_devices_fit(scaling, self.strategy)
        check_replicas_fit(scaling, self.data_config(), self.strategy)
        check_faults(self.faults, self.steps, self.max_workers)
        return self

    @property
    def replica_size(self) -> int:
        return self.pipeline_stages * self.tensor_parallel

    def _check_replicas(self) -> None:
        """The demo's own checks of a run of replicas, named in its terms (worker counts, the LM's layers and
        heads)."""
        stages, size = self.pipeline_stages, self.replica_size
        for bound in ("min_workers", "max_workers"):
            workers = getattr(self, bound)
            if workers % size:
                raise ValueError(f"{bound}({workers}) is not a whole number of replicas of "
                                 f"{replica_words(stages, self.tensor_parallel)} workers: give a multiple of {size}, "
                                 f"or leave it out for {DEFAULT_REPLICAS[0]}-{DEFAULT_REPLICAS[1]} replicas")
        if stages > 1 and self.tensor_parallel > 1:
            raise ValueError("the demo runs pipeline_stages or tensor_parallel, not both: its pipeline layers "
                             "(TinyLM.pipeline_layers()) have no tensor-parallel plan; ElasticTrainer runs both "
                             "for a model whose plan names its Sequential's layers (docs/parallelism.md)")
        heads = ModelConfig(seq_len=self.seq_len).n_heads
        if heads % self.tensor_parallel:
            raise ValueError(f"tensor_parallel({self.tensor_parallel}) does not divide the LM's {heads} attention "
                             f"heads, and each worker computes whole heads: use a divisor of {heads}")
        if stages == 1:
            return
        schedule = self.strategy.pipeline_schedule
        layers = ModelConfig(seq_len=self.seq_len).n_layers + 2
        parts = stages * VIRTUAL_STAGES[schedule]
        if parts > layers:
            raise ValueError(f"pipeline_stages({stages}) under pipeline_schedule={schedule!r} would cut the LM into "
                             f"{parts} parts, but it has {layers} layers (the embedding, {layers - 2} blocks, the "
                             f"head): use at most {layers // VIRTUAL_STAGES[schedule]} pipeline stages")

    @property
    def can_heal(self) -> bool:
        """Whether a death leaves a replica training: more than one replica at most."""
        return self.max_workers > self.replica_size

    def scaling_config(self, gpus: float = 0.0) -> ScalingConfig:
        """The run's scaling; with use_gpu, each worker's share of the cluster's `gpus` (`worker_gpu_share`)."""
        gpu = {"use_gpu": True, "resources_per_worker": {"CPU": 1, "GPU": worker_gpu_share(gpus, self.max_workers)}} \
            if self.use_gpu else {}
        return ScalingConfig(min_workers=self.min_workers, max_workers=self.max_workers,
                             pipeline_stages=self.pipeline_stages, tensor_parallel=self.tensor_parallel, **gpu)

    def data_config(self) -> DataConfig:
        # Pipelined replicas cut their shares into equal micro-batches: an epoch's short last step is dropped.
        return DataConfig(global_batch_size=self.global_batch_size, micro_batch_size=self.micro_batch_size,
                          max_steps=self.steps, seed=self.seed, prefetch_threads=1,
                          drop_last=self.pipeline_stages > 1)

    def run_config(self) -> RunConfig:
        # Local SGD checkpoints only at its syncs: round the interval up to a multiple of them.
        every = self.strategy.sync_options.get("every", 1)
        return RunConfig(name=self.name, storage_path=self.storage_path,
                         checkpoint_config=CheckpointConfig(every_steps=-(-self.checkpoint_every // every) * every))


def worker_gpu_share(gpus: float, max_workers: int) -> float:
    """Each worker's share of a GPU when `max_workers` workers train on `gpus` GPUs: a whole one where
    there are enough, else an equal share that lets every worker fit (1/2 each for 3 workers on 2 GPUs)."""
    if gpus < 1:
        raise ElasticError(f"the demo was asked to train on GPUs (use_gpu, --use-gpu), but the Ray cluster has "
                           f"{gpus:g} GPUs: drop --use-gpu, or run it on a machine or Ray cluster with a GPU")
    return 1.0 if gpus >= max_workers else 1 / math.ceil(max_workers / int(gpus))


def default_fault(steps: int) -> Fault:
    """The demo's default failure: rank 1 dies a quarter into the run (pipelined: replica 0's stage 1)."""
    return Fault(kind="kill", rank=1, step=int(steps * DEFAULT_FAULT_FRACTION))


def train_loop(config: dict[str, Any]) -> None:
    """One worker's share of the run; `config` is a DemoConfig dumped to a dict."""
    demo = DemoConfig.model_validate(config)
    ctx = elastic.get_context()
    # Every worker prepares the corpus itself: on the driver's node it is already there, and a
    # worker on another node builds the identical corpus locally instead of needing shared disk.
    corpus = prepare_corpus(demo.data_dir, demo.seq_len, demo.max_bytes)
    dataset = elastic.ParquetDataset(str(corpus))
    # Tensor parallelism cuts attention by heads, which needs q, k and v as Linears of their own: the split blocks.
    attention = "split" if demo.tensor_parallel > 1 else ModelConfig.model_fields["attention"].default
    model = ctx.prepare_model(TinyLM(ModelConfig(seq_len=demo.seq_len, attention=attention), seed=demo.seed))
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=demo.lr))
    # Registered state: a newcomer takes the live schedule's position instead of starting at step 0.
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=demo.steps, eta_min=demo.lr / 10)
    ctx.register_state("scheduler", scheduler)
    for step in ctx.steps(dataset):
        with step:
            loss_sum, windows = 0.0, 0
            for mb in step.micro_batches():
                inputs, targets = next_byte_pairs(mb.data["tokens"])
                loss = next_byte_loss(model(inputs), targets)
                mb.backward(loss)
                loss_sum += loss.item() * len(inputs)
                windows += len(inputs)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        # A step whose peer died is redone in the next generation; only committed steps report.
        if step.committed:
            elastic.report({"loss": loss_sum / windows})


def pipelined_train_loop(config: dict[str, Any]) -> None:
    """`train_loop` with the LM cut into DemoConfig(pipeline_stages) stages: this worker holds stage
    `ctx.pipeline_stage` of its replica, and the replica takes its share of each step as one batch,
    which the schedule cuts into Strategy(pipeline_microbatches) micro-batches."""
    demo = DemoConfig.model_validate(config)
    ctx = elastic.get_context()
    corpus = prepare_corpus(demo.data_dir, demo.seq_len, demo.max_bytes)
    dataset = elastic.ParquetDataset(str(corpus))
    # A pipeline runs an nn.Sequential, one tensor between its layers; its head is untied from the
    # embedding, which sits on another stage (see TinyLM.pipeline_layers). No reference to the
    # whole model is kept, so the other stages' layers are freed.
    model = ctx.prepare_model(TinyLM(ModelConfig(seq_len=demo.seq_len), seed=demo.seed).pipeline_layers(),
                              loss_fn=next_byte_loss)
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=demo.lr))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=demo.steps, eta_min=demo.lr / 10)
    ctx.register_state("scheduler", scheduler)
    for step in ctx.steps(dataset):
        with step:
            batch = step.batch()
            # The pipeline takes (inputs, targets); the corpus gives windows of seq_len + 1 bytes.
            loss = model.step(dataclasses.replace(batch, data=next_byte_pairs(batch.data["tokens"])))
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        # Only the last stage computes the loss (its replica's share's mean); only committed steps report.
        if step.committed and loss is not None:
            elastic.report({"loss": loss.item()})


def run_demo(config: DemoConfig, show_progress: bool = True) -> dict[str, Any]:
    """Run the demo to its end and return its summary; raises what `ElasticTrainer.fit()` raises."""
    # Building the corpus here fails fast on a bad data_dir and saves the workers the work.
    prepare_corpus(config.data_dir, config.seq_len, config.max_bytes)
    gpus = 0.0
    if config.use_gpu:  # each worker's share of a GPU follows from the cluster's GPUs
        _connect(config)
        gpus = ray.cluster_resources().get("GPU", 0.0)
    trainer = elastic.ElasticTrainer(
        pipelined_train_loop if config.pipeline_stages > 1 else train_loop,
        train_loop_config=config.model_dump(),
        scaling_config=config.scaling_config(gpus),
        run_config=config.run_config(),
        data_config=config.data_config(),
        strategy=config.strategy,
        faults=config.faults,
        address=config.address,
        show_progress=show_progress,
    )
    _connect(config)
    started = time.time()
    result = trainer.fit()
    return summarize(result, config, started)


def _connect(config: DemoConfig) -> None:
    """Start the demo's own local Ray unless one runs or an address names a cluster (which `fit()` joins)."""
    if config.address or os.environ.get("RAY_ADDRESS") or ray.is_initialized():
        if config.use_gpu and not ray.is_initialized():
            ray.init(address=config.address)  # to count the cluster's GPUs; fit() stays in it
        return
    # address="local": a new instance even when a `ray start` cluster runs here (join that
    # one with address="auto"). Logical CPUs: each worker asks for 1, so 2 cores host 3
    # workers. No dashboard: it costs seconds of start-up and a core's worth of CPU.
    ray.init(address="local", num_cpus=max(config.max_workers, 2), include_dashboard=False)


def summarize(result: elastic.Result, config: DemoConfig, started: float) -> dict[str, Any]:
    """The run condensed from its events: world sizes over time, recoveries, goodput, loss."""
    events = result.events
    losses = [(e["step"], e["metrics"]["loss"]) for e in events_of(events, "metrics") if "loss" in e["metrics"]]
    return {
        "name": config.name,
        "storage_path": config.storage_path,
        "events": f"{result.path}/events.jsonl",
        "steps": result.step,
        "resumed_from_step": next((e["step"] for e in events_of(events, "run_resumed")), None),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "samples": result.step * config.global_batch_size,
        "wall_s": time.time() - started,
        "world_size_history": [
            {"time": e["time"], "world_size": e["world_size"], "generation": e["generation"], "reason": e["reason"]}
            for e in events_of(events, "generation_formed")
        ],
        "recoveries": [{"seconds": e["seconds"], "steps_lost": e["steps_lost"]} for e in events_of(events, "recovery")],
        "goodput": result.goodput,
        "first_loss": losses[0][1] if losses else None,
        "final_loss": result.metrics.get("loss"),
        "loss_curve": [{"step": step, "loss": loss} for step, loss in losses],
        "faults": [f.spec() for f in config.faults],
    }
