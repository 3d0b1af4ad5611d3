"""Run configuration: frozen pydantic models, validated before any actor starts.

The names follow Ray Train (`ScalingConfig`, `RunConfig`, `CheckpointConfig`,
`FailureConfig`) so that switching is mostly a change of imports. `DataConfig` is ours: it
fixes the global batch, which elastic keeps constant at every world size.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import pyarrow.fs as pafs

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, PrivateAttr, field_validator, model_validator


class _Frozen(BaseModel):
    # No NaN or infinity: a timeout of inf fails deep in torch (a timedelta), a rate of NaN trains to NaN.
    model_config = ConfigDict(frozen=True, extra="forbid", arbitrary_types_allowed=True, allow_inf_nan=False)


class ScalingConfig(_Frozen):
    """How many workers to run, and what each one needs from the cluster.

    `ScalingConfig(num_workers=N)`, as in Ray Train and torchrun, is a fixed-size run:
    min_workers = max_workers = N; `ScalingConfig(num_workers=(2, 4))`, Ray Train V2's elastic
    range, is min_workers=2, max_workers=4.
    """

    num_workers: PositiveInt | tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="Ray Train's and torchrun's fixed world size: sets min_workers and max_workers to this; "
        "(min, max), as Ray Train V2 spells an elastic range, sets min_workers and max_workers to those."
    )
    min_workers: int = Field(1, gt=0, description="Fewest workers training may continue with.")
    max_workers: int = Field(1, gt=0, description="Most workers the run grows to when capacity exists.")
    spare_workers: int = Field(
        0, ge=0, description="Workers kept started and idle beyond max_workers; one joins at the next step "
        "boundary when a member dies, so the run is back to full size after one state sync."
    )
    pipeline_stages: int = Field(
        1, gt=0, description="Workers per replica, each holding one pipeline stage of the model (docs/parallelism.md). "
        "Above 1 the replica is the elastic unit: a death takes out its replica and the others heal in place.")
    tensor_parallel: int = Field(
        1, gt=0, description="Workers per replica (per pipeline stage) that cut each of the model's planned layers "
        "between them, Megatron-style (docs/parallelism.md); above 1 the replica is the elastic unit.")
    min_replicas: int | None = Field(
        None, gt=0, description="Fewest replicas (of pipeline_stages x tensor_parallel workers) training may continue "
        "with; sets min_workers to that many workers.")
    max_replicas: int | None = Field(
        None, gt=0, description="Most replicas the run grows to; sets max_workers to that many workers.")
    start_grace_s: float = Field(
        10.0, ge=0, description="How long the first generation waits, once one worker is ready, for the other workers "
        "started with it (torchrun's last call); past it the run starts with those ready, from min_workers, and "
        "the late ones join by a grow. Ray starts a worker in seconds, more when the machine is busy.")
    use_gpu: bool = Field(False, description="Give each worker one GPU and use NCCL instead of gloo.")
    resources_per_worker: dict[str, float] = Field(
        default_factory=dict,
        description='Ray resources per worker, e.g. {"CPU": 2}. Defaults to 1 CPU (and 1 GPU with use_gpu).',
    )

    @model_validator(mode="before")
    @classmethod
    def _fixed_size(cls, values: Any) -> Any:
        if not isinstance(values, dict) or values.get("num_workers") is None:
            return values
        given = values["num_workers"]
        if isinstance(given, (tuple, list)) and len(given) == 2:
            bounds = dict(zip(("min_workers", "max_workers"), given))
            says = f"num_workers({tuple(given)}) is the range min_workers={given[0]}, max_workers={given[1]}"
        elif isinstance(given, (tuple, list)):
            return values  # the field's validator says what a range must be
        else:
            bounds = {"min_workers": given, "max_workers": given}
            says = f"num_workers({given}) fixes the world size at {given}"
        # Compared as given: a bad number (0, "x") is the field validators' to report.
        other = {k: values[k] for k in bounds if k in values and values[k] != bounds[k]}
        if other:
            differs = ", ".join(f"{k}({v})" for k, v in other.items())
            raise ValueError(
                f"{says}, but {differs} differs; give num_workers alone for a fixed-size run (or a (min, max) "
                "range), or min_workers and max_workers without num_workers for an elastic one")
        return {**values, **bounds}

    @model_validator(mode="wrap")
    @classmethod
    def _in_replicas(cls, values: Any, handler: Any) -> "ScalingConfig":
        """min_workers and max_workers from min_replicas and max_replicas, once every field is valid."""
        config = handler(values)
        size, words = config.replica_size, replica_words(config.pipeline_stages, config.tensor_parallel)
        counted = {}
        for bound in ("min", "max"):
            replicas, field = getattr(config, f"{bound}_replicas"), f"{bound}_workers"
            if replicas is None:
                if size > 1 and field not in config.model_fields_set:
                    counted[field] = size  # one replica, as one worker is without parallelism inside replicas
                continue
            if field in config.model_fields_set and getattr(config, field) != replicas * size:
                named = "num_workers" if config.num_workers is not None else field
                raise ValueError(
                    f"{bound}_replicas({replicas}) x {words} is {replicas * size} workers, but "
                    f"{named}({getattr(config, field)}) differs; give the run's size in replicas or in workers, not both")
            counted[field] = replicas * size
        if counted and isinstance(values, dict):
            config = handler({**values, **counted})
        for bound in ("min", "max"):
            workers = getattr(config, f"{bound}_workers")
            if workers % size:
                raise ValueError(f"{bound}_workers({workers}) is not a whole number of replicas of {words} workers; "
                                 "give min_replicas and max_replicas instead")
        if size > 1 and config.spare_workers:
            raise ValueError(
                f"spare_workers({config.spare_workers}) with {words} is not built: a spare would have to be a whole "
                "replica; leave spare_workers at 0, and a new replica forms when capacity for one is back")
        return config

    @model_validator(mode="after")
    def _check(self) -> "ScalingConfig":
        if self.min_workers > self.max_workers:
            raise ValueError(
                f"min_workers({self.min_workers}) > max_workers({self.max_workers}); "
                "set min_workers <= max_workers"
            )
        negative = {k: v for k, v in self.resources_per_worker.items() if v < 0}
        if negative:
            raise ValueError(f"resources_per_worker has negative amounts {negative}; use values >= 0")
        if not self.use_gpu and self.resources_per_worker.get("GPU", 0) > 0:
            raise ValueError(
                f"resources_per_worker requests GPU={self.resources_per_worker['GPU']} but use_gpu=False; "
                "set use_gpu=True to train on GPUs"
            )
        return self

    def worker_resources(self) -> dict[str, float]:
        """The Ray resources each worker actor asks for."""
        resources = {"CPU": 1.0, **({"GPU": 1.0} if self.use_gpu else {})}
        resources.update(self.resources_per_worker)
        return resources

    @property
    def replica_range(self) -> tuple[int, int]:
        """The fewest and most replicas the run trains with."""
        return self.min_workers // self.replica_size, self.max_workers // self.replica_size

    @property
    def replica_size(self) -> int:
        """Workers per replica: the unit the run heals and grows by."""
        return self.pipeline_stages * self.tensor_parallel

    @property
    def backend(self) -> Literal["nccl", "gloo"]:
        return "nccl" if self.use_gpu else "gloo"


def replica_words(stages: int, tensor_parallel: int) -> str:
    """A replica's size as the user gave it, for messages."""
    if tensor_parallel == 1:
        return f"pipeline_stages({stages})"
    if stages == 1:
        return f"tensor_parallel({tensor_parallel})"
    return f"pipeline_stages({stages}) x tensor_parallel({tensor_parallel})"


