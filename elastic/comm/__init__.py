"""Generations and moving state between ranks: the torch.distributed group each membership
generation forms and how a rank leaves it (`group`), what a generation connected in one object
with its one abort (`generation`), NCCL's aborts off the heal's path (`retirement`), the
all-reduce that sums within each node
first where a generation spans nodes (`hierarchical`), the interface the groups bind (`binding`),
their TCP connections that a survivor can sever (`links`), the train loop's own collectives
(`collectives`), and state as flat buffers (`flat_state`), sent to every rank when a
generation forms (`state_sync`).

May import only the vocabulary below it: `elastic.errors`, `elastic.config`, `elastic.faults`.
"""
