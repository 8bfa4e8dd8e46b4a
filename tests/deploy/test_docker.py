"""deploy/docker/Dockerfile builds the image the manifests name, with the pinned torch,
the service ports exposed and a numeric non-root user (the pods run runAsNonRoot).

No container engine runs here; the file is checked against the code and the manifests."""

from __future__ import annotations

import re

from tests.deploy.files import DEPLOY, ROOT
from trainmover import ports

COVERS = ["docker/Dockerfile"]

DOCKERFILE = DEPLOY / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_matches_the_code() -> None:
    ins = instructions()
    assert [v for k, v in ins if k == "ARG"] == ["TORCH_VERSION=2.13.0"]
    assert any(k == "FROM" and v.startswith("python:3.11") for k, v in ins)
    exposed = {int(p) for k, v in ins if k == "EXPOSE" for p in v.split()}
    assert exposed == {*ports.DEFAULT_HTTP_PORTS.values(), ports.RENDEZVOUS_PORT}
    (user,) = [v for k, v in ins if k == "USER"]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0 and gid.isdigit()
    assert ("ENTRYPOINT", '["trainmover"]') in ins
    # What it copies exists, and the tag in its build comment is the manifests' image.
    for k, v in ins:
        if k == "COPY":
            for src in v.split()[:-1]:
                assert (ROOT / src).exists(), src
    assert f"-t {ports.IMAGE} ." in DOCKERFILE.read_text()
