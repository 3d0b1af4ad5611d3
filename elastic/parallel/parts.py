"""The parts of a run of replicas' checkpoints, by name: each place of a replica (a pipeline stage,
a tensor-parallel rank, or both) holds state of its own, which that place of every replica writes
as one part, `stage-<i>/`, `tp-<j>/` or `stage-<i>-tp-<j>/` (`elastic.checkpoint.checkpoint`
stores, lists and joins parts without reading their names).

`part_name` is the part a worker writes and restores, `part_names` every part of a replica shape,
and `check_resume_fits` refuses, before any worker starts, a checkpoint that another shape wrote.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic.errors import ElasticError

if TYPE_CHECKING:
    from elastic.checkpoint.checkpoint import Checkpoint
    from elastic.parallel.replicas import ReplicaShape


def part_name(shape: ReplicaShape, slot: int) -> str:
    """The part a replica's worker at `slot` writes: its stage's, its tensor-parallel rank's, or "" (a plain run)."""
    stage, rank = divmod(slot, shape.tensor_parallel)
    if shape.pipeline_stages > 1 and shape.tensor_parallel > 1:
        return f"stage-{stage}-tp-{rank}"
    if shape.pipeline_stages > 1:
        return f"stage-{stage}"
    return f"tp-{rank}" if shape.tensor_parallel > 1 else ""


def part_names(shape: ReplicaShape) -> list[str]:
    """Every part a run of this replica shape writes, in order."""
    return [part_name(shape, slot) for slot in range(shape.size)] if shape.size > 1 else []


def check_resume_fits(checkpoint: Checkpoint, shape: ReplicaShape) -> None:
    """A run of replicas checkpoints one part per stage (or tensor-parallel rank): it resumes at any
    number of replicas, but only with the replica shape that wrote it."""
    wanted = part_names(shape)
    if checkpoint.parts != wanted:
        written = f"the parts {checkpoint.parts}" if checkpoint.parts else "no parts (a run without replicas)"
        raise ElasticError(f"the checkpoint this run resumes from, {checkpoint.path}, holds {written}, and this run "
                           f"(pipeline_stages={shape.pipeline_stages}, tensor_parallel={shape.tensor_parallel}) "
                           f"restores {wanted or 'no parts'}: each worker resumes from its own part, so resume with the "
                           "pipeline_stages and tensor_parallel of the run that wrote it (any number of replicas), or "
                           "use a new run name")
