"""``cp-infer keys`` in process (its parser and its actions over a real job store file): a key printed once and
alone, usable by a server's store at once; list shows every tenant and never a key; set and revoke change what a
server sees; bad input exits 2 naming it."""

from __future__ import annotations

import pytest

from server.cli.command import main
from server.group.jobs import JobStore
from server.group.tenants import Tenant


def test_add_list_set_revoke(tmp_path, capsys):
    data = str(tmp_path)
    assert main(["keys", "--data-dir", data, "add", "team-a", "--rpm", "60", "--max-jobs", "2"]) == 0
    key = capsys.readouterr().out
    assert key.count("\n") == 1 and key.startswith("cpk_") and len(key.strip()) == 47
    key = key.strip()
    store = JobStore(tmp_path, max_queue=4)  # a server on the same --data-dir
    assert store.tenants.authenticate(key) == Tenant("team-a", rpm=60, max_jobs=2)
    # The store's flags after the action too; a limit back to none.
    assert main(["keys", "set", "team-a", "--rpm", "none", "--role", "admin", "--data-dir", data]) == 0
    assert main(["keys", "--data-dir", data, "list"]) == 0
    listed = capsys.readouterr().out
    assert "team-a" in listed and "admin" in listed and key not in listed and key[4:20] not in listed
    assert main(["keys", "--data-dir", data, "revoke", "team-a"]) == 0
    store.tenants._cache.clear()  # a server's cache would lapse within KEY_TTL_S
    assert store.tenants.authenticate(key) is None
    store.close()


@pytest.mark.parametrize("argv, says", [
    (["add", "Bad Name"], "tenant name 'Bad Name'"),
    (["add", "admin"], "--api-key"),
    (["add", "x", "--rpm", "0"], "must be > 0"),
    (["set", "nobody", "--rpm", "3"], "no tenant 'nobody'"),
    (["revoke", "nobody"], "no tenant 'nobody'"),
])
def test_bad_input_exits_2_naming_it(tmp_path, capsys, argv, says):
    try:
        code = main(["keys", "--data-dir", str(tmp_path), *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert says in capsys.readouterr().err