class DataConfig(_Frozen):
    """How samples become optimizer steps. The global batch is the same at every world size.

    `ctx.steps(dataset)` needs `global_batch_size` and `max_steps`. A loop over a prepared data
    loader (Ray Train's shape) needs neither: its global batch is the loader's batch size times the
    world size the run asks for, and the run ends where the train loops return."""

    global_batch_size: int | None = Field(
        None, gt=0, description="Samples consumed by one optimizer step, across all ranks. None: a prepared data "
        "loader's batch size times ScalingConfig's max_workers (num_workers, or a range's upper bound).")
    micro_batch_size: int | None = Field(
        None, gt=0, description="Most samples a rank puts through one forward/backward pass. None: its whole share "
        "of the step in one pass.")
    max_steps: int | None = Field(
        None, gt=0, description="Optimizer steps in the whole run. None: the run ends where the train loops return "
        "(a loop over a prepared data loader only).")
    seed: int = Field(0, description="Seed of each epoch's sample permutation.")
    shuffle: bool = Field(True, description="Permute the samples of each epoch; False reads them in order.")
    shuffle_window: int = Field(
        262_144, gt=0, description="Samples permuted together: the epoch permutes blocks (Parquet row groups), then "
        "the samples inside each window of this many positions; a streaming reader holds about two windows.")
    drop_last: bool = Field(
        False, description="Drop an epoch's last step when it has fewer than global_batch_size samples; by default "
        "it is kept, and weighted as the mean over its own samples.")
    prefetch_threads: int = Field(
        0, ge=0, description="Threads that read and collate the next steps' micro-batches while this one trains; "
        "0 reads them on the train thread.")
    prefetch_processes: int = Field(
        0, ge=0, description="Worker processes that read and collate the next steps' micro-batches, as torch "
        "DataLoader's num_workers, for datasets whose reads hold the GIL; the dataset must pickle. Exclusive with "
        "prefetch_threads.")
    prefetch_steps: int = Field(2, gt=0, description="Steps read ahead when prefetch_threads or prefetch_processes > 0.")

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.prefetch_threads and self.prefetch_processes:
            raise ValueError(f"prefetch_threads({self.prefetch_threads}) and prefetch_processes("
                             f"{self.prefetch_processes}) are both set; read ahead with one or the other")
        if None not in (self.micro_batch_size, self.global_batch_size) and self.micro_batch_size > self.global_batch_size:
            raise ValueError(
                f"micro_batch_size({self.micro_batch_size}) > global_batch_size({self.global_batch_size}); "
                "a micro-batch is a part of a rank's share of the global batch"
            )
        return self


