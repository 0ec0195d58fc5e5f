"""The request log's archive: end records (Completion) as Parquet files on any fsspec filesystem or a
directory, one file per batch of a tenant's hour under <root>/tenant=<tenant>/hour=<YYYY-MM-DDTHH>/.
The bus keeps a completion about an hour after the recorder archives it: older requests live only here.
Files are written once under a temporary name and renamed, so a reader sees whole files or none; a batch
archived twice (a crash between the write and the bus's ack) reads once."""
import contextlib
import datetime as dt
import os
import posixpath
import secrets
import time
from collections import defaultdict

import fsspec
import orjson
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from schemas import subjects
from schemas.messages import VERSION, Completion, from_obj, to_obj

HOUR = "%Y-%m-%dT%H"                       # an hour partition's name, UTC
HOUR_S = 3600.0
SUFFIX = ".parquet"
ZSTD_LEVEL = 3                             # 9: 8% smaller, 1.7× the time to encode (docs/capacity.md)
DICTIONARY = ["tenant", "worker", "finish_reason", "error_code"]   # token ids: plain, zstd does better on them
REST = ("sampling", "stop_reason", "usage", "timing")   # kept as one JSON text: read whole, never filtered on
SCHEMA = pa.schema([
    ("id", pa.string()), ("tenant", pa.string()), ("worker", pa.string()), ("finish_reason", pa.string()),
    ("created", pa.float64()), ("ended", pa.float64()),
    ("prompt_token_ids", pa.list_(pa.int32())), ("output_token_ids", pa.list_(pa.int32())),
    ("error_code", pa.string()), ("error_message", pa.string()), ("rest", pa.string()),
])
COLUMNS = tuple(name for name in SCHEMA.names if name != "rest")


