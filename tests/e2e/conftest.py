"""End-to-end fixtures: one live `graphline serve` per deployment kind, shared by every e2e module."""
from __future__ import annotations

import sys

import pytest

from e2e_support import ARTIFACTS, REPO, TINY_ARGS, Server, graphline, start_server


@pytest.fixture(scope="session")
def artifacts():
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


def _start(kind: str) -> Server:
    if kind == "local":
        return start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--port", "0"))
    if kind == "dp2":
        # A private Ray head + `graphline serve --address` through the cluster script (what operators run),
        # scheduling ahead (`--overlap`): every e2e check also covers rounds submitted before the previous returned.
        env = {"GRAPHLINE_RAY_PORT": "0", "GRAPHLINE_RAY_NUM_CPUS": "4", "PYTHON": sys.executable,
               "GRAPHLINE": f"{sys.executable} -m launch"}
        return start_server(["bash", str(REPO / "launch" / "cluster.sh"), "up", *TINY_ARGS, "--dp", "2",
                             "--overlap", "--port", "0"], timeout=300, env=env)
    raise ValueError(kind)


_servers: dict[str, Server] = {}


@pytest.fixture(scope="session", params=["local", "dp2"])
def server(request) -> Server:
    """One live server per deployment kind, shared by every e2e module (started on first use)."""
    kind = request.param
    if kind not in _servers:
        _servers[kind] = _start(kind)
        _servers[kind].kind = kind
        request.addfinalizer(lambda: _stop(kind))
    srv = _servers[kind]
    if srv.proc.poll() is not None:
        pytest.fail(f"the {kind} server exited:\n{srv.output()[-5000:]}")
    return srv


def _stop(kind: str) -> None:
    srv = _servers.pop(kind, None)
    if srv is not None:
        srv.stop()
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"e2e-server-{kind}.log").write_text(srv.output())