class CheckpointConfig(_Frozen):
    """When to write durable checkpoints, and how many to keep. With neither schedule set, none are written."""

    every_steps: int | None = Field(None, gt=0, description="Checkpoint after every N committed steps (and at the end).")
    every_s: float | None = Field(None, gt=0, description="Checkpoint at the first step boundary T seconds after the last one.")
    keep_last: int = Field(2, gt=0, description="Complete checkpoints kept; older ones are deleted once a newer one is complete.")

    @property
    def enabled(self) -> bool:
        return self.every_steps is not None or self.every_s is not None


class FailureConfig(_Frozen):
    """How the run reacts to failures it cannot heal in place."""

    max_failures: int = Field(
        0,
        ge=0,
        description="Application errors (exceptions in the train loop) tolerated before the run fails. "
        "Worker deaths healed in place do not count.",
    )
    capacity_timeout_s: float = Field(
        120.0, gt=0, description="How long to wait below min_workers for capacity before failing the run."
    )
    collective_timeout_s: float = Field(
        300.0, gt=0, le=7 * 24 * 3600,
        description="torch.distributed timeout of one collective, instead of its 30-minute default; a week at most."
    )
    hang_factor: float = Field(
        20.0, gt=1, description="A run is stalled when no step commits for this many median step times."
    )
    hang_floor_s: float = Field(10.0, gt=0, description="The stall deadline is never shorter than this.")
    ping_timeout_s: float = Field(
        1.0, gt=0, description="A member that answers no ping within this while the run stalls is unreachable "
        "(dead, or alive behind a link that is down) and is healed around like a death."
    )
    reach_floor_s: float = Field(
        0.5, gt=0, description="Members are pinged once no step has committed for 1.2 median step times, "
        "never sooner than this."
    )
    reach_ceiling_s: float = Field(
        1.0, gt=0, description="Members are pinged at least this often while no step commits, however long the "
        "steps: it bounds the time to see a node cut off at slow steps (a ping is one call per member)."
    )
    link_silence_s: float = Field(
        1.0, gt=0, description="While no step commits and every member answers the controller, a member whose "
        "connections to some peers carried data that went this long without an acknowledgement (the kernel "
        "retransmitting it) is cut off from them (a partial partition); the smallest set of members that explains "
        "every such link is healed around."
    )
    connect_floor_s: float = Field(
        0.1, gt=0, description="A generation's members get 4 times the slowest connect of the last generation "
        "to connect its groups, never less than this, doubled after each generation that failed to form, never "
        "more than 3 s. A member that dies inside a heal's connect costs its peers up to 5 times it (gloo's "
        "retries): the default keeps that within 0.5 s."
    )
    hang_ceiling_s: float = Field(
        600.0, gt=0, description="The stall deadline is never longer than this (and is this until steps are measured)."
    )
    straggler_factor: float | None = Field(
        None, gt=1, description="Evict a rank whose own compute takes more than this times the others' median; "
        "None (the default) never evicts."
    )
    straggler_steps: int = Field(20, gt=0, description="Consecutive slow steps before a straggler is evicted.")
    max_heals_without_step: int = Field(
        8, ge=0, description="Generations in a row that may lose a member before committing a step (a crash "
        "loop) before the run fails. Deaths are healed at no cost otherwise, so a wave of preemptions never fails it."
    )
    node_failure_limit: int = Field(
        3, gt=0, description="Worker failures on one node, within node_cooldown_s, after which new workers avoid it."
    )
    node_cooldown_s: float = Field(300.0, gt=0, description="How long a node that crash-loops is avoided.")

    @model_validator(mode="after")
    def _check(self) -> "FailureConfig":
        if self.hang_floor_s > self.hang_ceiling_s:
            raise ValueError(
                f"hang_floor_s({self.hang_floor_s}) > hang_ceiling_s({self.hang_ceiling_s}); the floor must not exceed the ceiling"
            )
        if self.reach_floor_s > self.reach_ceiling_s:
            raise ValueError(
                f"reach_floor_s({self.reach_floor_s}) > reach_ceiling_s({self.reach_ceiling_s}); the floor must not "
                "exceed the ceiling"
            )
        return self


