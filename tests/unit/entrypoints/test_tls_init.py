"""`rlmesh tls-init`: certificates for every tier (an --output it cannot write: test_model_fits)."""

import stat

from rlmesh.cli import main


def test_tls_init_writes_a_ca_and_a_private_key_per_tier(tmp_path, capsys):
    assert main(["tls-init", "--output", str(tmp_path / "certs")]) == 0
    names = {p.name for p in (tmp_path / "certs").iterdir()}
    assert {"ca.crt", "learner.crt", "learner.key", "rollout.key", "reward.key"} <= names
    assert stat.S_IMODE((tmp_path / "certs" / "learner.key").stat().st_mode) == 0o600
    assert "network.tls.cert_file=" in capsys.readouterr().out

