"""`rlmesh tls-init`: certificates for every tier, and a clear refusal where it cannot write them."""

import stat

from rlmesh.cli import main


def test_tls_init_writes_a_ca_and_a_private_key_per_tier(tmp_path, capsys):
    assert main(["tls-init", "--output", str(tmp_path / "certs")]) == 0
    names = {p.name for p in (tmp_path / "certs").iterdir()}
    assert {"ca.crt", "learner.crt", "learner.key", "rollout.key", "reward.key"} <= names
    assert stat.S_IMODE((tmp_path / "certs" / "learner.key").stat().st_mode) == 0o600
    assert "network.tls.cert_file=" in capsys.readouterr().out


def test_tls_init_into_a_place_it_cannot_write_says_so_without_a_traceback(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["tls-init", "--output", str(tmp_path / "file" / "certs")]) == 2
    err = capsys.readouterr().err
    assert "rlmesh tls-init: --output" in err and "file is a file, not a directory; give a directory this user can " \
        "write" in err