class RunConfig(_Frozen):
    """Where the run keeps its journal, and how it handles checkpoints and failures."""

    name: str = Field(
        ..., description="Run name; one plain folder name under storage_path, of letters, digits, '_', '-' and '.'."
    )
    storage_path: str = Field(..., min_length=1, description="Local path or URI (s3://, gs://) that holds the run folder.")
    storage_filesystem: Any = Field(
        None, description="A pyarrow.fs.FileSystem to use instead of resolving storage_path (then a path on it)."
    )
    checkpoint_config: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoint retention.")
    failure_config: FailureConfig = Field(default_factory=FailureConfig, description="Failure handling.")

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        # The name becomes a path component locally and a key segment on object stores, so it
        # must not climb out of storage_path under any reading: `..`, `/`, `\`, or `%2F`.
        if not name:
            problem = "name is empty"
        elif name in (".", ".."):
            folder = "storage_path itself" if name == "." else "the parent of storage_path"
            problem = f"name {name!r} is {folder}, not a folder inside it"
        elif name[0] in "/\\":
            problem = f"name {name!r} is an absolute path"
        elif "/" in name or "\\" in name:
            problem = f"name {name!r} contains a path separator ('/' or '\\')"
        elif any(ord(c) < 32 or ord(c) == 127 for c in name):
            problem = f"name {name!r} contains a control character"
        elif "%" in name:
            problem = f"name {name!r} contains '%', which URIs and object stores decode ('%2F' is '/')"
        elif not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            problem = f"name {name!r} has characters other than letters, digits, '_', '-' and '.'"
        else:
            return name
        raise ValueError(
            f"{problem}; a run name must be one plain folder name of letters, digits, '_', '-' and '.', e.g. 'lm-1'"
        )

    @model_validator(mode="after")
    def _check_filesystem(self) -> "RunConfig":
        if self.storage_filesystem is not None and not isinstance(self.storage_filesystem, pafs.FileSystem):
            raise ValueError(
                f"storage_filesystem is a {type(self.storage_filesystem).__name__}, not a pyarrow.fs.FileSystem; "
                "pass e.g. pyarrow.fs.S3FileSystem(...) or leave it None"
            )
        if self.storage_filesystem is not None and "://" in self.storage_path:
            scheme, _, inside = self.storage_path.partition("://")
            raise ValueError(
                f"storage_path {self.storage_path!r} is a URI, but with storage_filesystem it is a path inside that "
                f"filesystem: pass storage_path={inside!r} (or drop storage_filesystem to resolve the {scheme}:// URI)"
            )
        return self


