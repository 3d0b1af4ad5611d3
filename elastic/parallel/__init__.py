"""Parallelism inside a replica, and the interface of every kind of prepared model (`prepared`):
the layout of replicas over a generation's ranks (`replicas`), what every kind of a run of
replicas does in a generation (`replica_model`), the names of their checkpoint parts (`parts`),
pipeline stages (`pipeline`), tensor parallelism (`tensor_parallel`), and the prepared models of
pipelined and tensor-parallel replicas with their kinds (`pipelined_replica`,
`tensor_parallel_replica`).

May import `elastic.checkpoint` and every layer below it; not its siblings `elastic.journal`
and `elastic.techniques`, nor the worker runtime above. Nothing is re-exported here: torch's
pipelining and DTensor take seconds to import, and a worker imports them only when its run
uses them.
"""
