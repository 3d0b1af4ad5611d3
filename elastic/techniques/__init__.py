"""Training techniques that a `Strategy` turns on, each beside the train loop rather than in it:
mixed precision (`precision`), gradient compression (`compression`, `powersgd`), ZeRO-1
(`zero`) and ZeRO-2/3 on FSDP2 (`fsdp`) with the plans and transfers that reshard them live
(`shard_plan`, `shard_transfer`), local SGD, DiLoCo and EASGD (`local_sgd`), stale synchrony
(`stale`) and the optimizer stepped bucket by bucket as DDP's all-reduces land (`overlap`).
Each is a `Technique` (`technique`: the hooks every one has; ZeRO's at any stage is in `sharding`),
and `strategy` builds the list a run uses and calls it at each point of the run.

May import `elastic.checkpoint` and every layer below it; not its siblings `elastic.journal`
and `elastic.parallel`, nor the worker runtime above.
"""
