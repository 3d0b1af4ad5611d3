"""A worker's runtime: the train loop's API (`context`: `TrainContext`, `get_context`, `report`),
what the loop holds in one step (`step`), and the concepts behind the context, one object each:
joining and forming generations (`membership`), checkpoint snapshots (`snapshots`), each step's
micro-batches (`batching`), a step's commit or rollback (`stepping`), the hang probe (`probe`);
the factory of prepared models (`model_kinds`) and the kinds of one copy per rank
(`data_parallel`); the hand-off between the worker's control thread and its train thread
(`mailbox`), the process's random generators as synced state (`random_state`), and fault
injection at named points (`injection`).

May import every folder below it: `elastic.journal`, `elastic.techniques`, `elastic.parallel`,
`elastic.checkpoint`, `elastic.controller` (the messages it answers), `elastic.data`,
`elastic.comm`, and the vocabulary. Nothing above it: the actors, the driver's trainer, the
package's face and the CLI import it.
"""
