"""``cp-infer keys``: make, list, change and revoke tenants' API keys in a job store (``server.group.tenants``).

Invariants:
- It opens the same job store as ``serve`` (``--data-dir`` / ``--job-store``, migrating it as ``serve`` would), so a
  running server sees every change within ``server.group.tenants.KEY_TTL_S``.
- A new key is printed once, on stdout, alone on its line (``KEY=$(cp-infer keys add NAME)``); nothing else ever
  prints a key, and the store keeps only its digest.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path

__all__ = ["add_keys_parser", "run_keys"]


def _limit(kind):
    def parse(text: str):
        if text.lower() == "none":
            return None
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0 or 'none'") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text} must be > 0 (or 'none': no limit)")
        return value

    return parse


_LIMITS = (("--max-jobs", int, "jobs queued and running at once"),
           ("--rpm", int, "requests a minute (a token bucket shared by the fleet)"),
           ("--seconds-per-day", float, "seconds of video asked for per UTC day"))


def _store_arguments(parser: argparse.ArgumentParser, data_dir, job_store) -> None:
    parser.add_argument("--data-dir", type=Path, default=data_dir,
                        help="as for serve: the folder of the embedded job store (default ./cp-infer-data)")
    parser.add_argument("--job-store", default=job_store, metavar="URL",
                        help="as for serve: postgresql://USER:PASS@HOST/DB (default $CP_INFER_JOB_STORE, else the "
                        "SQLite file in --data-dir)")


def add_keys_parser(commands) -> None:
    """The ``keys`` subcommand on the CLI's subparsers."""
    keys = commands.add_parser("keys", help="manage tenants' API keys (cp-infer keys --help)",
                               description="Tenants' API keys, kept (hashed) in the job store that serve uses.")
    _store_arguments(keys, Path("cp-infer-data"), os.environ.get("CP_INFER_JOB_STORE"))
    # The same flags after the action too (cp-infer keys add NAME --job-store URL), not resetting the ones before.
    store = argparse.ArgumentParser(add_help=False)
    _store_arguments(store, argparse.SUPPRESS, argparse.SUPPRESS)
    actions = keys.add_subparsers(dest="keys_action", required=True, metavar="{add,list,revoke,set}")
    add = actions.add_parser("add", parents=[store], help="make a tenant's key and print it (once)")
    add.add_argument("name", help="the tenant (1-63 of a-z 0-9 _ . -; 'admin' is --api-key's)")
    add.add_argument("--role", choices=("user", "admin"), default="user",
                     help="user: its own videos; admin: every tenant's (default user)")
    setter = actions.add_parser("set", parents=[store], help="change a tenant's role or limits")
    setter.add_argument("name")
    setter.add_argument("--role", choices=("user", "admin"))
    for flag, kind, what in _LIMITS:
        add.add_argument(flag, type=_limit(kind), help=f"{what} (default: no limit)")
        setter.add_argument(flag, type=_limit(kind), default=argparse.SUPPRESS,
                            help=f"{what}; 'none': no limit")
    actions.add_parser("list", parents=[store], help="every tenant: role, limits, when made and revoked (never a key)")
    revoke = actions.add_parser("revoke", parents=[store],
                                help="revoke a tenant's key (every server refuses it within a second)")
    revoke.add_argument("name")


def _when(stamp: int | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def run_keys(args: argparse.Namespace, _argv=None) -> int:
    from server.group.database import open_database
    from server.group.tenants import Tenants

    args.data_dir.mkdir(parents=True, exist_ok=True)
    db = open_database(args.job_store, args.data_dir)
    try:
        tenants = Tenants(db)
        if args.keys_action == "add":
            print(tenants.add(args.name, role=args.role, max_jobs=args.max_jobs, rpm=args.rpm,
                              seconds_per_day=args.seconds_per_day), flush=True)
        elif args.keys_action == "set":
            changes = {k: getattr(args, k) for k in ("max_jobs", "rpm", "seconds_per_day") if hasattr(args, k)}
            if args.role is not None:
                changes["role"] = args.role
            tenants.set(args.name, **changes)
        elif args.keys_action == "revoke":
            tenants.revoke(args.name)
        else:
            rows = tenants.list()
            print(f"{'NAME':<24} {'ROLE':<6} {'MAX-JOBS':>8} {'RPM':>6} {'SECONDS/DAY':>11}  {'CREATED':<20} REVOKED")
            for r in rows:
                def show(v):
                    return "-" if v is None else f"{v:g}"

                print(f"{r['name']:<24} {r['role']:<6} {show(r['max_jobs']):>8} {show(r['rpm']):>6} "
                      f"{show(r['seconds_per_day']):>11}  {_when(r['created_at']):<20} {_when(r['revoked_at'])}")
    finally:
        db.close()
    return 0
