"""The controller's decisions, pure: its states (`states`), the typed observations and actions
it exchanges with the controller actor (`signals`), the rules it asks (`policies`), the
detectors that turn time and readings into findings (`detectors`), the one state machine that
joins them (`protocol`), and its tally of a run's progress (`tally`).

Nothing here touches Ray or torch.distributed: `actors/controller.py` turns what Ray tells it
into observations and carries the actions out, and the tests and the simulated scale benchmark
drive the protocol with a fake worker group (`fake_group`). May import only the vocabulary below it: `elastic.errors`, `elastic.config`,
`elastic.faults`.
"""
