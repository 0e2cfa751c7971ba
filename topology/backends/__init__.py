"""rlbus.topology.backends: starting a topology's actors and keeping them running.

- `launch`: `Launch`, a run's lifetime: servers, streams, `ProcessSpec`s, then one backend.
- `local`: one supervised OS process per actor instance.
- `ray_cluster`: one Ray actor per actor instance, placed by region resources.
"""