class Strategy(_Frozen):
    """How gradients and state travel: the techniques of distributed training, each of which
    every heal and grow carries in place (docs/techniques.md)."""

    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="Autocast the prepared model's forward to bf16 or fp16; fp16 also scales the loss "
        "with a GradScaler whose state every rank shares."
    )
    compression: str = Field(
        "none", description="'fp16' or 'bf16': send DDP's gradient buckets in this dtype, half the bytes of fp32. "
        "'powersgd:rank=R[,start_iter=N]': send rank-R factors of each gradient matrix, with error feedback, "
        "after N plain steps (default 10)."
    )
    all_reduce: Literal["hierarchical", "flat"] = Field(
        "hierarchical", description="How DDP's gradient all-reduce runs on gloo. 'hierarchical': where a "
        "generation's ranks span two nodes or more and a node holds two or more, each node sums its ranks' "
        "gradients first, one rank per node all-reduces across the nodes and sends the sum back within its node, "
        "so each gradient leaves a node once; elsewhere as 'flat'. 'flat': gloo's ring over every rank."
    )
    zero: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage. 1: the optimizer state sharded across ranks. 2: the gradients too, and 3: the "
        "parameters too, both on FSDP2. Each shard is also kept by the next rank and resharded point to point at "
        "every heal and grow."
    )
    zero_replicas: Literal[0, 1] = Field(
        1, description="Copies of each ZeRO shard kept by the next ranks (buddies): 1 survives any single death in "
        "place; 0 saves that memory (Adam: 8 bytes per parameter / N, 16 under zero=2/3, which also copy the "
        "parameters) and restarts the run from its latest "
        "checkpoint when a rank dies."
    )
    sync: str = Field(
        "ddp", description="'ddp': all-reduce gradients every step. 'local_sgd:every=H': average parameters "
        "every H steps. 'diloco:every=H,outer_lr=0.7,outer_momentum=0.9': every H steps an outer Nesterov SGD "
        "steps on the averaged difference from the last sync. 'easgd:every=H,alpha=0.1': every H steps each rank "
        "and a shared center move toward each other by alpha times their difference; the center is the model "
        "checkpointed and returned. Rescales happen only at those syncs. 'stale:bound=S': each step's gradient "
        "all-reduce runs while the next S steps compute, and the optimizer steps with the averaged gradient of S "
        "steps ago (stale-synchronous; S=0 is DDP); a death rolls back to the complete state S steps back."
    )
    overlap_optimizer: bool = Field(
        False, description="Step the optimizer on each of DDP's gradient buckets as soon as its all-reduce lands, "
        "while the next buckets are still on the wire, instead of on the whole model after the last one: over a "
        "link slower than compute the optimizer's time leaves the step. optimizer.step() then only waits. For "
        "optimizers that update each parameter from its own gradient (SGD, Adam, AdamW); the gradients cannot be "
        "changed between the backward and optimizer.step() (no clipping by the global norm)."
    )

    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = Field(
        "1f1b", description="How a replica's stages interleave the micro-batches of its share, with "
        "ScalingConfig(pipeline_stages > 1): 'gpipe' (all forwards, then all backwards), '1f1b' (PipeDream's one "
        "forward, one backward) or 'interleaved1f1b' (two model parts per stage)."
    )
    pipeline_microbatches: int = Field(
        4, gt=0, description="Equal micro-batches each replica cuts its share of the global batch into, with "
        "ScalingConfig(pipeline_stages > 1); more shrink the bubble, (stages-1)/(microbatches+stages-1)."
    )

    # The parsed `sync` and `compression`, set once by the validator.
    _sync: SyncSpec = PrivateAttr()
    _compression: CompressionSpec = PrivateAttr()

    @field_validator("sync")
    @classmethod
    def _check_sync(cls, sync: str) -> str:
        parse_sync(sync)
        return sync

    @field_validator("compression")
    @classmethod
    def _check_compression(cls, compression: str) -> str:
        parse_compression(compression)
        return compression

    @model_validator(mode="after")
    def _check(self) -> "Strategy":
        # The field validators parsed both strings, and `parse_*` keeps what it parsed: no second parse.
        self._sync, self._compression = parse_sync(self.sync), parse_compression(self.compression)
        for combination in COMBINATIONS:
            if (message := combination.refusal(self)) is not None:
                raise ValueError(message)
        return self

    @property
    def sync_options(self) -> SyncSpec:
        """The parsed `sync`, e.g. DiLoCoSpec(every=8, outer_lr=0.7, outer_momentum=0.9); also read as
        {"kind": "diloco", "every": 8, ...}."""
        return self._sync

    @property
    def compression_options(self) -> CompressionSpec:
        """The parsed `compression`, e.g. PowerSGDSpec(rank=4, start_iter=10); also read as
        {"kind": "powersgd", "rank": 4, "start_iter": 10}."""
        return self._compression


# --- The techniques' spec strings, parsed once into typed values --------------------------------
# `Strategy(sync="diloco:every=8")` and `Strategy(compression="powersgd:rank=4")` stay strings, as the
# CLI passes them; the validator parses each once into one of the frozen specs below, which the
# techniques read by attribute (`spec.every`). A spec also reads as the dict {"kind": ..., option:
# value} (`strategy.sync_options.get("every")`), as loops written against the dicts read it.

_OPTION_TYPES = {"int": (int, "an integer"), "float": (float, "a number")}  # a field's annotation (a string here)


@dataclass(frozen=True, eq=False, kw_only=True)
class _Spec(Mapping):
    """A parsed spec: its kind and its options, each a typed field with its default."""

    kind: str

    @classmethod
    def options(cls) -> dict[str, tuple[Callable[[str], Any], str]]:
        """Each option the spec string may give: name -> (parser, what a value must be)."""
        return {f.name: _OPTION_TYPES[f.type] for f in fields(cls) if f.name != "kind"}

    def check(self, text: str) -> None:
        """Raise ValueError, quoting the spec string `text`, where an option is missing or out of range."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def _keys(self) -> list[str]:
        return [f.name for f in fields(self)]


@dataclass(frozen=True, eq=False, kw_only=True)
class DDPSpec(_Spec):
    """sync='ddp': DDP all-reduces the gradients every step."""

    kind: str = "ddp"


@dataclass(frozen=True, eq=False, kw_only=True)
class _PeriodicSpec(_Spec):
    """The ranks step alone and sync every `every` steps (local SGD, DiLoCo, EASGD)."""

    every: int = 0  # 0: not given, which `check` refuses

    def check(self, text: str) -> None:
        if self.every < 1:
            raise ValueError(f"sync {text!r} needs every=H with H >= 1 steps between syncs, e.g. "
                             f"'{self.kind}:every=8'")


@dataclass(frozen=True, eq=False, kw_only=True)
class LocalSGDSpec(_PeriodicSpec):
    """sync='local_sgd:every=H': the parameters averaged every H steps."""

    kind: str = "local_sgd"


@dataclass(frozen=True, eq=False, kw_only=True)
class DiLoCoSpec(_PeriodicSpec):
    """sync='diloco:every=H[,outer_lr=X][,outer_momentum=X]': an outer Nesterov SGD every H steps."""

    kind: str = "diloco"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def check(self, text: str) -> None:
        super().check(text)
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(f"sync {text!r}: outer_lr must be > 0 and 0 <= outer_momentum < 1")


@dataclass(frozen=True, eq=False, kw_only=True)
class EASGDSpec(_PeriodicSpec):
    """sync='easgd:every=H[,alpha=X]': each rank and the center move toward each other every H steps."""

    kind: str = "easgd"
    alpha: float = 0.1

    def check(self, text: str) -> None:
        super().check(text)
        if not 0 < self.alpha <= 1:
            raise ValueError(f"sync {text!r}: alpha must be in (0, 1], the share of its distance to the center each "
                             "rank moves at a sync; the paper's is 0.9 / N for N ranks, e.g. 'easgd:every=8,alpha=0.1'")


@dataclass(frozen=True, eq=False, kw_only=True)
class StaleSpec(_Spec):
    """sync='stale:bound=S': the optimizer steps with the averaged gradient of S steps ago."""

    kind: str = "stale"
    bound: int = -1  # -1: not given, which `check` refuses

    def check(self, text: str) -> None:
        if self.bound < 0:
            raise ValueError(f"sync {text!r} needs bound=S with S >= 0, the steps a gradient may be late, "
                             "e.g. 'stale:bound=2'")


@dataclass(frozen=True, eq=False, kw_only=True)
class NoCompressionSpec(_Spec):
    """compression='none': DDP's gradient buckets sent as they are."""

    kind: str = "none"


