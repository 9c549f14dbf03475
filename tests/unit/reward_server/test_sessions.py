import time

import pytest

from rlmesh.reward_server.sessions import LocalSession, SessionError, SessionId, SessionTable


def test_session_ids_route_to_replica_and_environment():
    table = SessionTable("r1", idle_timeout_s=60)
    sid = table.new_id("calculator")
    assert str(sid).startswith("r1/calculator/")
    assert table.route(str(sid)) == sid
    nested = table.new_id("remote_env", inner="r2/remote_env/abc")
    assert table.route(str(nested)).inner == "r2/remote_env/abc", "a remote's own id passes through unchanged"


def test_another_replicas_session_is_refused_with_both_names():
    with pytest.raises(SessionError, match="replica 'r2', this is 'r1'") as err:
        SessionTable("r1", 60).route("r2/calculator/abc")
    assert err.value.code == "FAILED_PRECONDITION"


@pytest.mark.parametrize("bad", ["", "abc", "r1/calc", "r1//x"])
def test_malformed_session_ids(bad):
    with pytest.raises(SessionError, match="is not '<replica>/<environment>/<id>'") as err:
        SessionId.parse(bad)
    assert err.value.code == "INVALID_ARGUMENT"


def test_table_finds_pops_and_evicts_idle_sessions():
    table = SessionTable("r1", idle_timeout_s=0.05)
    a, b = table.new_id("guess_number"), table.new_id("guess_number")
    table.add(a, LocalSession("guess_number", "state-a"))
    table.add(b, LocalSession("guess_number", "state-b"))
    assert table.get(a).state == "state-a"
    with pytest.raises(SessionError, match="no session") as err:
        table.get(SessionId("r1", "calculator", a.inner))
    assert err.value.code == "NOT_FOUND", "the environment in the id must match too"
    time.sleep(0.06)
    table.get(b)  # touched: stays
    assert [s.state for s in table.evict_idle()] == ["state-a"]
    assert table.pop(b).state == "state-b" and table.pop(b) is None and len(table) == 0


def test_names_with_a_slash_are_rejected():
    with pytest.raises(ValueError, match="contain no '/'"):
        SessionTable("a/b", 60)
