"""Where a job's files live, chosen by URL: the local folder (one server) or an S3 bucket (a fleet).

A job's files are named by its id and a suffix (``.mp4``, ``.jpg``, ``.npy``, ``.resume.npz``, ``.lead.npy``).

Invariants:
- Writers make a file whole somewhere private (a ``.tmp`` beside it, or the local spool) and hand it over with
  :meth:`OutputStore.put`, which makes it visible whole: a rename in the folder, one ``PUT`` to S3 (an object is
  never seen half-written). No reader ever sees a file being made.
- In S3 every attempt of a job writes keys of its own (``<prefix><job id>/<attempt><suffix>``), so a stale attempt
  that wakes up overwrites nothing; which attempt's files are the job's is the job store's record (its guarded
  update), never the bucket's listing. The lead frames, written before any attempt, are attempt 0's.
- The local folder serves one server: its names carry no attempt (the server's own restarted group is the only
  other writer, and it starts after the old one has died).
- Credentials and the endpoint come from boto3's usual sources (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_REGION``, ``AWS_ENDPOINT_URL`` for any S3-compatible server); transient errors are retried with backoff by
  boto3's standard retry mode (5 attempts, or ``AWS_MAX_ATTEMPTS``), and what still fails raises
  :class:`StoreUnavailable`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["OutputStore", "LocalOutputs", "S3Outputs", "StoreUnavailable", "open_outputs"]

_CHUNK = 1 << 20


class StoreUnavailable(Exception):
    """A store (the job store's database, the output store) cannot be reached now; the caller may retry later."""

    def __init__(self, store: str, detail: str):
        super().__init__(f"the {store} is unreachable: {detail}")
        self.store = store


class OutputStore:
    """A job's files by (job id, suffix, attempt); see the module docstring."""

    name: str
    local: bool
    """Whether the files are in :attr:`folder` itself (one server's), rather than a store other servers share."""
    folder: Path
    """The local folder: the files themselves (:class:`LocalOutputs`), or the spool where they are made."""

    def probe(self) -> None:
        """Raise :class:`StoreUnavailable` unless the store answers (one cheap request)."""

    def local_path(self, job_id: str, suffix: str) -> Path | None:
        """The file itself when it is on this machine's disk (then served as it is), else ``None``."""
        return None

    def put(self, job_id: str, suffix: str, source: Path, *, attempt: int) -> None:
        """Make ``source`` (a finished file, which this consumes) the file ``suffix`` of ``attempt``."""
        raise NotImplementedError

    def put_bytes(self, job_id: str, suffix: str, data: bytes, *, attempt: int) -> None:
        raise NotImplementedError

    def get_bytes(self, job_id: str, suffix: str, *, attempt: int) -> bytes | None:
        raise NotImplementedError

    def size(self, job_id: str, suffix: str, *, attempt: int) -> int | None:
        """The file's size, ``None`` when there is none."""
        raise NotImplementedError

    def read(self, job_id: str, suffix: str, *, attempt: int, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``[start, end)`` of the file, in pieces."""
        raise NotImplementedError

    def delete(self, job_id: str, *suffixes: str) -> None:
        """The job's files with these suffixes, of every attempt (none given: all of its files)."""
        raise NotImplementedError

    def objects(self) -> Iterator[tuple[str, int, str, float]]:
        """Every file a store shared by a fleet holds: ``(job id, attempt, suffix, age in seconds)``; none for the
        local folder (its server sweeps it itself: ``JobStore.recover``)."""
        return iter(())

    def remove(self, job_id: str, suffix: str, *, attempt: int) -> None:
        """One attempt's file (:meth:`objects`' sweep)."""
        raise NotImplementedError


class LocalOutputs(OutputStore):
    local = True

    def __init__(self, folder: Path):
        self.name = f"output store (folder {folder})"
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, job_id: str, suffix: str) -> Path:
        return self.folder / f"{job_id}{suffix}"

    def local_path(self, job_id: str, suffix: str) -> Path:
        return self._path(job_id, suffix)

    def put(self, job_id: str, suffix: str, source: Path, *, attempt: int) -> None:
        os.replace(source, self._path(job_id, suffix))

    def put_bytes(self, job_id: str, suffix: str, data: bytes, *, attempt: int) -> None:
        tmp = self._path(job_id, suffix + ".tmp")
        tmp.write_bytes(data)
        tmp.replace(self._path(job_id, suffix))

    def get_bytes(self, job_id: str, suffix: str, *, attempt: int) -> bytes | None:
        try:
            return self._path(job_id, suffix).read_bytes()
        except FileNotFoundError:
            return None

    def size(self, job_id: str, suffix: str, *, attempt: int) -> int | None:
        path = self._path(job_id, suffix)
        return path.stat().st_size if path.is_file() else None

    def read(self, job_id: str, suffix: str, *, attempt: int, start: int, end: int) -> Iterator[bytes]:
        with open(self._path(job_id, suffix), "rb") as f:
            f.seek(start)
            while start < end:
                piece = f.read(min(_CHUNK, end - start))
                if not piece:
                    return
                start += len(piece)
                yield piece

    def delete(self, job_id: str, *suffixes: str) -> None:
        files = [self._path(job_id, s) for s in suffixes] if suffixes else self.folder.glob(f"{job_id}.*")
        for file in files:
            file.unlink(missing_ok=True)


class S3Outputs(OutputStore):
    local = False

    def __init__(self, url: str, spool: Path):
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ValueError("--output-store s3://... needs boto3: pip install 'cp-infer[fleet]'") from None

        bucket, _, prefix = url[len("s3://"):].partition("/")
        if not bucket:
            raise ValueError(f"--output-store {url!r} names no bucket; use s3://BUCKET/PREFIX")
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.name = f"output store (s3://{bucket}/{self.prefix})"
        self.folder = spool
        spool.mkdir(parents=True, exist_ok=True)
        attempts = int(os.environ.get("AWS_MAX_ATTEMPTS", "5"))  # boto3's own variable, read for the default
        self._client = boto3.session.Session().client("s3", config=Config(
            retries={"max_attempts": attempts, "mode": "standard"}, connect_timeout=5, read_timeout=60))

    def probe(self) -> None:
        self._call("list_objects_v2", Prefix=self.prefix, MaxKeys=1)

    def _key(self, job_id: str, suffix: str, attempt: int) -> str:
        return f"{self.prefix}{job_id}/{attempt}{suffix}"

    def _call(self, method: str, **kwargs):
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self._client, method)(Bucket=self.bucket, **kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                raise FileNotFoundError(kwargs.get("Key")) from None
            raise StoreUnavailable(self.name, str(exc)) from None
        except BotoCoreError as exc:
            raise StoreUnavailable(self.name, str(exc)) from None

    def put(self, job_id: str, suffix: str, source: Path, *, attempt: int) -> None:
        with open(source, "rb") as f:
            self._call("put_object", Key=self._key(job_id, suffix, attempt), Body=f)
        source.unlink(missing_ok=True)

    def put_bytes(self, job_id: str, suffix: str, data: bytes, *, attempt: int) -> None:
        self._call("put_object", Key=self._key(job_id, suffix, attempt), Body=data)

    def get_bytes(self, job_id: str, suffix: str, *, attempt: int) -> bytes | None:
        try:
            return self._call("get_object", Key=self._key(job_id, suffix, attempt))["Body"].read()
        except FileNotFoundError:
            return None

    def size(self, job_id: str, suffix: str, *, attempt: int) -> int | None:
        try:
            return self._call("head_object", Key=self._key(job_id, suffix, attempt))["ContentLength"]
        except FileNotFoundError:
            return None

    def read(self, job_id: str, suffix: str, *, attempt: int, start: int, end: int) -> Iterator[bytes]:
        if start >= end:
            return
        body = self._call("get_object", Key=self._key(job_id, suffix, attempt),
                          Range=f"bytes={start}-{end - 1}")["Body"]
        try:
            yield from body.iter_chunks(_CHUNK)
        finally:
            body.close()

    def objects(self) -> Iterator[tuple[str, int, str, float]]:
        now = time.time()
        token: dict[str, str] = {}
        while True:
            page = self._call("list_objects_v2", Prefix=self.prefix, **token)
            for item in page.get("Contents", ()):
                job_id, _, name = item["Key"][len(self.prefix):].partition("/")
                attempt, dot, suffix = name.partition(".")
                if attempt.isdigit() and dot and "/" not in name:  # another writer's keys are not ours
                    yield job_id, int(attempt), "." + suffix, now - item["LastModified"].timestamp()
            if not page.get("IsTruncated"):
                return
            token = {"ContinuationToken": page["NextContinuationToken"]}

    def remove(self, job_id: str, suffix: str, *, attempt: int) -> None:
        self._call("delete_object", Key=self._key(job_id, suffix, attempt))

    def delete(self, job_id: str, *suffixes: str) -> None:
        listing = self._call("list_objects_v2", Prefix=f"{self.prefix}{job_id}/")
        keys = [o["Key"] for o in listing.get("Contents", ())
                if not suffixes or any(o["Key"].endswith(s) for s in suffixes)]
        for key in keys:
            self._call("delete_object", Key=key)


def open_outputs(url: str | None, data_dir: Path) -> OutputStore:
    """``None`` or ``file://PATH``: the local folder (default ``<data_dir>/videos``); ``s3://BUCKET/PREFIX``: a
    bucket, files made in ``<data_dir>/videos`` first."""
    if url is None:
        return LocalOutputs(data_dir / "videos")
    if url.startswith("file://"):
        return LocalOutputs(Path(url[len("file://"):]))
    if url.startswith("s3://"):
        return S3Outputs(url, data_dir / "videos")
    raise ValueError(f"--output-store {url.split('://')[0]}://... is not an output store; use s3://BUCKET/PREFIX "
                     "or file://PATH")
