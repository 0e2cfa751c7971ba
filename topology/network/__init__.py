"""rlbus.topology.network: the embedded NATS servers of a run and the links between them; no actors.

- `servers`: one `nats-server` process (config, ports, start, stop by PID).
- `regions`: a hub plus leaf regions, each a server or a JetStream cluster, joined as leaf nodes.
- `links`: shaped links (bandwidth, latency, loss) to leaves in their own network namespaces.
- `relay`: a loopback TCP relay that can be cut and healed; `tls`: a private CA and server certificate.
"""
