"""rlbus.topology.network: the embedded NATS servers of a run and the links between them; no actors.

- `server_config`: `ServerOptions`, all that one server is, and the text of its config file.
- `servers`: one `nats-server` process (binary, ports, start, ready, restart, stop by PID, monitoring).
- `regions`: a hub plus leaf regions, each a server or a JetStream cluster, joined as leaf nodes.
- `links`: shaped links (bandwidth, latency, loss) to leaves in their own network namespaces.
- `relay`: a loopback TCP relay that can be cut and healed; `tls`: a private CA and server certificate.
"""