@dataclass(frozen=True, eq=False, kw_only=True)
class CastSpec(_Spec):
    """compression='fp16' or 'bf16': DDP's gradient buckets sent in that dtype."""

    kind: str  # "fp16" or "bf16"


@dataclass(frozen=True, eq=False, kw_only=True)
class PowerSGDSpec(_Spec):
    """compression='powersgd:rank=R[,start_iter=N]': rank-R factors after N plain steps."""

    kind: str = "powersgd"
    rank: int = 0  # 0: not given, which `check` refuses
    start_iter: int = 10

    def check(self, text: str) -> None:
        if self.rank < 1:
            raise ValueError(f"compression {text!r} needs rank=R with R >= 1, e.g. 'powersgd:rank=4'")
        if self.start_iter < 0:
            raise ValueError(f"compression {text!r}: start_iter must be >= 0")


SyncSpec = DDPSpec | LocalSGDSpec | DiLoCoSpec | EASGDSpec | StaleSpec
CompressionSpec = NoCompressionSpec | CastSpec | PowerSGDSpec
_SYNC_KINDS: dict[str, type[_Spec]] = {"ddp": DDPSpec, "local_sgd": LocalSGDSpec, "diloco": DiLoCoSpec,
                                       "easgd": EASGDSpec, "stale": StaleSpec}
_COMPRESSION_KINDS: dict[str, type[_Spec]] = {"none": NoCompressionSpec, "fp16": CastSpec, "bf16": CastSpec,
                                              "powersgd": PowerSGDSpec}


@functools.cache
def parse_sync(text: str) -> SyncSpec:
    """'diloco:every=8,outer_lr=0.5' -> DiLoCoSpec(every=8, outer_lr=0.5, outer_momentum=0.9)."""
    usage = ("'ddp', 'local_sgd:every=H', 'diloco:every=H[,outer_lr=X][,outer_momentum=X]', "
             "'easgd:every=H[,alpha=X]' or 'stale:bound=S'")
    return _parse("sync", text, _SYNC_KINDS, usage)


@functools.cache
def parse_compression(text: str) -> CompressionSpec:
    """'powersgd:rank=4' -> PowerSGDSpec(rank=4, start_iter=10); 'fp16' -> CastSpec(kind="fp16")."""
    return _parse("compression", text, _COMPRESSION_KINDS, "'none', 'fp16', 'bf16' or 'powersgd:rank=R[,start_iter=N]'")


def _parse(field: str, text: str, kinds: dict[str, type[_Spec]], usage: str) -> Any:
    """'kind:key=value,...' -> the kind's spec, each value of the type its field gives it, checked."""
    kind, _, rest = text.partition(":")
    if kind not in kinds:
        raise ValueError(f"{field} {text!r} is not one of {usage}")
    allowed = kinds[kind].options()
    given: dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in allowed:
            raise ValueError(f"{field} {text!r}: {kind} takes no option {key!r}; use {usage}")
        if key in given:
            raise ValueError(f"{field} {text!r} gives {key} twice: give it once")
        parser, kind_of = allowed[key]
        try:
            given[key] = parser(value)
        except ValueError:
            raise ValueError(f"{field} {text!r}: {key}={value!r} is not {kind_of}") from None
        if isinstance(given[key], float) and not math.isfinite(given[key]):
            raise ValueError(f"{field} {text!r}: {key}={value!r} is not a finite number")
    spec = kinds[kind](kind=kind, **given)
    spec.check(text)
    return spec


