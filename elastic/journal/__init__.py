"""A run's record and how people see it: the event journal of a run folder (`events`), reading a
run folder after the fact (`run_view`), the timeline as a picture (`timeline`), and the driver's
live line (`display`).

May import `elastic.checkpoint` (the run folder and its checkpoints) and every layer below it;
not its siblings `elastic.techniques` and `elastic.parallel`, nor the worker runtime above.
"""
