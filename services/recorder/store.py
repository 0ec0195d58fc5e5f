"""The recorder's database: a usage row and a request row per request id, in PostgreSQL (psycopg 3; a
`postgresql://` URL) or SQLite (a `sqlite:///path` URL or a plain path: the local stack's default, a file
under its data dir). One schema for both, made by the SQL files in migrations/, applied in order and each
once (table schema_migrations), from an empty database on first use.

write() is one transaction of upserts keyed by request id that keep the row stored first: a record
delivered again (a crash between the commit and the bus ack) changes nothing. Calls are blocking (the
recorder runs them in a thread); one connection, made again after it breaks (a database restart)."""
import contextlib
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from schemas.messages import Completion, Usage

MIGRATIONS = Path(__file__).parent / "migrations"
USAGE_COLUMNS = ("request_id", "tenant", "key_id", "model", "revision", "fallback", "api", "finish_reason",
                 "prompt_tokens", "cached_tokens", "completion_tokens", "created", "finished", "timing", "recorded")
REQUEST_COLUMNS = ("request_id", "tenant", "worker", "finish_reason", "prompt_tokens", "output_tokens",
                   "error_code", "created", "ended", "recorded")
TYPES = {"usage": ("text",) * 5 + ("bool", "text", "text", "int8", "int8", "int8", "float8", "float8", "text",
                                   "float8"),
         "requests": ("text",) * 4 + ("int8", "int8", "text", "float8", "float8", "float8")}
GROUP = ("tenant", "key_id", "model", "revision", "fallback")
MIGRATION_LOCK = 7_361_207               # PostgreSQL advisory lock: one recorder migrates at a time


def usage_row(u: Usage, now: float) -> tuple:
    return (u.id, u.tenant, u.key_id, u.model, u.revision, u.fallback, u.api, u.finish_reason, u.prompt_tokens,
            u.cached_tokens, u.completion_tokens, u.created, u.finished, orjson.dumps(u.timing).decode(), now)


def request_row(c: Completion, now: float) -> tuple:
    return (c.id, c.tenant, c.worker, c.finish_reason, len(c.prompt_token_ids), len(c.output_token_ids),
            c.error_code, c.created, c.ended, now)


def from_row(row) -> Usage:
    (rid, tenant, key_id, model, revision, fallback, api, finish_reason, prompt, cached, completion, created,
     finished, timing, _) = row
    return Usage(rid, tenant, key_id, model, api, finish_reason, int(prompt), int(cached), int(completion),
                 orjson.loads(timing), created, finished, revision, bool(fallback))


@dataclass(slots=True)
class Window:
    """Which usage rows: one tenant's (all: None), finished (metered) in [since, until) (unbounded: None)."""
    tenant: str | None = None
    since: float | None = None
    until: float | None = None

    def where(self, mark: str) -> tuple[str, list]:
        terms, args = [], []
        for column, op, value in (("tenant", "=", self.tenant), ("finished", ">=", self.since),
                                  ("finished", "<", self.until)):
            if value is not None:
                terms.append(f"{column} {op} {mark}")
                args.append(value)
        return (" WHERE " + " AND ".join(terms)) if terms else "", args