class Archive:
    """The archive at an fsspec URL (s3://bucket/log, memory://x) or a directory path."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.root = self.root.rstrip("/") or "/"
        self.local = isinstance(self.fs, LocalFileSystem)

    def write(self, records: list[Completion]) -> list[str]:
        """One new Parquet file per (tenant, hour of created) of the records; the paths written. On a
        local disk the files and their directories are on the disk when it returns."""
        groups = defaultdict(list)
        for rec in records:
            groups[subjects.token("tenant", rec.tenant), hour(rec.created)].append(rec)
        return [self.put(self.folder(tenant, h), sorted(recs, key=lambda r: r.created))
                for (tenant, h), recs in groups.items()]

    def read(self, since: float | None = None, until: float | None = None, tenant: str | None = None,
             request_id: str | None = None) -> list[Completion]:
        """The archived records created in [since, until), of one tenant or all, or the one of a request
        id, once each, by created. Only the hour partitions that overlap the window (and the tenant's) are
        opened; a request id alone opens every file."""
        found = {}
        for path in self.files(since, until, tenant):
            for rec in self.load(path, since, until, request_id):
                found.setdefault(rec.id, rec)
        return sorted(found.values(), key=lambda r: (r.created, r.id))

    def prune(self, max_age: float, now: float | None = None) -> int:
        """Removes the hour partitions that ended more than max_age seconds before now, and tenant
        directories left empty; the number of files removed."""
        cutoff = (time.time() if now is None else now) - max_age
        removed = 0
        for tenant_dir in self.tenant_dirs(None):
            for hour_dir, start in self.hour_dirs(tenant_dir):
                if start + HOUR_S <= cutoff:
                    removed += len(self.fs.find(hour_dir))
                    self.fs.rm(hour_dir, recursive=True)
            if not self.ls(tenant_dir):
                with contextlib.suppress(OSError):   # a writer made an hour in it meanwhile: it stays
                    self.fs.rmdir(tenant_dir)
        return removed

    # -- writing

    def folder(self, tenant: str, h: str) -> str:
        return posixpath.join(self.root, f"tenant={tenant}", f"hour={h}")

    def put(self, folder: str, records: list[Completion]) -> str:
        new = not self.fs.exists(folder)
        self.fs.makedirs(folder, exist_ok=True)
        name = f"{time.time_ns() // 1000}-{secrets.token_hex(8)}{SUFFIX}"
        path, tmp = posixpath.join(folder, name), posixpath.join(folder, f".{name}.tmp")
        with self.fs.open(tmp, "wb") as f:
            f.write(parquet(records))
            if self.local:
                f.flush()
                os.fsync(f.fileno())
        self.fs.mv(tmp, path)
        if self.local:                               # the rename, and the directories if they are new
            for d in [folder, *([posixpath.dirname(folder), self.root] if new else [])]:
                fsync_dir(d)
        return path

    # -- reading

    def files(self, since: float | None, until: float | None, tenant: str | None):
        for tenant_dir in self.tenant_dirs(tenant):
            for hour_dir, start in self.hour_dirs(tenant_dir):
                if (since is None or start + HOUR_S > since) and (until is None or start < until):
                    yield from sorted(p for p in self.ls(hour_dir) if is_data(p))

    def tenant_dirs(self, tenant: str | None) -> list[str]:
        if tenant is not None:
            return [posixpath.join(self.root, f"tenant={subjects.token('tenant', tenant)}")]
        return [p for p in self.ls(self.root) if posixpath.basename(p).startswith("tenant=")]

    def hour_dirs(self, tenant_dir: str) -> list[tuple[str, float]]:
        """(path, start as unix time) of each hour partition of a tenant's."""
        out = []
        for p in self.ls(tenant_dir):
            start = hour_start(posixpath.basename(p))
            if start is not None:
                out.append((p, start))
        return out

    def ls(self, path: str) -> list[str]:
        """The paths in a directory; none when it is missing."""
        try:
            return [p.rstrip("/") for p in self.fs.ls(path, detail=False) if p.rstrip("/") != path]
        except FileNotFoundError:
            return []

    def load(self, path: str, since: float | None, until: float | None, request_id: str | None) -> list[Completion]:
        t = pq.read_table(pa.BufferReader(self.fs.cat_file(path)), schema=SCHEMA)   # not a Python file: arrow#33975
        if since is not None:
            t = t.filter(pc.greater_equal(t["created"], since))
        if until is not None:
            t = t.filter(pc.less(t["created"], until))
        if request_id is not None:
            t = t.filter(pc.equal(t["id"], request_id))
        return [completion(row) for row in t.to_pylist()]


def parquet(records: list[Completion]) -> bytes:
    """The records as one Parquet file, built in memory (pyarrow's threads never hold a Python file)."""
    out = pa.BufferOutputStream()
    pq.write_table(table(records), out, compression="zstd", compression_level=ZSTD_LEVEL,
                   use_dictionary=DICTIONARY)
    return out.getvalue().to_pybytes()


def table(records: list[Completion]) -> pa.Table:
    objs = [to_obj(rec) for rec in records]
    cols = {name: [o[name] for o in objs] for name in COLUMNS}
    cols["rest"] = [orjson.dumps({k: o[k] for k in REST}).decode() for o in objs]
    return pa.Table.from_pydict(cols, schema=SCHEMA)


def completion(row: dict) -> Completion:
    rest = orjson.loads(row.pop("rest"))
    return from_obj({"t": Completion.TYPE, "v": VERSION, **row, **rest}, Completion)


def hour(created: float) -> str:
    return dt.datetime.fromtimestamp(created, dt.UTC).strftime(HOUR)


def hour_start(name: str) -> float | None:
    """The unix time an `hour=YYYY-MM-DDTHH` directory starts; None for another name."""
    if not name.startswith("hour="):
        return None
    try:
        return dt.datetime.strptime(name[5:], HOUR).replace(tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def is_data(path: str) -> bool:
    name = posixpath.basename(path)
    return name.endswith(SUFFIX) and not name.startswith(".")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
