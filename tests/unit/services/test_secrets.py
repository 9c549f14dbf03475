"""The shared token and the queue password are read the same way: from a secret file when the
config names one (an error naming the key when it is missing or empty), else from a variable."""

import pytest

from rlmesh.services.auth import load_token
from rlmesh.services.config import QueueSection
from rlmesh.services.queue import queue_password


def test_a_secret_comes_from_its_file_else_its_variable(tmp_path, monkeypatch):
    (tmp_path / "token").write_text("from-file\n")
    (tmp_path / "rollout.pw").write_text(" pw \n")
    monkeypatch.setenv("TOKEN_VAR", "from-env")
    monkeypatch.setenv("PW_VAR", "pw-env")
    assert load_token(str(tmp_path / "token"), "TOKEN_VAR") == "from-file"
    assert load_token(None, "TOKEN_VAR") == "from-env"
    assert load_token(None, "UNSET_VAR") is None
    section = QueueSection(password_file=str(tmp_path / "{tier}.pw"), password_env="PW_VAR")
    assert queue_password(section, "rollout") == "pw"
    assert queue_password(QueueSection(password_env="PW_VAR"), "rollout") == "pw-env"


def test_a_missing_or_empty_secret_file_names_its_key(tmp_path):
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=r"^network.token_file='.*/missing' does not exist; create it or unset it$"):
        load_token(str(missing))
    with pytest.raises(ValueError, match=r"^network.token_file='.*/empty' is empty$"):
        load_token(str(empty))
    with pytest.raises(ValueError, match=r"^queue.password_file='.*/missing' does not exist; create it or unset it$"):
        queue_password(QueueSection(password_file=str(missing)), "learner")
    with pytest.raises(ValueError, match=r"^queue.password_file='.*/empty' is empty$"):
        queue_password(QueueSection(password_file=str(empty)), "learner")
