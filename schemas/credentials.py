"""How a process proves who it is on the bus, and how it checks the server: the keyword arguments of
nats.connect for one role (schemas/roles.py). Credentials come from the environment, never from a URL:

  TOKENBUS_NATS_CREDS     an nkey seed file, or a directory holding one per role, <role>.nk
                          (default: $TOKENBUS_HOME/bus, where `tokenbus up --bus-auth` writes them)
  TOKENBUS_NATS_USER      a user and password instead of an nkey (an operator's own nats-server)
  TOKENBUS_NATS_PASSWORD
  TOKENBUS_NATS_CA        the CA certificate that signed the server's: the connection is TLS, verified

A dev stack on loopback has none of these and connects as before; a server without authorization
ignores credentials it did not ask for."""
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

CREDS_ENV, USER_ENV, PASSWORD_ENV, CA_ENV = ("TOKENBUS_NATS_CREDS", "TOKENBUS_NATS_USER", "TOKENBUS_NATS_PASSWORD",
                                             "TOKENBUS_NATS_CA")


def default_dir() -> Path:
    """Where `tokenbus up --bus-auth` keeps the seeds (the same home as the model cache)."""
    return Path(os.environ.get("TOKENBUS_HOME") or Path.home() / ".cache" / "tokenbus") / "bus"


def seed_file(creds: Path, role: str) -> Path:
    return creds / f"{role}.nk"


@dataclass(frozen=True, slots=True)
class Credentials:
    creds: Path | None = None            # a seed file, or a directory of <role>.nk
    ca: Path | None = None
    user: str | None = None
    password: str | None = None

    def seed(self, role: str) -> Path | None:
        """The role's nkey seed file, if there is one."""
        if self.creds is None or self.creds.is_file():
            return self.creds
        path = seed_file(self.creds, role)
        return path if path.is_file() else None

    def options(self, role: str) -> dict:
        """nats.connect keyword arguments: the role's nkey (or the user), a TLS context trusting the CA,
        and an inbox of the role's own (_INBOX_<role>.>), so that no other role may read its replies."""
        opts: dict = {"inbox_prefix": f"_INBOX_{role}"}
        if self.user:
            opts.update(user=self.user, password=self.password or "")
        elif (seed := self.seed(role)) is not None:
            opts["nkeys_seed"] = str(seed)
        if self.ca is not None:
            opts["tls"] = ssl.create_default_context(cafile=str(self.ca))
        return opts

    def env(self, role: str) -> dict[str, str]:
        """A child process's environment for the same credentials as `role`."""
        env = {}
        if (seed := self.seed(role)) is not None:
            env[CREDS_ENV] = str(seed)
        if self.ca is not None:
            env[CA_ENV] = str(self.ca)
        return env


def from_env() -> Credentials:
    """This process's credentials: the environment's, else the seeds of $TOKENBUS_HOME/bus if there are any."""
    creds = os.environ.get(CREDS_ENV)
    ca = os.environ.get(CA_ENV)
    home = default_dir()
    return Credentials(Path(creds) if creds else home if home.is_dir() else None, Path(ca) if ca else None,
                       os.environ.get(USER_ENV) or None, os.environ.get(PASSWORD_ENV))
