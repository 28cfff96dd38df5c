"""``bench/harness.py``'s pure helpers: the round order, the slowest rank per step, the median round, the phases read
back from a run's marks, the markdown table and the report's exit status. No process is started."""

from __future__ import annotations

import json
import random
import statistics

from bench.harness import (
    DIFF_2,
    OURS_1,
    REPO,
    command_line,
    median_round,
    phase_table,
    print_report,
    read_phases,
    rotated,
    slowest_steps,
    table_head,
    table_row,
)


def test_rotated_starts_round_r_at_item_r_and_keeps_every_item():
    rng = random.Random()
    items = [rng.random() for _ in range(rng.randint(2, 7))]
    for r in range(3 * len(items)):
        order = rotated(items, r)
        assert sorted(order) == sorted(items)
        assert order[0] == items[r % len(items)]
        assert order == items[r % len(items):] + items[:r % len(items)]
    firsts = {rotated(items, r)[0] for r in range(len(items))}
    assert firsts == set(items)  # over len(items) rounds every configuration goes first once


def test_slowest_steps_is_the_max_over_ranks_per_step():
    rng = random.Random()
    steps = rng.randint(2, 6)
    replies = [{"steps": [rng.random() for _ in range(steps)]} for _ in range(rng.randint(1, 4))]
    assert slowest_steps(replies) == [max(r["steps"][i] for r in replies) for i in range(steps)]


def test_median_round_is_the_round_with_the_median_time():
    rng = random.Random()
    rounds = [{"e2e_s": rng.random(), "steps": [rng.random()]} for _ in range(2 * rng.randint(1, 4) + 1)]
    assert median_round(rounds)["e2e_s"] == statistics.median(r["e2e_s"] for r in rounds)
    even = rounds[:-1]
    assert median_round(even)["e2e_s"] == sorted(r["e2e_s"] for r in even)[len(even) // 2 - 1]  # the lower middle


def test_phases_read_back_cover_the_run_and_the_table_has_a_row_per_process(tmp_path):
    rng = random.Random()
    started = 1000.0 + rng.random()
    marks = {}
    for role in ("rank0", "launcher"):
        t = started + rng.random()
        marks[role] = [("start", t)]
        for name in ("imports", "load", "steps"):
            t += rng.random()
            marks[role].append((name, t))
        (tmp_path / f"{role}.json").write_text(json.dumps({"role": role, "pid": 1, "marks": marks[role]}))
    ended = max(m[-1][1] for m in marks.values()) + rng.random()
    phases = read_phases(tmp_path, started, ended)
    assert set(phases) == {"launcher", "rank0"}
    for durations in phases.values():
        assert [name for name, _ in durations] == ["to start", "imports", "load", "steps", "to exit"]
        assert abs(sum(seconds for _, seconds in durations) - (ended - started)) < 1e-9
    rows = phase_table("ours", [{"phases": phases}])
    assert [row.split(" | ")[0] for row in rows] == ["| ours launcher", "| ours rank0"]  # the launcher first


def test_table_head_aligns_the_first_columns_left():
    head, rule = table_head(("a", "b", "c"), left=1)
    assert head == table_row(["a", "b", "c"]) == "| a | b | c |"
    assert rule == "|---|---:|---:|"
    assert table_head(("a", "b"))[1] == "|---|---|"


def test_print_report_fails_on_a_failed_check_and_writes_the_file(tmp_path, capsys):
    out = tmp_path / "report.md"
    assert print_report(["a table", "CHECK FAILED: ours differs"], out) == 1
    assert out.read_text() == "a table\nCHECK FAILED: ours differs\n"
    assert capsys.readouterr().out == out.read_text()
    assert print_report(["a table", "- PASS: no CHECK FAILED at the start"]) == 0


def test_command_line_is_relative_to_the_repository():
    assert command_line(str(REPO / "bench" / "generate.py"), ["--quick", "--out", "a b.md"]) == \
        "python bench/generate.py --quick --out 'a b.md'"


def test_setup_labels():
    assert (OURS_1.label, DIFF_2.label) == ("ours N=1", "diffusers CP N=2")


def test_two_node_link_bytes_are_the_arithmetic():
    """``bench/two_nodes.py``'s expected bytes across the nodes per step (fp32): 2 x B x L x H x D floats a layer for
    both layouts, tokens padded to U x R and heads to U."""
    from bench.two_nodes import link_bytes

    assert link_bytes(4, ulysses=4, ring=1) == link_bytes(4, ulysses=2, ring=2) == 4 * 2 * 2 * 512 * 4 * 64 * 4
    assert link_bytes(1, ulysses=4, ring=1, batch=1, tokens=18, heads=3, head_dim=1) == 2 * 20 * 4 * 4
    assert link_bytes(1, ulysses=2, ring=2, batch=1, tokens=18, heads=3, head_dim=1) == 2 * 20 * 4 * 4