# --- What each technique combines with ------------------------------------------------------------
# Each technique declares the settings it refuses, with the message that says why; `Strategy`'s
# validator raises the first refusal that holds, the techniques in this order. A refusal is declared
# once, by the technique whose message speaks of it. They are here, in the vocabulary layer, and not
# beside each technique's hooks (`elastic.techniques`), so that a Strategy is refused before torch
# or Ray is imported.


@dataclass(frozen=True)
class Refusal:
    """A setting a technique does not combine with: set where `given(strategy)`; `message`, formatted with the
    strategy as `s`, says why and what to use instead."""

    given: Callable[[Strategy], bool]
    message: str


@dataclass(frozen=True)
class Combination:
    """What one technique combines with: it is on where `on(strategy)`, and then refuses each of `refuses`."""

    technique: str
    on: Callable[[Strategy], bool]
    refuses: tuple[Refusal, ...]

    def refusal(self, strategy: Strategy) -> str | None:
        """The message of the first refusal that holds for `strategy`, or None."""
        if not self.on(strategy):
            return None
        return next((r.message.format(s=strategy) for r in self.refuses if r.given(strategy)), None)


def _without_ddp(s: Strategy) -> bool:
    return s.sync_options.kind != "ddp"


COMBINATIONS: tuple[Combination, ...] = (
    Combination("stale synchrony", lambda s: s.sync_options.kind == "stale", (
        Refusal(lambda s: s.zero > 0,
                "zero={s.zero} with sync={s.sync!r} is not built: a death rolls every rank back to a whole copy of the "
                "model and optimizer kept S steps behind, which ZeRO's shards (resharded at every heal) do not keep; "
                "use one or the other"),
        Refusal(lambda s: s.compression != "none",
                "compression={s.compression!r} with sync={s.sync!r} is not built: it hooks DDP's all-reduce, and stale "
                "synchrony all-reduces each step's whole gradient itself; use one or the other"),
        Refusal(lambda s: s.precision == "fp16",
                "precision='fp16' with sync={s.sync!r} is not built: the loss scaler would judge a step's overflow on "
                "this rank's own gradient, while the optimizer steps with the average of S steps ago; use "
                "precision='bf16'"),
    )),
    Combination("gradient compression", lambda s: s.compression != "none", (
        Refusal(_without_ddp, "compression={s.compression!r} acts on DDP's per-step gradient all-reduce, which "
                "sync={s.sync!r} does not do; use one or the other"),
    )),
    Combination("ZeRO", lambda s: s.zero > 0, (
        Refusal(_without_ddp, "zero={s.zero} shards the state of an optimizer that steps on all-reduced gradients; "
                "sync={s.sync!r} steps each rank alone: use one or the other"),
    )),
    Combination("ZeRO without buddy copies", lambda s: s.zero_replicas == 0, (
        Refusal(lambda s: s.zero == 0, "zero_replicas=0 drops the buddy copies of ZeRO's shards, which exist only "
                "with zero=1, 2 or 3; set zero or leave zero_replicas at 1"),
    )),
    Combination("ZeRO-2/3 on FSDP2", lambda s: s.zero >= 2, (
        Refusal(lambda s: s.precision == "fp16", "zero={s.zero} with precision='fp16' is not built: each rank would "
                "find overflows in its own gradient shard only; use precision='bf16', or zero=1"),
        Refusal(lambda s: s.compression != "none", "compression={s.compression!r} acts on DDP's gradient all-reduce; "
                "zero={s.zero} reduce-scatters the gradients with FSDP2 instead: use one or the other"),
    )),
    Combination("the overlapped optimizer", lambda s: s.overlap_optimizer, (
        Refusal(_without_ddp, "overlap_optimizer=True steps the optimizer as DDP's per-step gradient all-reduce "
                "lands, which sync={s.sync!r} does not do; use one or the other"),
        Refusal(lambda s: s.zero > 0, "overlap_optimizer=True with zero={s.zero} is not built: ZeRO steps its own "
                "shards of the optimizer; use one or the other"),
        Refusal(lambda s: s.precision == "fp16", "overlap_optimizer=True with precision='fp16' is not built: the loss "
                "scaler must see every gradient for overflow before any parameter steps; use precision='bf16'"),
    )),
    Combination("fp16 loss scaling", lambda s: s.precision == "fp16", (
        Refusal(_without_ddp, "precision='fp16' needs every rank to skip the same overflowing steps, which only "
                "sync='ddp' guarantees; use precision='bf16' with sync={s.sync!r}"),
    )),
)


