"""rlbus.topology.file: the topology file, from TOML text to a checked `Topology`; no servers, no processes.

- `schema`: the frozen Structs, one per TOML table, a docstring under every field.
- `load`: `validate(path)` (every problem at once) and `load(path)`; `_walk` walks the dict against the schema.
- `rules`: the cross-field checks; `problem`: the `Problem` record they all return.
- `reference`: docs/topology.md, generated from the schema.
"""
