"""rlbus.topology: what a run is made of, the servers it runs on, and how its actors are started.

Rooms (each a subpackage whose docstring lists its modules):
- `file/`: the topology file: its schema, reading and validating it, the cross-field rules, the reference.
- `network/`: the embedded NATS servers, regions and shaped links between them, the cuttable relay, TLS.
- `backends/`: launching a topology (`launch`) through a backend: local processes or Ray actors.
- `examples/`: the shipped topology files (package data).

Nothing is re-exported here.
"""
