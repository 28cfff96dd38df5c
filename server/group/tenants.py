"""Tenants: the API keys that own jobs, their limits, their request buckets and their usage, in the job store's
database (``server.group.database``: SQLite or PostgreSQL), so that every server of a fleet sees the same.

Invariants:
- A key is ``cpk_`` + 43 URL-safe characters (256 random bits), shown once when made; the database holds only its
  SHA-256. A slow password hash (bcrypt, argon2) guards low-entropy secrets against guessing; a 256-bit random key
  cannot be guessed, and a slow hash would cost every request. A presented key is looked up by its digest and the
  stored digest compared with ``hmac.compare_digest``; neither the key nor its digest is ever logged or returned.
- A lookup's answer (a tenant, or none) is cached for ``KEY_TTL_S`` at most, so a revoke or a changed limit
  (``cp-infer keys``, on any server's database) holds on every server within that time.
- A tenant's name is its jobs' ``tenant``; the server's ``--api-key`` is the admin tenant ``admin`` (a name no key
  may take), and an open server's jobs (no key at all) belong to ``''``.
- The request bucket (``rpm``) is a token bucket of ``rpm`` tokens refilled at ``rpm`` a minute, kept in the
  database and updated in one transaction on the database's clock, so a fleet shares one bucket per tenant.
- Usage is a ledger by tenant and UTC day: jobs submitted and ended by status, seconds of video asked for (what
  ``seconds_per_day`` limits; charged when a job is queued, not refunded), seconds of video made, and rank-seconds
  (a completed attempt's time from its claim to its end, times its replica's ranks). Deleting a job deletes no usage.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from server.group.database import Database, StoreUnavailable

__all__ = ["ADMIN", "OPEN", "KEY_TTL_S", "Tenant", "TenantLimit", "Tenants", "hash_key"]

KEY_TTL_S = 0.5
"""How long a server trusts its cached answer for a key (a revoke holds everywhere within this)."""
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
_ROLES = ("user", "admin")
_DAY_S = 86400


@dataclass(frozen=True)
class Tenant:
    """Who a request is from: a key's tenant, or the server's own (``ADMIN``: ``--api-key``; ``OPEN``: no keys)."""

    name: str
    admin: bool = False
    max_jobs: int | None = None
    """Jobs queued and running at once; ``None``: no limit of its own (the server's queue limit still holds)."""
    rpm: int | None = None
    """Requests a minute (a token bucket of this many)."""
    seconds_per_day: float | None = None
    """Seconds of video asked for per UTC day."""

    def sees(self, job_tenant: str) -> bool:
        """Whether a job of ``job_tenant`` is this tenant's to see and manage (an admin's: every job)."""
        return self.admin or job_tenant == self.name


OPEN = Tenant("", admin=True)
ADMIN = Tenant("admin", admin=True)
NOBODY = Tenant("(no key)")
"""A caller without a valid key where a route answers anyone (``/ready``, a probe): it sees no job (its name is no
tenant's: ``check_name`` refuses it)."""


class TenantLimit(Exception):
    """A request over one of its tenant's limits: ``limit`` (its name), ``value``, and seconds to wait."""

    def __init__(self, limit: str, value: float, retry_after_s: int, message: str):
        super().__init__(message)
        self.limit, self.value, self.retry_after_s = limit, value, max(1, retry_after_s)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"tenant name {name!r}: use 1-63 of a-z 0-9 _ . - (starting with a letter or digit)")
    if name == ADMIN.name:
        raise ValueError(f"tenant name {name!r} is the server's --api-key; choose another name")
    return name


def _positive(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"--{name.replace('_', '-')} {value}: must be > 0 (or none: no limit)")


def _row_tenant(row: Any) -> Tenant:
    return Tenant(row["name"], admin=row["role"] == "admin", max_jobs=row["max_jobs"], rpm=row["rpm"],
                  seconds_per_day=row["seconds_per_day"])


