"""The bus beyond loopback, as `tokenbus up` sets it up: an nkey per role (generated, or the operator's),
the nats-server config that authorizes each with its role's permissions (schemas/roles.py) and serves
TLS, and the refusal to expose a bus without credentials."""
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import nkeys

from schemas import roles, subjects
from schemas.credentials import default_dir, seed_file
from services.gateway.keys import is_loopback


def seeds(creds: Path) -> dict[str, bytes]:
    """role → its nkey seed, read from creds/<role>.nk; a missing one is generated there (mode 0600, in a
    0700 directory). ValueError naming the file for one that is not a user seed."""
    creds.mkdir(mode=0o700, parents=True, exist_ok=True)
    out = {}
    for role in roles.ROLES:
        path = seed_file(creds, role)
        if not path.exists():
            write_private(path, nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER) + b"\n")
        out[role] = path.read_bytes().strip()
        if not out[role].startswith(b"SU"):
            raise ValueError(f"{path}: not an nkey user seed (a line starting with SU)")
    return out


def check_seeds(creds: Path) -> None:
    """ValueError naming the seed files missing from creds (a server run by the operator knows only theirs)."""
    missing = [str(seed_file(creds, role)) for role in roles.ROLES if not seed_file(creds, role).is_file()]
    if missing:
        raise ValueError(f"--bus-creds {creds}: missing {', '.join(missing)} (an nkey user seed per role)")


def write_private(path: Path, data: bytes) -> None:
    """Creates `path` readable and writable by its owner only, from the first byte written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def public_key(seed: bytes) -> str:
    try:
        return nkeys.from_seed(bytearray(seed)).public_key.decode()
    except nkeys.NkeysError as e:
        raise ValueError(f"not a valid nkey seed: {e}") from None


def authorization(creds: Path, partitions: int = 1) -> dict:
    """The `authorization` block: one nkey user per role, with its permissions on a bus of `partitions`."""
    return {"users": [{"nkey": public_key(seed), "permissions": roles.permissions(role, partitions)}
                      for role, seed in seeds(creds).items()]}


@dataclass(frozen=True, slots=True)
class Tls:
    """The embedded server's certificate and key; the CA is what services verify them with."""
    cert: Path
    key: Path

    def block(self) -> dict:
        return {"cert_file": str(self.cert), "key_file": str(self.key), "timeout": 2}


def config(creds: Path | None, tls: Tls | None, partitions: int | None = None) -> str:
    """The nats-server config for the security flags of `tokenbus up` and a partitioned bus: top-level
    `authorization`, `tls` and `mappings` blocks (their values JSON, which nats-server's config format
    takes), to use as is or `include`. partitions: default TB_BUS_PARTITIONS."""
    partitions = subjects.partitions() if partitions is None else partitions
    blocks = {"authorization": authorization(creds, partitions) if creds is not None else None,
              "tls": tls.block() if tls is not None else None,
              "mappings": subjects.mappings(partitions) or None}
    return "".join(f"{key}: {json.dumps(value, indent=1)}\n" for key, value in blocks.items() if value is not None)


def write_config(path: Path, creds: Path | None, tls: Tls | None, partitions: int | None = None) -> Path:
    """The config file beside the server's store; rewritten on every start (the seeds may have changed)."""
    path.unlink(missing_ok=True)
    write_private(path, config(creds, tls, partitions).encode())
    return path


def check_exposure(nats_host: str, nats_url: str | None, authorized: bool) -> None:
    """ValueError when the bus would be reachable beyond this machine and anyone reaching it could use it:
    the embedded nats-server on a non-loopback address, or a non-loopback --nats-url, without credentials."""
    if authorized:
        return
    if nats_url is None and not is_loopback(nats_host):
        raise ValueError(f"refusing to start nats-server on {nats_host} without credentials: anyone who reaches it "
                         "could read every prompt and publish requests; add --bus-auth (an nkey per service, "
                         "generated under $TOKENBUS_HOME/bus) or --bus-creds DIR")
    host = url_host(nats_url) if nats_url else "127.0.0.1"
    if not is_loopback(host):
        raise ValueError(f"refusing to use {nats_url} without credentials: add --bus-creds DIR (an nkey seed per "
                         "role, <role>.nk) or set TOKENBUS_NATS_USER and TOKENBUS_NATS_PASSWORD")


def main(args) -> None:
    """tokenbus bus-config: the config for a nats-server of one's own (generating the seeds missing)."""
    creds = Path(args.creds) if args.creds else default_dir()
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together: the server's certificate and its key")
    print(config(creds, Tls(Path(args.tls_cert), Path(args.tls_key)) if args.tls_cert else None), end="")
    print(f"bus-config: the seeds are in {creds} (one per role, <role>.nk)", file=sys.stderr)


def url_host(url: str) -> str:
    """The host of the first server of a nats URL (a comma-separated list is allowed)."""
    return urlsplit(url.split(",")[0].strip()).hostname or ""


def register(sub) -> None:
    bc = sub.add_parser("bus-config", help="print the nats-server config that authorizes every role (an nkey each, "
                        "its subject permissions), for a server of your own; with TB_BUS_PARTITIONS set, "
                        "its partition mappings too")
    bc.add_argument("--creds", metavar="DIR", help="the nkey seeds, <role>.nk; missing ones are generated "
                                                   "(default: $TOKENBUS_HOME/bus)")
    bc.add_argument("--tls-cert", metavar="FILE", help="the server's certificate (PEM): add its tls block")
    bc.add_argument("--tls-key", metavar="FILE", help="the key of --tls-cert (PEM)")
    bc.set_defaults(func=main)
