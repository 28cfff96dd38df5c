"""The job store's database, chosen by URL: the embedded SQLite file (one server) or PostgreSQL (a fleet).

Invariants:
- One SQL text serves both engines: statements are written with ``?`` placeholders (PostgreSQL's driver gets
  ``%s``), and what differs is a property of the :class:`Database` (``now`` the database's clock in epoch seconds,
  ``skip_locked`` the row-lock clause of a claim). Lease times are the database's clock, never a node's, so that
  nodes with skewed clocks agree on when a lease runs out.
- The schema is versioned: ``schema_version`` holds the number of migrations applied, and :func:`migrate` applies
  the rest in order, each in one transaction, under a lock that makes servers starting together apply each once
  (SQLite's ``BEGIN IMMEDIATE``; PostgreSQL's transaction-scoped advisory lock). A database written before the
  versions (the SQLite file of earlier releases) is version 1 once its columns are brought up to that version.
- Callers serialise use of one :class:`Database` (the job store's lock); a transaction is :meth:`Database.transaction`,
  nested ones join the outer one.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from server.outputs.store import StoreUnavailable

__all__ = ["Database", "open_database", "SCHEMA_VERSION", "StoreUnavailable"]

_V1_COLUMNS = """
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    model TEXT NOT NULL,
    request TEXT NOT NULL,
    error_code TEXT,
    error_message TEXT,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    deleting INTEGER NOT NULL DEFAULT 0,
    "window" INTEGER,
    windows INTEGER,
    attempts INTEGER NOT NULL DEFAULT 0,
    lead_frames INTEGER NOT NULL DEFAULT 0,
    steps_computed INTEGER,
    steps_skipped INTEGER"""
# Columns that releases before the schema versions added on open (a file may lack any of them).
_LEGACY_COLUMNS = {"window": "INTEGER", "windows": "INTEGER", "attempts": "INTEGER NOT NULL DEFAULT 0",
                   "lead_frames": "INTEGER NOT NULL DEFAULT 0", "steps_computed": "INTEGER", "steps_skipped": "INTEGER"}

# Migration i (from 1) brings the schema from version i - 1 to i; (SQLite's statements, PostgreSQL's).
_V2 = ["ALTER TABLE jobs ADD COLUMN lease_until {real}",
       "ALTER TABLE jobs ADD COLUMN pinned_node TEXT",
       "ALTER TABLE jobs ADD COLUMN output_attempt INTEGER",
       "ALTER TABLE jobs ADD COLUMN checkpoint_attempt INTEGER"]
# Tenants (``server.group.tenants``): each job's owner ('' where the server is open), when its attempt started (its
# rank-seconds), the API keys (hashed), each tenant's last turn in the queue, its request bucket and its usage by day.
_V3 = ["ALTER TABLE jobs ADD COLUMN tenant TEXT NOT NULL DEFAULT ''",
       "ALTER TABLE jobs ADD COLUMN started_at {real}",
       "CREATE INDEX IF NOT EXISTS jobs_tenant ON jobs(tenant, status)",
       "CREATE TABLE api_keys (name TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL, role TEXT NOT NULL, "
       "max_jobs INTEGER, rpm INTEGER, seconds_per_day {real}, created_at BIGINT NOT NULL, revoked_at BIGINT)",
       "CREATE TABLE tenant_turns (tenant TEXT PRIMARY KEY, last_turn {real} NOT NULL)",
       "CREATE TABLE rate_buckets (tenant TEXT PRIMARY KEY, tokens {real} NOT NULL, updated_at {real} NOT NULL)",
       "CREATE TABLE tenant_usage (tenant TEXT NOT NULL, day BIGINT NOT NULL, submitted INTEGER NOT NULL DEFAULT 0, "
       "completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0, cancelled INTEGER NOT NULL DEFAULT 0, "
       "requested_seconds {real} NOT NULL DEFAULT 0, video_seconds {real} NOT NULL DEFAULT 0, "
       "rank_seconds {real} NOT NULL DEFAULT 0, PRIMARY KEY (tenant, day))"]
_MIGRATIONS: list[tuple[list[str], list[str]]] = [
    ([f"CREATE TABLE IF NOT EXISTS jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL,"
      f"{_V1_COLUMNS})", "CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq)"],
     [f"CREATE TABLE IF NOT EXISTS jobs (seq BIGSERIAL PRIMARY KEY, id TEXT UNIQUE NOT NULL,{_V1_COLUMNS})",
      "CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status, seq)"]),
    ([s.format(real="REAL") for s in _V2], [s.format(real="DOUBLE PRECISION") for s in _V2]),
    ([s.format(real="REAL") for s in _V3], [s.format(real="DOUBLE PRECISION") for s in _V3]),
    # A live video's directions (JSON: server.group.job_record.Live), NULL for any other job.
    (["ALTER TABLE jobs ADD COLUMN live TEXT"], ["ALTER TABLE jobs ADD COLUMN live TEXT"]),
]
SCHEMA_VERSION = len(_MIGRATIONS)


class Database:
    """One connection to the job store's database (see the module docstring)."""

    shared: bool
    """Whether other servers may use the same database (leases then decide who runs what)."""
    now: str
    """SQL for the database's clock, in seconds since the epoch."""
    skip_locked: str
    """The clause a claim's ``SELECT`` ends with, so that concurrent claims take different rows."""
    lock_row: str
    """The clause a ``SELECT`` inside a transaction ends with to hold its rows until the commit (serialising
    read-check-write across servers; SQLite's ``BEGIN IMMEDIATE`` already serialises every writer)."""
    name: str
    """What ``/ready`` and errors call it (no credentials)."""

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        raise NotImplementedError

    def execute_lazy(self, sql: str, params: Sequence[Any] = ()) -> Any:
        """``execute`` for a write whose loss in a crash of the database harms nothing (a running job's progress:
        the next write carries it again): committed without waiting for the disk where the engine can."""
        return self.execute(sql, params)

    def _begin(self) -> None:
        raise NotImplementedError

    def _end(self, commit: bool) -> None:
        self.execute("COMMIT" if commit else "ROLLBACK")

    def close(self) -> None:
        raise NotImplementedError

    _depth = 0

    @property
    def in_transaction(self) -> bool:
        return self._depth > 0

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._begin()
        self._depth = 1
        try:
            yield
        except BaseException:
            self._depth = 0
            with contextlib.suppress(Exception):
                self._end(commit=False)
            raise
        self._depth = 0
        self._end(commit=True)