class Tenants:
    """Keys, limits and usage over a :class:`Database`; ``lock``: the lock its callers share for that connection
    (the job store's). Thread-safe."""

    def __init__(self, db: Database, lock: threading.Lock | None = None):
        self._db = db
        self._lock = lock or threading.Lock()
        self._cache: dict[str, tuple[float, Tenant | None]] = {}
        self._any: tuple[float, bool] = (0.0, False)

    # -- keys (``cp-infer keys``) ------------------------------------------------------------------------------
    def add(self, name: str, *, role: str = "user", max_jobs: int | None = None, rpm: int | None = None,
            seconds_per_day: float | None = None) -> str:
        """A new key for tenant ``name`` (a revoked tenant's name gets a new key and keeps its jobs); returns the
        key, which is not kept."""
        check_name(name)
        if role not in _ROLES:
            raise ValueError(f"--role {role}: use one of {list(_ROLES)}")
        for limit, value in (("max_jobs", max_jobs), ("rpm", rpm), ("seconds_per_day", seconds_per_day)):
            _positive(limit, value)
        key = "cpk_" + secrets.token_urlsafe(32)
        with self._lock, self._db.transaction():
            row = self._db.execute(f"SELECT revoked_at FROM api_keys WHERE name = ?{self._db.lock_row}",
                                   (name,)).fetchone()
            if row is not None and row["revoked_at"] is None:
                raise ValueError(f"tenant {name!r} already has a key; revoke it first (cp-infer keys revoke {name})")
            self._db.execute("DELETE FROM api_keys WHERE name = ?", (name,))
            self._db.execute("INSERT INTO api_keys (name, key_hash, role, max_jobs, rpm, seconds_per_day, created_at)"
                             " VALUES (?, ?, ?, ?, ?, ?, ?)",
                             (name, hash_key(key), role, max_jobs, rpm, seconds_per_day, int(time.time())))
        return key

    def set(self, name: str, **changes: Any) -> None:
        """Change a tenant's ``role`` or limits (``None`` as a limit's value: no limit)."""
        allowed = {"role", "max_jobs", "rpm", "seconds_per_day"}
        assert set(changes) <= allowed, changes
        if "role" in changes and changes["role"] not in _ROLES:
            raise ValueError(f"--role {changes['role']}: use one of {list(_ROLES)}")
        for limit in allowed - {"role"}:
            _positive(limit, changes.get(limit))
        if not changes:
            raise ValueError("nothing to set: give --role, --max-jobs, --rpm or --seconds-per-day")
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self._lock:
            if not self._db.execute(f"UPDATE api_keys SET {sets} WHERE name = ?",
                                    (*changes.values(), name)).rowcount:
                raise ValueError(f"no tenant {name!r}; see cp-infer keys list")

    def revoke(self, name: str) -> None:
        with self._lock:
            if not self._db.execute("UPDATE api_keys SET revoked_at = ? WHERE name = ? AND revoked_at IS NULL",
                                    (int(time.time()), name)).rowcount:
                raise ValueError(f"no tenant {name!r} with a live key; see cp-infer keys list")

    def list(self) -> list[dict[str, Any]]:
        """Every tenant's key record, without its digest."""
        with self._lock:
            rows = self._db.execute("SELECT name, role, max_jobs, rpm, seconds_per_day, created_at, revoked_at "
                                    "FROM api_keys ORDER BY name").fetchall()
        return [dict(row) for row in rows]

    # -- the server's side -------------------------------------------------------------------------------------
    def any_keys(self) -> bool:
        """Whether any key was ever made (then every request needs one); cached for ``KEY_TTL_S``. Raises
        ``StoreUnavailable`` when the database does not answer and the last answer was yes."""
        expires, found = self._any
        if time.monotonic() < expires:
            return found
        try:
            with self._lock:
                found = self._db.execute("SELECT 1 AS one FROM api_keys LIMIT 1").fetchone() is not None
        except StoreUnavailable:
            # The last answer holds while the database is away: an open server's routes (``/ready``) still answer
            # for themselves, naming the store; a keyed server's cannot authenticate anyone (503).
            if found:
                raise
            return found
        self._any = (time.monotonic() + KEY_TTL_S, found)
        return found

    def authenticate(self, key: str) -> Tenant | None:
        """The tenant whose live key ``key`` is; ``None`` for a wrong or revoked key."""
        digest = hash_key(key)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and now < hit[0]:
            return hit[1]
        with self._lock:
            row = self._db.execute("SELECT * FROM api_keys WHERE key_hash = ?", (digest,)).fetchone()
        tenant = None
        if row is not None and hmac.compare_digest(row["key_hash"], digest) and row["revoked_at"] is None:
            tenant = _row_tenant(row)
        if len(self._cache) > 4096:  # wrong keys must not grow it without bound
            self._cache.clear()
        self._cache[digest] = (now + KEY_TTL_S, tenant)
        return tenant

    def take_request(self, tenant: Tenant) -> None:
        """Take one token of ``tenant``'s request bucket, or raise :class:`TenantLimit` (``rpm``)."""
        rpm = tenant.rpm
        if rpm is None:
            return
        db = self._db
        with self._lock, db.transaction():
            db.execute(f"INSERT INTO rate_buckets (tenant, tokens, updated_at) VALUES (?, ?, {db.now}) "
                       "ON CONFLICT (tenant) DO NOTHING", (tenant.name, float(rpm)))
            row = db.execute(f"SELECT tokens, updated_at, {db.now} AS now FROM rate_buckets WHERE tenant = ?"
                             f"{db.lock_row}", (tenant.name,)).fetchone()
            tokens = min(float(rpm), row["tokens"] + max(0.0, row["now"] - row["updated_at"]) * rpm / 60.0)
            took = tokens >= 1.0
            if took:
                tokens -= 1.0
            db.execute("UPDATE rate_buckets SET tokens = ?, updated_at = ? WHERE tenant = ?",
                       (tokens, row["now"], tenant.name))
        if not took:
            wait = math.ceil((1.0 - tokens) * 60.0 / rpm)
            raise TenantLimit("rpm", rpm, wait, f"rpm={rpm}: tenant {tenant.name!r} sent more than {rpm} requests "
                              f"in a minute; retry after {wait} s")

    # -- the job store's side (its lock held, inside its transaction) ------------------------------------------
    def _today(self) -> tuple[int, float]:
        now = float(self._db.execute(f"SELECT {self._db.now} AS now").fetchone()["now"])
        return int(now // _DAY_S), now

    def _charge(self, tenant: str, day: int, **amounts: float) -> None:
        names = ", ".join(amounts)
        adds = ", ".join(f"{k} = tenant_usage.{k} + excluded.{k}" for k in amounts)
        self._db.execute(f"INSERT INTO tenant_usage (tenant, day, {names}) VALUES (?, ?{', ?' * len(amounts)}) "
                         f"ON CONFLICT (tenant, day) DO UPDATE SET {adds}", (tenant, day, *amounts.values()))

    def admit_locked(self, tenant: Tenant, seconds: float) -> None:
        """Check a new job of ``seconds`` against ``tenant``'s limits and charge it (raises :class:`TenantLimit`).
        The caller holds the store's lock inside a transaction, which the tenant's key row is locked in (so two
        servers admitting the same tenant's jobs take turns)."""
        db = self._db
        if tenant.max_jobs is not None or tenant.seconds_per_day is not None:
            db.execute(f"SELECT name FROM api_keys WHERE name = ?{db.lock_row}", (tenant.name,)).fetchone()
        if tenant.max_jobs is not None:
            active = db.execute("SELECT COUNT(*) AS n FROM jobs WHERE tenant = ? AND deleting = 0 AND status IN "
                                "('queued', 'in_progress')", (tenant.name,)).fetchone()["n"]
            if active >= tenant.max_jobs:
                raise TenantLimit("max_jobs", tenant.max_jobs, 30, f"max_jobs={tenant.max_jobs}: tenant "
                                  f"{tenant.name!r} has {active} jobs queued or running; retry once one has ended")
        day, now = self._today()
        if tenant.seconds_per_day is not None:
            row = db.execute("SELECT requested_seconds FROM tenant_usage WHERE tenant = ? AND day = ?",
                             (tenant.name, day)).fetchone()
            used = 0.0 if row is None else float(row["requested_seconds"])
            if used + seconds > tenant.seconds_per_day + 1e-9:
                wait = math.ceil((day + 1) * _DAY_S - now)
                raise TenantLimit("seconds_per_day", tenant.seconds_per_day, wait,
                                  f"seconds_per_day={tenant.seconds_per_day:g}: tenant {tenant.name!r} has asked for "
                                  f"{used:.3g} s of video today (UTC) and this job is {seconds:.3g} s more; retry "
                                  f"after {wait} s (at 00:00 UTC)")
        self._charge(tenant.name, day, submitted=1, requested_seconds=float(seconds))

    def record_end_locked(self, tenant: str, status: str, *, video_seconds: float, rank_seconds: float) -> None:
        """A job of ``tenant`` ended ``status`` (completed: with the seconds it made and its rank-seconds)."""
        day, _ = self._today()
        if status == "completed":
            self._charge(tenant, day, completed=1, video_seconds=video_seconds, rank_seconds=rank_seconds)
        else:
            self._charge(tenant, day, **{status: 1})

    def take_turn_locked(self, tenant: str) -> None:
        """``tenant``'s job was just claimed: its turn in the queue is now (see ``JobStore.claim_next``)."""
        # A counter, not a clock: claims within one tick of the clock must still take turns in order.
        self._db.execute("INSERT INTO tenant_turns (tenant, last_turn) VALUES (?, (SELECT COALESCE(MAX(last_turn), 0) "
                         "+ 1 FROM tenant_turns)) ON CONFLICT (tenant) DO UPDATE SET last_turn = excluded.last_turn",
                         (tenant,))

    # -- usage -------------------------------------------------------------------------------------------------
    def usage(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Each tenant's usage (one, given ``tenant``): its jobs now by status, and the ledger's totals and today's
        seconds asked for."""
        where, args = ("WHERE tenant = ?", (tenant,)) if tenant is not None else ("", ())
        with self._lock:
            day, _ = self._today()
            totals = self._db.execute(
                "SELECT tenant, SUM(submitted) AS submitted, SUM(completed) AS completed, SUM(failed) AS failed, "
                "SUM(cancelled) AS cancelled, SUM(video_seconds) AS video_seconds, SUM(rank_seconds) AS "
                f"rank_seconds, SUM(CASE WHEN day = ? THEN requested_seconds ELSE 0 END) AS today FROM tenant_usage "
                f"{where} GROUP BY tenant", (day, *args)).fetchall()
            jobs = self._db.execute(f"SELECT tenant, status, COUNT(*) AS n FROM jobs {where}"
                                    f"{' AND' if where else ' WHERE'} deleting = 0 GROUP BY tenant, status",
                                    args).fetchall()
        out: dict[str, dict[str, Any]] = {}

        def entry(name: str) -> dict[str, Any]:
            return out.setdefault(name, {
                "tenant": name, "jobs": {s: 0 for s in ("queued", "in_progress", "completed", "failed", "cancelled")},
                "jobs_submitted": 0, "jobs_ended": {"completed": 0, "failed": 0, "cancelled": 0},
                "video_seconds": 0.0, "rank_seconds": 0.0, "requested_seconds_today": 0.0})

        if tenant is not None:
            entry(tenant)
        for row in totals:
            e = entry(row["tenant"])
            e["jobs_submitted"] = int(row["submitted"] or 0)
            e["jobs_ended"] = {s: int(row[s] or 0) for s in ("completed", "failed", "cancelled")}
            e["video_seconds"] = round(float(row["video_seconds"] or 0), 3)
            e["rank_seconds"] = round(float(row["rank_seconds"] or 0), 3)
            e["requested_seconds_today"] = round(float(row["today"] or 0), 3)
        for row in jobs:
            entry(row["tenant"])["jobs"][row["status"]] = int(row["n"])
        return [out[name] for name in sorted(out)]