def check_strategy_fits(strategy: Strategy, checkpoint: CheckpointConfig) -> None:
    """Checks between the strategy and the checkpoint schedule; raises ValueError."""
    if strategy.zero and strategy.zero_replicas == 0 and not checkpoint.enabled:
        raise ValueError(f"Strategy(zero={strategy.zero}, zero_replicas=0) restarts the run from its latest checkpoint when a rank "
                         "dies, and this run writes none: set CheckpointConfig(every_steps=N), or keep zero_replicas=1")
    every = strategy.sync_options.get("every")
    if every and checkpoint.every_steps and checkpoint.every_steps % every:
        raise ValueError(f"CheckpointConfig(every_steps={checkpoint.every_steps}) is not a multiple of the "
                         f"{strategy.sync_options.kind} interval {every} (sync={strategy.sync!r}): only the state of a "
                         f"sync is checkpointed; use every_steps={every * max(1, checkpoint.every_steps // every)}")


def check_devices_fit(scaling: ScalingConfig, strategy: Strategy) -> None:
    """Checks between the strategy and the devices; raises ValueError."""
    if strategy.overlap_optimizer and scaling.use_gpu:
        raise ValueError("Strategy(overlap_optimizer=True) with use_gpu=True is not built: NCCL's future completes "
                         "when the all-reduce is queued, and the bucket's step would have to wait on its stream; "
                         "leave overlap_optimizer off on GPUs")


def check_replicas_fit(scaling: ScalingConfig, data: DataConfig, strategy: Strategy) -> None:
    """Checks of a run of replicas (pipeline_stages or tensor_parallel > 1) across the three configs; raises
    ValueError."""
    stages, m = scaling.pipeline_stages, strategy.pipeline_microbatches
    if scaling.replica_size == 1:
        return
    words = replica_words(stages, scaling.tensor_parallel)
    if scaling.use_gpu:
        raise ValueError(f"{words} with use_gpu=True is not built: when a peer dies the control thread aborts the "
                         "generation's NCCL world group, and a survivor waiting on a replica's own group (its stages' "
                         "sends and receives, its tensor-parallel all-reduces) would stay blocked until the collective "
                         "timeout; replicas train on CPUs over gloo")
    others = {name: value for name, value in (("precision", strategy.precision), ("compression", strategy.compression),
                                              ("zero", strategy.zero), ("sync", strategy.sync),
                                              ("overlap_optimizer", strategy.overlap_optimizer))
              if value != Strategy.model_fields[name].default}
    if others:
        given = ", ".join(f"{k}={v!r}" for k, v in others.items())
        raise ValueError(f"Strategy({given}) with {words} is not built: replicas average fp32 gradients every step; "
                         "leave those at their defaults")
    if stages == 1:
        return
    if strategy.pipeline_schedule == "1f1b" and m < stages:
        raise ValueError(f"pipeline_schedule='1f1b' needs a micro-batch per stage: pipeline_microbatches({m}) < "
                         f"pipeline_stages({stages}); use pipeline_microbatches >= {stages}")
    if strategy.pipeline_schedule == "interleaved1f1b" and m % stages:
        raise ValueError(f"pipeline_schedule='interleaved1f1b' runs the micro-batches in rounds of pipeline_stages("
                         f"{stages}): pipeline_microbatches({m}) must be a multiple of {stages}")
    fewest, most = scaling.replica_range
    counts = range(fewest, most + 1)
    if any(data.global_batch_size % (replicas * m) for replicas in counts):
        bad = next(replicas for replicas in counts if data.global_batch_size % (replicas * m))
        raise ValueError(
            f"global_batch_size({data.global_batch_size}) does not split into {bad} equal replica shares of "
            f"pipeline_microbatches({m}) equal micro-batches; every replica count from min to max must divide it: "
            f"use a multiple of {math.lcm(*(replicas * m for replicas in counts))}, or change the replica range")


def check_fits(scaling: ScalingConfig, data: DataConfig) -> None:
    """Cross-config checks that need both models; raises ValueError with the numbers."""
    if data.global_batch_size is None:
        if scaling.replica_size > 1:
            raise ValueError(f"{replica_words(scaling.pipeline_stages, scaling.tensor_parallel)} train with "
                             "ctx.steps(dataset), which needs DataConfig(global_batch_size=..., max_steps=...)")
        return  # taken from the prepared data loader's batch size (`TrainContext.prepare_data_loader`)
    if scaling.replica_size > 1:
        most = scaling.replica_range[1]
        if data.global_batch_size < most:
            raise ValueError(f"global_batch_size({data.global_batch_size}) < max_replicas({most}); every replica "
                             "needs at least one sample per step")
    elif data.global_batch_size < scaling.max_workers:
        raise ValueError(
            f"global_batch_size({data.global_batch_size}) < max_workers({scaling.max_workers}); "
            "every rank needs at least one sample per step"
        )
