"""TLS for the embedded servers: a private CA and a loopback server certificate, made with the openssl CLI.

Owns: `TlsFiles` (where the CA, the server certificate and its key live), `generate_tls(dir)` (creates them
once: EC P-256, the server certificate valid for 127.0.0.1 and localhost, keys mode 0600; an existing set
is reused) and `client_context(ca)` (an `ssl.SSLContext` trusting only that CA). Does not: write server
configs (topology/network/servers.py) or start servers (topology/network/regions.py).
The `cryptography` package is not a dependency; the openssl command line is (it ships with every Linux).
"""

from __future__ import annotations

import os
import shutil
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import structlog

from rlbus.messages.errors import ServerError

log = structlog.get_logger()

CA_DAYS: Final = 3650
SERVER_DAYS: Final = 825
_SERVER_EXTENSIONS: Final = (
    "basicConstraints=critical,CA:FALSE\n"
    "keyUsage=critical,digitalSignature,keyEncipherment\n"
    "extendedKeyUsage=serverAuth,clientAuth\n"
    "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
)


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """PEM files of one region set: the CA clients and leaf links trust, and the servers' certificate."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def under(cls, directory: Path) -> TlsFiles:
        return cls(ca=directory / "ca.pem", cert=directory / "server.pem", key=directory / "server-key.pem")

    def exist(self) -> bool:
        return self.ca.is_file() and self.cert.is_file() and self.key.is_file()


def generate_tls(directory: Path, *, openssl: str | None = None) -> TlsFiles:
    """A CA and a server certificate signed by it under `directory` (reused when all three files exist).

    :raises ServerError: no openssl binary, or it failed (its stderr included).
    """
    files = TlsFiles.under(directory)
    if files.exist():
        return files
    binary = openssl or shutil.which("openssl")
    if binary is None:
        raise ServerError("TLS needs the `openssl` command to generate certificates; install it (Debian: "
                          "`apt-get install openssl`) or start the regions without tls")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_key, csr, ext = directory / "ca-key.pem", directory / "server.csr", directory / "server-ext.cnf"
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ext.write_text(_SERVER_EXTENSIONS)
    _run([binary, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(files.ca), "-days", str(CA_DAYS),
          "-subj", "/CN=rlbus local CA", "-addext", "basicConstraints=critical,CA:TRUE",
          "-addext", "keyUsage=critical,keyCertSign,cRLSign"])
    _run([binary, "req", *ec, "-keyout", str(files.key), "-out", str(csr), "-subj", "/CN=rlbus server"])
    _run([binary, "x509", "-req", "-in", str(csr), "-CA", str(files.ca), "-CAkey", str(ca_key),
          "-CAcreateserial", "-out", str(files.cert), "-days", str(SERVER_DAYS), "-extfile", str(ext)])
    for key in (ca_key, files.key):
        os.chmod(key, 0o600)
    csr.unlink()
    log.info("tls_generated", directory=str(directory))
    return files


def client_context(ca: Path) -> ssl.SSLContext:
    """A TLS client context that trusts only `ca` and checks the server's name (127.0.0.1 or localhost)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def _run(cmd: list[str]) -> None:
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=60)
    except subprocess.CalledProcessError as err:
        raise ServerError(f"{' '.join(cmd[:3])} failed ({err.returncode}): "
                          f"{err.stderr.decode(errors='replace')[-500:]}") from None
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ServerError(f"{cmd[0]} could not run: {err!r}") from None
