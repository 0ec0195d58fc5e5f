"""API keys: the keys file (`--api-keys FILE`) maps each key to its tenant and limits.

    {"sk-live-abc": {"tenant": "acme", "tokens_per_minute": 100000, "max_concurrent_requests": 8},
     "sk-nightly": {"tenant": "acme", "class": "batch"},
     "sha256:5e88…": {"tenant": "globex", "priority": 5, "weight": 2}}

A key's `class` is interactive (the default) or batch: a batch request is admitted only while some
worker has spare capacity, and runs at BATCH_PRIORITY unless it asks otherwise. A key's `priority`
(default 0; batch: BATCH_PRIORITY) is its requests' default and the most urgent they may ask for:
lower runs first, as vLLM's priority. A key's `fallback` (true or false; default: true, a batch key's
false) says whether its requests may go to the gateway's fallback upstream (`--fallback-url`) when the
cluster cannot take them. A tenant's `weight` (default 1) is its share of a busy worker under the fair
scheduling policy, against the other tenants'.

A key may be written as `sha256:<hex>` of the key instead of the key itself. Keys are looked up
by their SHA-256, and a key's id (in usage records and logs) is the first 12 hex digits of it."""
import hashlib
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import orjson

from schemas.messages import MAX_PRIORITY, MAX_WEIGHT, MIN_PRIORITY, MIN_WEIGHT
from schemas.subjects import BATCH_PRIORITY, token

FIELDS = {"tenant", "tokens_per_minute", "max_concurrent_requests", "class", "priority", "fallback", "weight"}
LIMITS = ("tokens_per_minute", "max_concurrent_requests")
PER_TENANT = (*LIMITS, "weight")  # every key of a tenant gives the same
CLASSES = ("interactive", "batch")


@dataclass(slots=True, frozen=True)
class Key:
    id: str
    tenant: str
    tokens_per_minute: int | None = None          # None: no limit
    max_concurrent_requests: int | None = None
    traffic_class: str = "interactive"            # or batch: admitted only into spare capacity
    priority: int = 0                             # its requests' default, and the most urgent they may ask
    fallback: bool = True                         # its requests may go to the fallback upstream (--fallback-url)
    weight: float = 1.0                           # its tenant's share under the fair scheduling policy

    @property
    def batch(self) -> bool:
        return self.traffic_class == "batch"


OPEN = Key("", "default")                         # every request when the gateway has no keys file


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load(path: str | Path) -> dict[str, Key]:
    """The keys file as SHA-256 hex digest → Key; ValueError naming the file, the key's id and the field."""
    try:
        entries = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as e:
        raise ValueError(f"api keys {path}: {e}") from None
    if not isinstance(entries, dict) or not entries:
        raise ValueError(f"api keys {path}: expected a non-empty JSON object of key → {{tenant, ...}}")
    keys = {}
    for name, entry in entries.items():
        h = hex_of(name, path)
        keys[h] = key(entry, h[:12], f"api keys {path}: key {h[:12]}")
    agree(keys.values(), path)
    return keys


def hex_of(name: str, path) -> str:
    if not name.startswith("sha256:"):
        return digest(name)
    h = name.removeprefix("sha256:").lower()
    if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
        raise ValueError(f"api keys {path}: {name[:20]}…: sha256: needs 64 hex digits")
    return h


def key(entry, kid: str, where: str) -> Key:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object with tenant, tokens_per_minute, max_concurrent_requests")
    extra = sorted(entry.keys() - FIELDS)
    if extra:
        raise ValueError(f"{where}: unknown field {extra[0]!r} (known: {', '.join(sorted(FIELDS))})")
    try:
        tenant = token("tenant", entry.get("tenant"))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for name in LIMITS:
        v = entry.get(name)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{where}: {name} must be a positive integer or null (got {v!r})")
    kind = entry.get("class") or "interactive"
    if kind not in CLASSES:
        raise ValueError(f"{where}: class must be one of {', '.join(CLASSES)} (got {kind!r})")
    priority = entry.get("priority")
    if priority is None:
        priority = BATCH_PRIORITY if kind == "batch" else 0
    if not isinstance(priority, int) or isinstance(priority, bool) or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"{where}: priority must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}] (got {priority!r})")
    fallback = entry.get("fallback", kind != "batch")   # batch traffic waits for spare capacity unless it says
    if not isinstance(fallback, bool):
        raise ValueError(f"{where}: fallback must be true or false (got {fallback!r})")
    weight = 1 if entry.get("weight") is None else entry["weight"]
    if not isinstance(weight, int | float) or isinstance(weight, bool) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise ValueError(f"{where}: weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}] (got {weight!r})")
    return Key(kid, tenant, entry.get("tokens_per_minute"), entry.get("max_concurrent_requests"), kind, priority,
               fallback, float(weight))


def agree(keys, path) -> None:
    """Limits and weights are per tenant: every key of a tenant must give the same ones."""
    seen: dict[str, Key] = {}
    for k in keys:
        first = seen.setdefault(k.tenant, k)
        for name in PER_TENANT:
            if getattr(k, name) != getattr(first, name):
                raise ValueError(f"api keys {path}: tenant {k.tenant!r}: keys {first.id} and {k.id} give different "
                                 f"{name} ({getattr(first, name)} and {getattr(k, name)}); "
                                 f"{'limits' if name in LIMITS else 'weights'} are per tenant")


def presented(headers, query) -> str | None:
    """The key a client sent: `Authorization: Bearer <key>`, or `?api_key=` (browsers cannot set
    headers on a websocket)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return query.get("api_key")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_keys: str | None) -> None:
    """ValueError when `host` would serve beyond this machine without keys."""
    if api_keys is None and not is_loopback(host):
        raise ValueError(f"refusing to serve on {host} without --api-keys: anyone who reaches it could use it "
                         "(without keys the gateway binds loopback only)")
