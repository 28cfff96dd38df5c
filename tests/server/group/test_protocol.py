"""The leader side of the rank-0 -> workers command protocol is written once (``server.group.runtime.GroupDriver``) and
both leaders use it: the CLI's (``server.cli.lead.Leader`` / ``run_group``) and the server's
(``server.group.leader.GroupLeader``).

Both run in process over a stand-in runtime (one rank, no model) while the collectives are replaced: the ones that
``GroupDriver`` calls record each command, and the same collectives reached any other way (``cp_infer``'s own
names, or ``server.group.runtime``'s from outside ``GroupDriver``) fail the test.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

import cp_infer
import cp_infer.collectives
import server.group.runtime
from cp_infer import VideoGeometry, single_process_state
from cp_infer.request import GenerationRequest, resolve_request
from models.ltx_video.options import ltx_video_options
from server.cli.lead import run_group
from server.group.jobs import JobStore
from server.group.leader import GroupLeader, LeaderConfig
from server.group.runtime import FAULT_ENV, Command, GroupDriver, RuntimeConfig


class _Group:
    """The collectives ``GroupDriver`` issues, recorded in order with what the stand-in runtime does."""

    def __init__(self):
        self.events: list[str] = []
        self.commands: list[Command] = []

    @staticmethod
    def _check_caller() -> None:
        caller = sys._getframe(2)  # the function that called the collective
        if not isinstance(caller.f_locals.get("self"), GroupDriver):
            raise AssertionError(f"{caller.f_code.co_name} ({caller.f_code.co_filename}) issued a collective of "
                                 "the command protocol outside GroupDriver")

    def broadcast_object(self, obj, *, state, src: int = 0):
        self._check_caller()
        assert isinstance(obj, Command), obj
        self.commands.append(obj)
        self.events.append(obj.kind)
        return obj

    def all_reduce_max_int(self, value: int, *, state) -> int:
        self._check_caller()
        self.events.append("answer")
        return value


class _Runtime:
    """One rank, no model: ``generate`` returns random frames of the request's shape."""

    def __init__(self, events: list[str]):
        self.state = single_process_state()
        self.model = SimpleNamespace(options=ltx_video_options(), geometry=VideoGeometry())
        self._events = events
        self._rng = np.random.default_rng()
        self.memory = ()  # where the (absent) model's bytes live (``Runtime.memory``)

    def generate(self, request: GenerationRequest, control=None):
        self._events.append(f"run {request.prompt}")
        return self._rng.integers(0, 256, size=(request.num_frames, request.height, request.width, 3),
                                  dtype=np.uint8)


@pytest.fixture
def group(monkeypatch) -> _Group:
    recorded = _Group()
    monkeypatch.setattr(server.group.runtime, "broadcast_object", recorded.broadcast_object)
    monkeypatch.setattr(server.group.runtime, "all_reduce_max_int", recorded.all_reduce_max_int)

    def bypass(*_args, **_kwargs):
        raise AssertionError("a collective of the command protocol was issued from outside GroupDriver")

    for module in (cp_infer, cp_infer.collectives):
        monkeypatch.setattr(module, "broadcast_object", bypass)
        monkeypatch.setattr(module, "all_reduce_max_int", bypass)
    monkeypatch.delenv(FAULT_ENV, raising=False)
    monkeypatch.delenv("CP_INFER_LEADER_STATUS", raising=False)
    return recorded


def _request(prompt: str) -> GenerationRequest:
    return resolve_request(GenerationRequest(prompt=prompt, num_frames=9, height=64, width=96, num_inference_steps=2,
                                             seed=5), ltx_video_options())


def test_the_cli_leader_sends_every_command_through_the_group_driver(group, monkeypatch):
    runtime = _Runtime(group.events)
    monkeypatch.setattr(server.group.runtime, "start_runtime", lambda _config: runtime)
    first, second = _request("a fox"), _request("a whale")

    def lead(leader) -> int:
        for request, job_id in ((first, "one"), (second, "two")):
            assert leader.generate(request, job_id).frames.shape == (9, 64, 96, 3)
        leader.stop()
        return 3

    assert run_group(RuntimeConfig(), lead) == 3  # the lead's exit code is the run's
    assert group.events == ["generate", "run a fox", "generate", "run a whale", "stop"]
    sent = [(c.request, c.job_id) for c in group.commands if c.kind == "generate"]
    assert sent[0][0] is first and sent[1][0] is second and [j for _, j in sent] == ["one", "two"]


def test_the_server_leader_sends_every_command_through_the_group_driver(group, tmp_path):
    runtime = _Runtime(group.events)
    store = JobStore(tmp_path, max_queue=4)
    leader = GroupLeader(LeaderConfig(runtime=RuntimeConfig(), data_dir=tmp_path, heartbeat_s=0.05), store,
                         runtime_factory=lambda _config: runtime, exit_on_fatal=False)
    leader.start()
    try:
        deadline = time.monotonic() + 30
        while not leader.loaded and leader.fatal is None and time.monotonic() < deadline:
            time.sleep(0.01)
        job = store.submit(_request("a fox"), model="m")
        while not store.get(job.id).terminal and leader.fatal is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        leader.stop()
    assert leader.fatal is None, leader.fatal
    assert store.get(job.id).status == "completed", store.get(job.id).error_message
    assert leader.broadcasts == 1  # what /metrics reports
    events = group.events
    assert events[:2] == ["ping", "answer"]  # the group answered before it was ready
    assert events[-1] == "stop"
    at = events.index("generate")
    assert events.count("generate") == 1 and events[at + 1] == "run a fox"
    # Every other command is a heartbeat, each answered by the whole group.
    pings = [e for i, e in enumerate(events[:-1]) if i not in (at, at + 1)]
    assert pings == ["ping", "answer"] * (len(pings) // 2) and len(pings) >= 4
    sent = next(c for c in group.commands if c.kind == "generate")
    assert sent.request.prompt == "a fox" and sent.job_id == job.id
    store.close()
