"""`--target nginx` command-line settings: defaults, durations and refused combinations."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config import ConfigError, from_argv


def test_nginx_target_defaults_follow_the_directory(tmp_path: Path) -> None:
    """--nginx-dir alone gives conf <dir>/nginx.conf and prefix <dir>; durations take units."""
    config = from_argv(["--topology", "t.yaml", "--target", "nginx", "--nginx-dir", str(tmp_path),
                        "--nginx-pid-file", str(tmp_path / "nginx.pid"), "--reload-min-interval", "500ms"])
    assert config.nginx is not None
    assert config.nginx.conf == tmp_path / "nginx.conf"
    assert config.nginx.prefix == tmp_path
    assert config.nginx.pid_file == tmp_path / "nginx.pid"
    assert config.nginx.reload_min_interval_s == 0.5


def test_envoy_target_has_no_nginx_settings() -> None:
    """Without --target the sidecar publishes to Envoy, as before."""
    assert from_argv(["--topology", "t.yaml"]).nginx is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "nginx", "--nginx-pid", "12"], "needs --nginx-dir"),
        (["--target", "nginx", "--nginx-dir", "/x"], "exactly one of --nginx-pid-file and --nginx-pid"),
        (["--target", "nginx", "--nginx-dir", "/x", "--nginx-pid", "12", "--nginx-pid-file", "/p"],
         "exactly one of"),
        (["--nginx-dir", "/x"], "--nginx-dir only apply with --target nginx"),
    ],
)
def test_contradictions_are_usage_errors(argv: list[str], message: str) -> None:
    """A missing or contradictory nginx flag is a ConfigError naming it (main exits 2)."""
    with pytest.raises(ConfigError, match=message):
        from_argv(["--topology", "t.yaml", *argv])


def test_bad_duration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """--reload-min-interval takes 2, 2s, 500ms or 1m; anything else is an argparse error."""
    with pytest.raises(SystemExit) as exit_info:
        from_argv(["--topology", "t.yaml", "--target", "nginx", "--reload-min-interval", "soon"])
    assert exit_info.value.code == 2
    assert "not a duration: 'soon'" in capsys.readouterr().err
