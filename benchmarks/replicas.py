"""The demo's LM on 4 workers as 4 data-parallel ranks and as 2 replicas of 2 pipeline stages, and
what a stage worker's death costs a pipelined run.

    .venv/bin/python -m benchmarks.replicas                               # 3 rounds, about 4 minutes
    .venv/bin/python -m benchmarks.replicas --rounds 1 --out /tmp/replicas.json

Run it from the repository root. Every run trains the demo's LM (`elastic demo`: TinyLM with the
demo's ModelConfig, byte windows of Python's standard library, AdamW, a global batch of 32
windows) through ElasticTrainer on one local Ray instance of 4 logical CPUs, one torch thread per worker.
Each round, in turn:

- dp4: plain DDP on 4 workers, `TinyLM` (its head tied to the embedding), each rank a
  micro-batch of 8 windows per step;
- dp2_pp2: `ScalingConfig(pipeline_stages=2)` with 2 replicas of 2 workers,
  `TinyLM.pipeline_layers()` (the head untied: one output layer more), each replica pipelining
  its 16 windows as Strategy's default 4 micro-batches under 1F1B;
- heal: `elastic demo --pipeline-stages 2` itself (`run_demo`): 1-2 replicas, rank 1 (stage 1
  of replica 0) killed a quarter into HEAL_STEPS steps; its replica leaves whole, the other heals
  in place, and a new replica of 2 fresh workers joins when Ray has started them.

The first two are fault-free, STEPS steps each, with the same global batch, data order and
seed. Figures, each a median over the rounds with min, median and max under `spread.<key>`:

- lm_samples_s.dp4, lm_samples_s.dp2_pp2: the global batch over rank 0's median gap between
  committed steps past WARMUP_STEPS (all 4 workers in the generation);
- lm_samples_s_ratio_dp2_pp2_vs_dp4: their ratio, taken within each round;
- replica_heal_s: the heal's `recovery` event's seconds, from the controller seeing the death to
  the commit of the surviving replica's generation;
- replica_join_s: `pause_s` of the grow that takes the new replica in (its `generation_formed`
  event of kind "grow" after the heal): the surviving replica's pause, leaving the old group to
  training in the new one;
- replica_join_sync_s: that grow's `sync_s`, each stage's state sent from the live replica's same
  stage to the new one's.

On this 2-core machine the 4 workers share 2 cores, so the throughputs compare how the two
layouts use the same CPUs, not how they scale. The keys are merged into
benchmarks/results/bench.json (or --out), keeping the others; `replicas_setup` holds each round's
step times and the heal's generations.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from typing import Any

import ray
import torch

import elastic
from benchmarks import workload
from benchmarks.bench import command_line, merge_figures, parse_rounds, print_medians
from elastic.checkpoint.storage import RunStorage
from elastic.demo.corpus import prepare_corpus
from elastic.demo.model import ModelConfig, TinyLM, next_byte_loss, next_byte_pairs
from elastic.demo.train import DemoConfig, default_fault, run_demo
from elastic.journal.events import read_events

WORKERS = 4
STAGES = 2
STEPS = 60
WARMUP_STEPS = 10  # the first steps pay for connection set-up and, pipelined, torch's shape inference
# The kill lands at step 25; the other 75 steps leave time for 2 new workers to start and join
# before the end (here the new replica joined at step 47, 9 s after the kill, on a busy machine).
HEAL_STEPS = 100
LAYOUTS = {
    "dp4": {"pipeline_stages": 1},
    "dp2_pp2": {"pipeline_stages": STAGES},
}
DEFINITIONS = {
    "lm_samples_s": "the demo's LM on 4 CPU workers of 1 logical CPU each, fault-free: the global batch (32 "
                    "windows) over rank 0's median steady step time; dp4 is DDP on 4 ranks, dp2_pp2 is 2 replicas "
                    "of 2 pipeline stages (1F1B, 4 micro-batches, the head untied)",
    "lm_samples_s_ratio_dp2_pp2_vs_dp4": "lm_samples_s.dp2_pp2 over lm_samples_s.dp4, same round",
    "replica_heal_s": "elastic demo --pipeline-stages 2 with replica 0's stage 1 killed: the recovery event's "
                      "seconds, from the controller seeing the death to the surviving replica's generation committed",
    "replica_join_s": "the grow taking a new replica in after that heal: its generation_formed pause_s, the surviving "
                      "replica's time from leaving the old group to training in the new one",
    "replica_join_sync_s": "that grow's sync_s: each stage's state sent to the new replica's same stage",
}


def train_loop(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The demo's LM, data, loss and AdamW as `elastic demo` trains them (without its learning-rate
    schedule and loss reports), plain or pipelined as the scaling config says; this rank's stamps of
    its committed steps (the Result's value is rank 0's)."""
    demo = DemoConfig.model_validate(config)
    ctx = elastic.get_context()
    dataset = elastic.ParquetDataset(str(prepare_corpus(demo.data_dir, demo.seq_len, demo.max_bytes)))
    lm = TinyLM(ModelConfig(seq_len=demo.seq_len), seed=demo.seed)
    if ctx.pipelined:
        model = ctx.prepare_model(lm.pipeline_layers(), loss_fn=next_byte_loss)
    else:
        model = ctx.prepare_model(lm)
    del lm  # pipelined, the other stage's layers are freed with it
    optimizer = ctx.prepare_optimizer(torch.optim.AdamW(model.parameters(), lr=demo.lr))
    stamps = []
    for step in ctx.steps(dataset):
        with step:
            if ctx.pipelined:
                batch = step.batch()
                model.step(dataclasses.replace(batch, data=next_byte_pairs(batch.data["tokens"])))
            else:
                for mb in step.micro_batches():
                    inputs, targets = next_byte_pairs(mb.data["tokens"])
                    mb.backward(next_byte_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
        if step.committed:
            stamps.append(workload.stamp(step.index, ctx.generation, ctx.world_size, time.perf_counter()))
    return stamps


def steady_samples_s(stamps: list[dict[str, Any]], global_batch: int) -> float:
    """The global batch over rank 0's median gap between committed steps of all WORKERS, past the warm-up."""
    gaps = workload.steady_gaps(stamps, warmup=WARMUP_STEPS, world_size=WORKERS)
    if not gaps:
        seen = sorted({(s["generation"], s["world_size"]) for s in stamps})
        raise RuntimeError(f"no steady steps at {WORKERS} workers past the warm-up of {WARMUP_STEPS}: "
                           f"(generation, world size) seen {seen}")
    return global_batch / statistics.median(gaps)


def fault_free(layout: str, storage: str) -> float:
    """Samples per second of one fault-free run of `layout` on all WORKERS."""
    demo = DemoConfig(name=f"replicas-{layout}-{time.monotonic_ns()}", storage_path=storage, steps=STEPS,
                      checkpoint_every=STEPS, min_workers=WORKERS, max_workers=WORKERS, **LAYOUTS[layout])
    result = elastic.ElasticTrainer(
        train_loop,
        train_loop_config=demo.model_dump(),
        scaling_config=demo.scaling_config(),
        run_config=demo.run_config(),
        data_config=demo.data_config(),
        strategy=demo.strategy,
        show_progress=False,
    ).fit()
    return steady_samples_s(result.value, demo.global_batch_size)


def heal_and_join(storage: str) -> dict[str, Any]:
    """`elastic demo --pipeline-stages 2` with its default kill: the heal, then the new replica's grow."""
    demo = DemoConfig(name=f"replicas-heal-{time.monotonic_ns()}", storage_path=storage, pipeline_stages=STAGES,
                      steps=HEAL_STEPS, checkpoint_every=HEAL_STEPS, faults=[default_fault(HEAL_STEPS)])
    run_demo(demo, show_progress=False)
    events = read_events(RunStorage(storage, demo.name))
    formed = [e for e in events if e["type"] == "generation_formed"]
    generations = [(e["generation"], e["kind"], e["world_size"], e["step"]) for e in formed]
    heal = next((e for e in events if e["type"] == "recovery"), None)
    if heal is None or heal["from_checkpoint"]:
        raise RuntimeError(f"the surviving replica did not heal in place: recovery {heal}; generations {generations}")
    grow = next((e for e in formed if e["kind"] == "grow" and e["generation"] > heal["generation"]
                 and e["world_size"] == demo.max_workers), None)
    if grow is None:
        raise RuntimeError(f"no new replica joined before step {HEAL_STEPS}, the last: raise HEAL_STEPS. Generations "
                           f"(generation, kind, world size, step): {generations}")
    death = next(e["time"] for e in events if e["type"] == "fault_injected")
    return {
        "heal_s": heal["seconds"],
        "join_pause_s": grow["pause_s"],
        "join_sync_s": grow["sync_s"],
        "death_to_heal_s": heal["time"] - death,
        "death_to_full_size_s": grow["time"] - death,
        "join": {k: grow[k] for k in ("barrier_s", "connect_s", "sync_s", "pause_s", "step", "switch_step")},
        "generations": generations,
    }


def main(argv: list[str] | None = None) -> int:
    _, args = parse_rounds(__doc__, argv)
    started = time.time()
    # One instance for every run: each worker asks for 1 CPU, so 4 logical CPUs host all 4.
    ray.init(address="local", num_cpus=WORKERS, include_dashboard=False, log_to_driver=False)
    # Workers cannot import `benchmarks`: ship the train loop and the workload helpers by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.cloudpickle.register_pickle_by_value(workload)
    figures: dict[str, list[float | None]] = {}
    rounds = []
    with tempfile.TemporaryDirectory(prefix="elastic-replicas-") as storage:
        for round_index in range(args.rounds):
            samples_s = {layout: fault_free(layout, storage) for layout in LAYOUTS}
            healed = heal_and_join(storage)
            for layout, value in samples_s.items():
                figures.setdefault(f"lm_samples_s.{layout}", []).append(value)
            figures.setdefault("lm_samples_s_ratio_dp2_pp2_vs_dp4", []).append(samples_s["dp2_pp2"] / samples_s["dp4"])
            figures.setdefault("replica_heal_s", []).append(healed["heal_s"])
            figures.setdefault("replica_join_s", []).append(healed["join_pause_s"])
            figures.setdefault("replica_join_sync_s", []).append(healed["join_sync_s"])
            rounds.append({"samples_s": samples_s, "heal": healed})
            print(f"round {round_index + 1}/{args.rounds}: dp4 {samples_s['dp4']:.1f} samples/s, dp2 x pp2 "
                  f"{samples_s['dp2_pp2']:.1f} samples/s; heal {healed['heal_s']:.3f} s, join pause "
                  f"{healed['join_pause_s']:.3f} s (sync {healed['join_sync_s']:.3f} s)", flush=True)
    ray.shutdown()
    demo = DemoConfig()
    details = {"replicas_setup": {
        "workers": WORKERS, "stages": STAGES, "steps": STEPS, "warmup_steps": WARMUP_STEPS, "heal_steps": HEAL_STEPS,
        "global_batch_size": demo.global_batch_size, "pipeline_schedule": demo.strategy.pipeline_schedule,
        "pipeline_microbatches": demo.strategy.pipeline_microbatches, "rounds": rounds}}
    merge_figures(args.out, figures, details, DEFINITIONS, command_line("benchmarks.replicas", argv),
                  time.time() - started)
    print_medians(figures)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