class _SQLite(Database):
    shared = False
    now = "((julianday('now') - 2440587.5) * 86400.0)"
    skip_locked = ""  # one server, one connection: its claims are already serialised
    lock_row = ""

    def __init__(self, path: Path):
        self.name = "job store (SQLite)"
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        return self._db.execute(sql, tuple(params))

    def _begin(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def close(self) -> None:
        self._db.close()

    def _version(self) -> int:
        self.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = self.execute("SELECT version FROM schema_version").fetchone()
        if row is not None:
            return row["version"]
        if self.execute("SELECT name FROM sqlite_master WHERE name = 'jobs'").fetchone() is None:
            return 0
        # A file of a release before the versions: its columns brought up to version 1.
        have = {r["name"] for r in self.execute("PRAGMA table_info(jobs)")}
        for name, kind in _LEGACY_COLUMNS.items():
            if name not in have:
                self.execute(f'ALTER TABLE jobs ADD COLUMN "{name}" {kind}')
        return 1


class _Postgres(Database):
    shared = True
    now = "extract(epoch from clock_timestamp())::double precision"
    skip_locked = " FOR UPDATE SKIP LOCKED"
    lock_row = " FOR UPDATE"

    def __init__(self, url: str):
        try:
            import psycopg
            from psycopg.rows import dict_row
        except ImportError:
            raise ValueError("--job-store postgresql://... needs psycopg 3: pip install 'cp-infer[fleet]'") from None

        self._psycopg = psycopg
        info = psycopg.conninfo.conninfo_to_dict(url)
        self.name = f"job store (PostgreSQL at {info.get('host', 'localhost')}:{info.get('port', 5432)}/" \
                    f"{info.get('dbname', '')})"
        self._url = url
        self._connect = lambda: psycopg.connect(url, autocommit=True, row_factory=dict_row, connect_timeout=5)
        try:
            self._conn = self._connect()
        except psycopg.OperationalError as exc:
            raise StoreUnavailable(self.name, str(exc).strip()) from None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        psycopg = self._psycopg
        try:
            if self._conn.closed and not self._depth:
                self._conn = self._connect()
            return self._conn.execute(sql.replace("?", "%s"), tuple(params))
        except psycopg.OperationalError as exc:
            if not self._conn.closed:
                with contextlib.suppress(Exception):
                    self._conn.close()
            raise StoreUnavailable(self.name, str(exc).strip()) from None

    def execute_lazy(self, sql: str, params: Sequence[Any] = ()) -> Any:
        # NOTE(fsync): each autocommitted write waits for its WAL flush (~ms on a disk); a running job's progress
        # writes, one a step, need not. The four statements go in one pipeline: one round trip, not four.
        if self._depth:
            return self.execute(sql, params)  # joins the transaction in progress, as it is
        psycopg = self._psycopg
        try:
            if self._conn.closed:
                self._conn = self._connect()
            with self._conn.pipeline():
                self._conn.execute("BEGIN")
                self._conn.execute("SET LOCAL synchronous_commit TO off")
                cur = self._conn.execute(sql.replace("?", "%s"), tuple(params))
                self._conn.execute("COMMIT")
            return cur
        except psycopg.OperationalError as exc:
            if not self._conn.closed:
                with contextlib.suppress(Exception):
                    self._conn.close()
            raise StoreUnavailable(self.name, str(exc).strip()) from None

    def _begin(self) -> None:
        self.execute("BEGIN")

    def close(self) -> None:
        self._conn.close()

    def _version(self) -> int:
        self.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = self.execute("SELECT version FROM schema_version").fetchone()
        return 0 if row is None else row["version"]


def migrate(db: Database) -> int:
    """Apply the migrations the database lacks; returns the version it is at now."""
    engine = 1 if isinstance(db, _Postgres) else 0
    while True:
        with db.transaction():
            if isinstance(db, _Postgres):
                db.execute("SELECT pg_advisory_xact_lock(7283541)")  # servers starting together: one migrates
            version = db._version()
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"the job store's schema is version {version}, newer than this release's "
                                   f"{SCHEMA_VERSION}: upgrade this server")
            if version == SCHEMA_VERSION:
                return version
            for statement in _MIGRATIONS[version][engine]:
                db.execute(statement)
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (version + 1,))


def open_database(url: str | None, data_dir: Path) -> Database:
    """``None`` or ``sqlite:///path``: the embedded file (default ``<data_dir>/jobs.sqlite3``);
    ``postgresql://...``: a server shared by a fleet. The schema is migrated to this release's version."""
    if url is None or url == "sqlite://":
        db: Database = _SQLite(data_dir / "jobs.sqlite3")
    elif url.startswith("sqlite:///"):
        db = _SQLite(Path(url[len("sqlite:///"):]))
    elif url.startswith(("postgresql://", "postgres://")):
        db = _Postgres(url)
    else:
        raise ValueError(f"--job-store {url.split('://')[0]}://... is not a job store; use sqlite:///PATH "
                         "or postgresql://USER@HOST/DB")
    migrate(db)
    return db
