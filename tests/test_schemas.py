"""docs/schemas/ is generated from the models and must not go stale."""

from __future__ import annotations

import json

from trainmover import schemas
from trainmover.messages import SCHEMA_VERSION


def test_published_schemas_are_current():
    assert schemas.stale() == [], "run `make schemas` and commit docs/schemas/"


def test_stale_detection(tmp_path):
    schemas.write(tmp_path)
    assert schemas.stale(tmp_path) == []
    drain = tmp_path / "drain_event.json"
    body = json.loads(drain.read_text())
    body["properties"]["deadline_s"] = {"type": "string"}
    drain.write_text(json.dumps(body))
    (tmp_path / "retired_message.json").write_text("{}")
    (tmp_path / "plan.json").unlink()
    assert schemas.stale(tmp_path) == ["drain_event.json", "plan.json", "retired_message.json"]
    assert schemas.main(["--check", "--dir", str(tmp_path)]) == 1


def test_schema_pins_the_version():
    body = json.loads(schemas.render()["drain_event.json"])
    assert body["$id"].startswith(f"trainmover/v{SCHEMA_VERSION}/")
    assert set(body["required"]) >= {"job", "machine"}
