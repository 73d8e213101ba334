"""The prefill/decode split's shared secret: where it comes from, and that no process of a
split starts without one (an open split was the default: anybody who reached the port could
open legs and pin pages)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from laps_jax.server import pd_secret

GOOD = "a-long-enough-secret-0123456789"


def test_the_secret_comes_from_the_file_then_the_environment_then_the_api_key(tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv(pd_secret.ENV, raising=False)
    with pytest.raises(ValueError, match="LAPS_PD_SECRET"):
        pd_secret.resolve(None, None)
    assert pd_secret.resolve(None, "the-api-key") == "the-api-key"
    monkeypatch.setenv(pd_secret.ENV, GOOD + "env")
    assert pd_secret.resolve(None, "the-api-key") == GOOD + "env"
    f = tmp_path / "secret"
    f.write_text(GOOD + "file\n")
    assert pd_secret.resolve(str(f), "the-api-key") == GOOD + "file"
    f.write_text("short")
    with pytest.raises(ValueError, match="shorter"):
        pd_secret.resolve(str(f), None)
    with pytest.raises(ValueError, match="missing"):
        pd_secret.resolve(str(tmp_path / "missing"), None)


def test_matches_is_exact_and_takes_any_bytes():
    assert pd_secret.matches(GOOD, GOOD)
    for bad in (None, "", GOOD[:-1], GOOD + "x", "\udce9" * 30):
        assert not pd_secret.matches(bad, GOOD)


def test_a_split_router_refuses_to_start_without_a_secret(monkeypatch):
    from laps_jax.cluster import router_cli
    monkeypatch.delenv(pd_secret.ENV, raising=False)
    args = router_cli.build_parser().parse_args(
        ["--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"])
    with pytest.raises(ValueError, match="secret"):
        router_cli.make_router(args)
    monkeypatch.setenv(pd_secret.ENV, GOOD)
    assert router_cli.make_router(args).split.headers[pd_secret.HEADER] == GOOD


def test_the_launcher_makes_one_per_deployment_unless_given(monkeypatch):
    from laps_jax.cluster.router_cli import share_pd_secret
    monkeypatch.setenv(pd_secret.ENV, "x")  # (recorded: the one made below is undone)
    monkeypatch.delenv(pd_secret.ENV)
    share_pd_secret(["--api-key", "k" * 20], None, print)
    assert pd_secret.ENV not in os.environ  # the API key is the secret
    share_pd_secret(["--model", "builtin"], None, print)
    made = os.environ[pd_secret.ENV]
    assert len(made) >= 32
    share_pd_secret(["--model", "builtin"], None, print)
    assert os.environ[pd_secret.ENV] == made  # kept, not remade


@pytest.mark.slow
def test_a_prefill_instance_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if k != pd_secret.ENV}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "serve.py"), "--model",
                          "builtin", "--role", "prefill", "--port", "1"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "LAPS_PD_SECRET" in out.stderr, out.stderr[-2000:]
