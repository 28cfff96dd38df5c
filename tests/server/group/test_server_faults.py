"""Faults on the real 2-rank server, each ending with the group still serving the next request.

Faults are injected through ``$CP_INFER_TEST_FAULT`` (set for the shared server in conftest), each selected by a
marker in the prompt: an exception on rank 1 at step 1, running out of device memory in step 1 on both ranks, an
exception on rank 0 in the decode, and a slow job (0.25 s per step on rank 0) to cancel mid-run. If any rank were
left inside the failed or cancelled job, the next job would hang or fail: every test ends by running one.
"""

from __future__ import annotations

import time

from ..conftest import tiny


def _next_job_completes(s) -> None:
    job = s.submit(tiny("a green hill under clouds", seed=int(time.time()) % 1000))
    assert s.wait_job(job["id"])["status"] == "completed"
    assert s.client.get("/ready").status_code == 200


def _wait_running(s, job_id: str, min_progress: int = 1, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = s.client.get(f"/v1/videos/{job_id}").json()
        if job["status"] == "in_progress" and job["progress"] >= min_progress:
            return job
        assert job["status"] in ("queued", "in_progress"), job
        time.sleep(0.05)
    raise AssertionError(f"{job_id} never ran: {job}")


def test_exception_on_rank1_fails_the_job_on_every_rank(api_server):
    s = api_server
    broadcasts = s.metric("cp_infer_requests_broadcast_total")
    job = s.submit(tiny("[fault:rank1-raise] a storm at sea", num_inference_steps=3))
    final = s.wait_job(job["id"])
    assert final["status"] == "failed", final
    assert final["error"]["code"] == "generation_failed"
    assert "rank 1" in final["error"]["message"] and "injected fault at step 1" in final["error"]["message"]
    assert final["progress"] == 30  # step 0 ran, step 1 was refused by the group before it started
    assert s.metric("cp_infer_requests_broadcast_total") == broadcasts + 1
    _next_job_completes(s)


def test_out_of_memory_in_a_step_fails_that_job_and_the_group_serves_on(api_server):
    """The CUDA allocator's error inside a step (raised from the transformer on every rank, as same-shaped ranks run
    out together) fails the job with ``out_of_memory``; the same group, not a restarted one, runs the next job."""
    s = api_server
    pids = s.group()["pids"]
    job = s.submit(tiny("[fault:oom] a glacier calving", num_inference_steps=3))
    final = s.wait_job(job["id"])
    assert final["status"] == "failed" and final["error"]["code"] == "out_of_memory", final
    message = final["error"]["message"]
    assert "rank 0: out of device memory (CUDA out of memory" in message and "rank 1: out of device memory" in message
    assert "--weights sharded / --offload" in message
    assert final["progress"] == 30  # step 0 ran, step 1 ran out of memory
    _next_job_completes(s)
    assert s.group()["restart_count"] == 0 and s.metric("cp_infer_group_restarts") == 0
    assert s.group()["pids"] == pids


def test_exception_on_rank0_in_decode_fails_only_that_job(api_server):
    s = api_server
    job = s.submit(tiny("[fault:rank0-decode] a candle flickers"))
    final = s.wait_job(job["id"])
    assert final["status"] == "failed" and final["error"]["code"] == "decode_failed", final
    assert "rank 0" in final["error"]["message"]
    assert s.client.get(f"/v1/videos/{job['id']}/content").status_code == 409
    _next_job_completes(s)


def test_delete_cancels_a_running_job_at_the_next_step(api_server):
    s = api_server
    cancelled = s.metric('cp_infer_jobs_finished_total{state="cancelled"}')
    job = s.submit(tiny("[slow] a clock ticking", num_inference_steps=40))  # ~10 s if nothing stops it
    running = _wait_running(s, job["id"], min_progress=3)
    started = time.monotonic()
    r = s.client.delete(f"/v1/videos/{job['id']}")
    took = time.monotonic() - started
    assert r.status_code == 200 and r.json()["deleted"] is True
    # DELETE returns once the group stopped the job: one step boundary (0.25 s here), not the >= 30 steps left.
    assert took < 5.0, took
    assert running["progress"] < 90
    assert s.client.get(f"/v1/videos/{job['id']}").status_code == 404
    assert s.metric('cp_infer_jobs_finished_total{state="cancelled"}') == cancelled + 1
    assert not list((s.data_dir / "videos").glob(f"{job['id']}.*"))
    _next_job_completes(s)


def test_cancel_keeps_the_record_and_the_event_stream_ends_cancelled(api_server):
    from ..http.test_server_e2e import read_events

    s = api_server
    job = s.submit(tiny("[slow] a windmill turning", num_inference_steps=40))
    _wait_running(s, job["id"], min_progress=3)
    r = s.client.post(f"/v1/videos/{job['id']}/cancel")
    assert r.status_code == 200
    final = s.wait_job(job["id"], timeout=5)
    assert final["status"] == "cancelled" and final["error"]["code"] == "cancelled" and final["progress"] < 90
    events = read_events(s, job["id"])
    assert events[0][1]["status"] == "queued" and events[-1] == ("video.cancelled", final)
    assert s.client.get(f"/v1/videos/{job['id']}/content").status_code == 409
    _next_job_completes(s)


def test_full_queue_gives_429_with_retry_after(api_server):
    s = api_server
    assert s.metric("cp_infer_queue_depth") == 0
    running = s.submit(tiny("[slow] a train passing", num_inference_steps=40))
    _wait_running(s, running["id"])
    queued = [s.submit(tiny(f"queued clip {i}")) for i in range(3)]  # the server's --max-queue
    assert s.metric("cp_infer_queue_depth") == 3
    r = s.client.post("/v1/videos", json=tiny("one too many"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
    assert int(r.headers["Retry-After"]) >= 1
    # A queued job is deleted at once; FIFO order is kept for the rest.
    assert s.client.delete(f"/v1/videos/{queued[0]['id']}").status_code == 200
    assert s.client.delete(f"/v1/videos/{running['id']}").status_code == 200
    first, second = (s.wait_job(q["id"]) for q in queued[1:])
    assert first["status"] == second["status"] == "completed"
    assert first["completed_at"] <= second["completed_at"]
    _next_job_completes(s)