class Database:
    """A recorder's database, PostgreSQL or SQLite by its URL (open())."""
    mark = "?"

    def __init__(self, url: str):
        self.url, self.conn, self.lock = url, None, threading.Lock()

    @staticmethod
    def open(url: str) -> "Database":
        """The database at `url`; ValueError naming the URL for a scheme that is neither."""
        if url.startswith(("postgresql://", "postgres://")):
            return Postgres(url)
        if "://" in url and not url.startswith("sqlite://"):
            raise ValueError(f"--database {url!r}: expected postgresql://… or sqlite:///path (or a path)")
        return Sqlite(url)

    def connection(self):
        if self.conn is None:
            self.conn = self.connect()
            self.migrate(self.conn)
        return self.conn

    def run(self, fn):
        """fn(connection) under the lock; a broken connection is dropped (the next call connects again)."""
        with self.lock:
            conn = self.connection()
            try:
                return fn(conn)
            except Exception:
                self.drop()
                raise

    def drop(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(Exception):       # already broken
                self.conn.close()
            self.conn = None

    def close(self) -> None:
        with self.lock:
            self.drop()

    def migrations(self) -> list[tuple[int, str]]:
        return sorted((int(p.name.split("_", 1)[0]), p.read_text()) for p in MIGRATIONS.glob("*.sql"))

    def version(self) -> int:
        """The schema's version: the last migration applied (0: an empty database)."""
        return self.run(lambda conn: self.applied(conn.cursor()))

    @staticmethod
    def applied(cur) -> int:
        cur.execute("SELECT max(version) FROM schema_migrations")
        return cur.fetchone()[0] or 0

    @staticmethod
    def refused(e: Exception) -> bool:
        """The database answered and refused these rows (a value it cannot store), rather than being away: the
        same rows would be refused again."""
        import psycopg

        return isinstance(e, (sqlite3.IntegrityError, sqlite3.DataError, sqlite3.InterfaceError, psycopg.DataError,
                              psycopg.IntegrityError, ValueError, TypeError))

    def write(self, usage: list[Usage], completions: list[Completion]) -> tuple[int, int]:
        """Upserts the records in one transaction (a request id already stored keeps its row); the rows new."""
        now = time.time()
        return self.run(lambda conn: self.upsert(conn, [usage_row(u, now) for u in usage],
                                                 [request_row(c, now) for c in completions]))

    def sums(self, window: Window) -> list[dict]:
        """One row per (tenant, key_id, model, revision, fallback): requests and token sums."""
        where, args = window.where(self.mark)
        query = (f"SELECT {', '.join(GROUP)}, count(*), sum(prompt_tokens), sum(cached_tokens), "
                 f"sum(completion_tokens) FROM usage{where} GROUP BY {', '.join(GROUP)}")
        names = (*GROUP, "requests", "prompt_tokens", "cached_tokens", "completion_tokens")
        rows = self.run(lambda conn: self.fetch(conn, query, args))
        return [{**dict(zip(names, r[:4])), "fallback": bool(r[4]), **{k: int(v) for k, v in zip(names[5:], r[5:])}}
                for r in rows]

    def usage(self, window: Window) -> list[Usage]:
        """Every usage row in the window, in the order finished."""
        where, args = window.where(self.mark)
        query = f"SELECT {', '.join(USAGE_COLUMNS)} FROM usage{where} ORDER BY finished, request_id"
        return [from_row(r) for r in self.run(lambda conn: self.fetch(conn, query, args))]

    def recorded(self, ids: list[str]) -> set[str]:
        """Which of the request ids have a usage row."""
        out = set()
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            query = f"SELECT request_id FROM usage WHERE request_id IN ({', '.join([self.mark] * len(chunk))})"
            out |= {r[0] for r in self.run(lambda conn, q=query, c=chunk: self.fetch(conn, q, c))}
        return out

    def count(self, table: str) -> int:
        return self.run(lambda conn: self.fetch(conn, f"SELECT count(*) FROM {table}", []))[0][0]

    @staticmethod
    def fetch(conn, query: str, args: list) -> list:
        return conn.execute(query, args).fetchall()        # both connections autocommit a lone statement


class Sqlite(Database):
    def __init__(self, url: str):
        super().__init__(url)
        self.path = Path(url.removeprefix("sqlite://"))         # sqlite:///abs/path, or a path

    def connect(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")              # a commit is on disk before the recorder acks
        return conn

    def migrate(self, conn) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                         "applied DOUBLE PRECISION NOT NULL)")
            have = self.applied(conn.cursor())
            for version, sql in self.migrations():
                if version > have:
                    for statement in filter(str.strip, strip_comments(sql).split(";")):
                        conn.execute(statement)
                    conn.execute("INSERT INTO schema_migrations VALUES (?, ?)", (version, time.time()))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def upsert(self, conn, usage: list[tuple], requests: list[tuple]) -> tuple[int, int]:
        conn.execute("BEGIN IMMEDIATE")
        try:
            new = [insert(conn, table, columns, rows, "?") for table, columns, rows in
                   (("usage", USAGE_COLUMNS, usage), ("requests", REQUEST_COLUMNS, requests))]
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        return new[0], new[1]


def insert(conn, table: str, columns: tuple, rows: list[tuple], mark: str) -> int:
    if not rows:
        return 0
    cur = conn.cursor()
    cur.executemany(f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join([mark] * len(columns))}) "
                    f"ON CONFLICT (request_id) DO NOTHING", rows)
    return cur.rowcount


class Postgres(Database):
    mark = "%s"

    def connect(self):
        import psycopg

        return psycopg.connect(self.url, connect_timeout=5, autocommit=True)    # transaction() blocks commit

    def migrate(self, conn) -> None:
        with conn.transaction():
            cur = conn.cursor()
            cur.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            cur.execute("CREATE TABLE IF NOT EXISTS schema_migrations (version INTEGER PRIMARY KEY, "
                        "applied DOUBLE PRECISION NOT NULL)")
            have = self.applied(cur)
            for version, sql in self.migrations():
                if version > have:
                    cur.execute(strip_comments(sql))
                    cur.execute("INSERT INTO schema_migrations VALUES (%s, %s)", (version, time.time()))

    def upsert(self, conn, usage: list[tuple], requests: list[tuple]) -> tuple[int, int]:
        """Each table's rows copied (binary COPY, one stream) into a temporary table of the session, then inserted
        from it: a batch is two round trips a table."""
        with conn.transaction():
            cur = conn.cursor()
            new = []
            for table, columns, rows in (("usage", USAGE_COLUMNS, usage), ("requests", REQUEST_COLUMNS, requests)):
                if not rows:
                    new.append(0)
                    continue
                cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS {table}_in (LIKE {table}) ON COMMIT DELETE ROWS")
                with cur.copy(f"COPY {table}_in ({', '.join(columns)}) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(TYPES[table])
                    for row in rows:
                        copy.write_row(row)
                cur.execute(f"INSERT INTO {table} SELECT * FROM {table}_in ON CONFLICT (request_id) DO NOTHING")
                new.append(cur.rowcount)
        return new[0], new[1]


def redacted(url: str) -> str:
    """A database URL without its password."""
    head, at, tail = url.rpartition("@")
    if not at or "://" not in head:
        return url
    scheme, _, cred = head.partition("://")
    return f"{scheme}://{cred.split(':', 1)[0]}@{tail}"


def strip_comments(sql: str) -> str:
    return "\n".join(line for line in sql.splitlines() if not line.lstrip().startswith("--"))
