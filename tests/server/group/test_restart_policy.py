"""The restart policy of ``cp-infer serve`` (``server.group.restarts``) as a unit: a fake clock and fake rounds of the
group, no processes. ``tests/server/group/test_server_restart.py`` kills real ranks."""

from __future__ import annotations

import argparse
import logging
import os
import random

import pytest

from server.cli.launch import _failure_cause, count_launcher_restarts
from server.group.restarts import RestartBudget, RestartPolicy, RoundResult, supervise


def _reference_decisions(times: list[float], max_restarts: int, window_s: float) -> list[bool]:
    """Brute force: a restart at t is allowed when fewer than max_restarts allowed ones lie in (t - window_s, t]."""
    allowed: list[float] = []
    out = []
    for t in times:
        ok = sum(1 for a in allowed if t - window_s < a <= t) < max_restarts
        if ok:
            allowed.append(t)
        out.append(ok)
    return out


@pytest.mark.parametrize("trial", range(20))
def test_budget_matches_a_brute_force_sliding_window(trial):
    rng = random.Random()
    max_restarts, window_s = rng.randint(0, 6), rng.uniform(1.0, 100.0)
    times, t = [], 0.0
    for _ in range(rng.randint(1, 60)):
        t += rng.expovariate(max(1, max_restarts) / window_s)  # bursts and gaps around the allowed rate
        times.append(t)
    budget = RestartBudget(RestartPolicy(max_restarts, window_s))
    got = [budget.take(t) for t in times]
    assert got == _reference_decisions(times, max_restarts, window_s), (max_restarts, window_s, times)


def test_window_edge_and_no_restarts():
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=10.0))
    assert budget.take(0.0) and budget.take(4.0)
    assert not budget.take(9.99)  # 2 within the last 10 s already; a refusal records nothing
    assert budget.in_window(9.99) == 2
    assert budget.take(10.0)  # the restart at 0 is exactly 10 s old: out of the window
    assert budget.in_window(14.0) == 1
    off = RestartBudget(RestartPolicy(max_restarts=0, window_s=300.0))
    assert not any(off.take(t) for t in (0.0, 1e3, 1e6))


@pytest.mark.parametrize(("kwargs", "flag"), [({"max_restarts": -1}, "--max-restarts -1"),
                                              ({"window_s": 0.0}, "--restart-window-s 0"),
                                              ({"window_s": float("nan")}, "--restart-window-s nan")])
def test_bad_policy_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        RestartPolicy(**kwargs)


class _Rounds:
    """Fake rounds: each failure (or the final result) at the clock time given; records the counts passed in."""

    def __init__(self, script: list[tuple[float, RoundResult]]):
        self.script, self.seen, self.now = list(script), [], 0.0

    def __call__(self, restarts_so_far: int) -> RoundResult:
        self.seen.append(restarts_so_far)
        self.now, result = self.script.pop(0)
        return result

    def clock(self) -> float:
        return self.now


def _failed(rank: int = 1) -> RoundResult:
    return RoundResult(1, failure=f"rank {rank} (pid {random.randint(100, 99999)}) killed by SIGKILL")


def test_failures_within_the_budget_are_restarted_and_the_last_code_returned(caplog):
    code = random.randint(0, 3)  # a group that ends in step returns the leader's own exit code
    rounds = _Rounds([(1.0, _failed()), (2.0, _failed(0)), (3.0, RoundResult(code))])
    with caplog.at_level(logging.WARNING, logger="cp_infer.restarts"):
        assert supervise(rounds, RestartPolicy(max_restarts=2, window_s=60.0), clock=rounds.clock) == code
    assert rounds.seen == [0, 1, 2] and not rounds.script
    restarts = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(restarts) == 2 and "rank 0" in restarts[1].getMessage() and "restart 2" in restarts[1].getMessage()


def test_a_crash_loop_ends_with_a_message_naming_the_cause_and_the_flags(caplog):
    max_restarts = random.randint(1, 5)
    rounds = _Rounds([(float(i), _failed()) for i in range(max_restarts + 1)] + [(99.0, RoundResult(0))])
    with caplog.at_level(logging.WARNING, logger="cp_infer.restarts"):
        code = supervise(rounds, RestartPolicy(max_restarts=max_restarts, window_s=300.0), clock=rounds.clock)
    assert code == 1
    assert rounds.seen == list(range(max_restarts + 1)), "a round ran past the budget"
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    message = error.getMessage()
    assert "killed by SIGKILL" in message and f"--max-restarts {max_restarts} --restart-window-s 300" in message


def test_failures_spread_beyond_the_window_restart_forever():
    n = random.randint(20, 40)
    rounds = _Rounds([(400.0 * i, _failed()) for i in range(n)] + [(400.0 * n, RoundResult(0))])
    assert supervise(rounds, RestartPolicy(max_restarts=1, window_s=300.0), clock=rounds.clock) == 0
    assert rounds.seen == list(range(n + 1))


def test_no_restarts_and_signals_are_not_restarted(caplog):
    rounds = _Rounds([(0.0, _failed())])
    with caplog.at_level(logging.ERROR, logger="cp_infer.restarts"):
        assert supervise(rounds, RestartPolicy(max_restarts=0), clock=rounds.clock) == 1
    assert "--max-restarts 0" in caplog.text and rounds.seen == [0]
    stopped = _Rounds([(0.0, RoundResult(1))])  # SIGTERM: torchrun stopped the ranks, no failure recorded
    assert supervise(stopped, RestartPolicy(), clock=stopped.clock) == 1 and stopped.seen == [0]


def test_serve_restarts_by_default():
    from server.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert args.max_restarts >= 1 and args.restart_window_s > 0
    assert RestartPolicy(args.max_restarts, args.restart_window_s) == RestartPolicy()
    assert parser.parse_args(["--max-restarts", "0"]).max_restarts == 0


def test_the_rank_count_adds_the_launchers_restarts(monkeypatch):
    ours, torchruns = random.randint(1, 50), random.randint(0, 3)
    monkeypatch.setenv("CP_INFER_GROUP_RESTARTS", str(ours))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(torchruns))
    assert count_launcher_restarts() == ours + torchruns
    assert count_launcher_restarts() == ours + torchruns  # idempotent
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == str(ours + torchruns)


def test_failure_cause_names_the_first_failed_rank(tmp_path):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    pid = random.randint(100, 99999)
    killed = ProcessFailure(local_rank=1, pid=pid, exitcode=-9, error_file=str(tmp_path / "none.json"))
    exc = ChildFailedError("server.cli", {1: killed})
    assert _failure_cause(exc) == f"rank 1 (pid {pid}) killed by SIGKILL"
    crashed = ProcessFailure(local_rank=0, pid=pid + 1, exitcode=3, error_file=str(tmp_path / "none.json"))
    assert _failure_cause(ChildFailedError("server.cli", {0: crashed})) == f"rank 0 (pid {pid + 1}) exited with code 3"
    # The rank a signal killed comes first: the leader mostly exited because of it.
    assert _failure_cause(ChildFailedError("server.cli", {0: crashed, 1: killed})) == (
        f"rank 1 (pid {pid}) killed by SIGKILL; rank 0 (pid {pid + 1}) exited with code 3")
