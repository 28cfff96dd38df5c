"""Tenants in the job store, on the embedded SQLite file and on a real PostgreSQL (``tests/services.py``): fair turns
in the claim (tenant A queues 10, then B queues 1: B's job is one of the next two claimed; FIFO within a tenant);
two servers share one request bucket and one list of keys (a revoke on one is refused by the other within a
second); usage follows jobs to their end."""

from __future__ import annotations

import time

import pytest

from cp_infer.request import GenerationRequest, resolve_request
from models.ltx_video.options import ltx_video_options
from server.group.jobs import JobStore
from server.group.tenants import KEY_TTL_S, Tenant, TenantLimit

pytestmark = pytest.mark.timeout(120)


def _request(frames: int = 9) -> GenerationRequest:
    return resolve_request(GenerationRequest(prompt="a fox", num_frames=frames, width=96, height=64),
                           ltx_video_options())


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request, tmp_path):
    """Two job stores on one database (two servers of a fleet; on SQLite, two connections to one file)."""
    url = request.getfixturevalue("pg_url") if request.param == "postgresql" else f"sqlite:///{tmp_path}/jobs.db"
    made = [JobStore(tmp_path / name, max_queue=64, job_store=url, node=name) for name in ("a", "b")]
    yield made
    for store in made:
        store.close()


def test_a_tenant_with_one_job_waits_behind_at_most_one_of_another_tenants(stores):
    first, second = stores
    a, b, c = Tenant("a"), Tenant("b"), Tenant("c")
    queued_a = [first.submit(_request(), model="m", tenant=a).id for _ in range(10)]
    queued_b = second.submit(_request(), model="m", tenant=b).id
    claims = [first.claim_next(timeout=0), second.claim_next(timeout=0)]
    assert [j.id for j in claims] == [queued_a[0], queued_b]  # B's one job ran second, not eleventh
    queued_c = [first.submit(_request(), model="m", tenant=c).id for _ in range(2)]
    # Turns go round the tenants with queued jobs (b has none now); within a tenant, first in first out.
    order = [(second if i % 2 else first).claim_next(timeout=0).id for i in range(5)]
    assert order == [queued_c[0], queued_a[1], queued_c[1], queued_a[2], queued_a[3]]
    time.sleep(0.06)
    for job in claims:
        first.finish(job.id, "completed", attempt=job.attempts, ranks=2)
    usage = {u["tenant"]: u for u in second.tenants.usage()}
    assert usage["a"]["jobs_ended"]["completed"] == 1 and usage["a"]["jobs_submitted"] == 10
    fps = claims[1].request.fps
    # Rank-seconds: the time from its claim to its end (over 0.06 s), times its 2 ranks.
    assert usage["b"]["video_seconds"] == pytest.approx(9 / fps, abs=1e-3) and usage["b"]["rank_seconds"] >= 0.12
    assert usage["a"]["jobs"] == {"queued": 6, "in_progress": 3, "completed": 1, "failed": 0, "cancelled": 0}


def test_one_tenant_is_fifo_as_before(stores):
    first, _ = stores
    ids = [first.submit(_request(), model="m").id for _ in range(4)]
    assert [first.claim_next(timeout=0).id for _ in ids] == ids


def test_the_fleet_shares_keys_buckets_and_limits(stores):
    first, second = stores
    key = first.tenants.add("ann", rpm=2, max_jobs=1)
    ann = second.tenants.authenticate(key)
    assert ann == Tenant("ann", rpm=2, max_jobs=1) and second.tenants.authenticate(key + "x") is None
    first.tenants.take_request(ann)
    second.tenants.take_request(ann)  # the bucket's two tokens, one taken on each server
    with pytest.raises(TenantLimit) as over:
        first.tenants.take_request(ann)
    assert over.value.limit == "rpm" and 1 <= over.value.retry_after_s <= 30
    second.submit(_request(), model="m", tenant=ann)
    with pytest.raises(TenantLimit, match="max_jobs=1"):
        first.submit(_request(), model="m", tenant=ann)
    first.tenants.revoke("ann")
    time.sleep(KEY_TTL_S)
    assert second.tenants.authenticate(key) is None
    assert all(key not in str(row) for row in first.tenants.list())


def test_two_servers_answer_each_tenant_alike(stores):
    """The route matrix's core on a fleet of two (the real app over each store): a video made on one server is its
    owner's on the other too, another tenant gets 404 there, an admin sees it, and a revoke made through one
    server's store is refused by the other within a second."""
    from fastapi.testclient import TestClient

    from server.http.app import AppConfig, create_app
    from tests.server.group.test_fleet_stores import _BODY, _Server

    first, second = stores
    keys = {name: first.tenants.add(name, role="admin" if name == "root" else "user")
            for name in ("ann", "bob", "root")}
    apps = [create_app(AppConfig(), _Server(store)) for store in stores]

    def client(app, name):
        return TestClient(app, headers={"Authorization": f"Bearer {keys[name]}"})

    with client(apps[0], "ann") as ann_a, client(apps[1], "ann") as ann_b, client(apps[1], "bob") as bob_b, \
            client(apps[1], "root") as root_b:
        made = ann_a.post("/v1/videos", json=_BODY).json()["id"]
        for method, path in (("POST", f"/v1/videos/{made}/cancel"), ("GET", f"/v1/videos/{made}"),
                             ("GET", f"/v1/videos/{made}/events")):  # events end: it is cancelled
            assert bob_b.request(method, path).status_code == 404, (method, path)
            assert root_b.request(method, path).status_code == 200, (method, path)
        assert [j["id"] for j in ann_b.get("/v1/videos").json()["data"]] == [made]
        assert bob_b.get("/v1/videos").json()["data"] == []
        assert ann_b.delete(f"/v1/videos/{made}").status_code == 200
        first.tenants.revoke("ann")
        revoked_at = time.monotonic()
        while ann_b.get("/v1/videos").status_code == 200:
            assert time.monotonic() - revoked_at < 1.0, "the other server let the revoked key in after a second"
            time.sleep(0.05)
        assert ann_b.get("/v1/videos").status_code == 401
