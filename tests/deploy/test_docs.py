"""docs/operations.md and docs/integration.md say what the code and deploy/ do: every
metric, alert, event kind, migration state and subject is documented; every path and
command they show exists and parses."""

from __future__ import annotations

import ast
import re
import shlex
import typing

import pytest

from tests.deploy.files import DEPLOY, OWNED_ELSEWHERE, ROOT, load_yaml
from trainmover import client, metric_names
from trainmover.cli import _parser
from trainmover.messages import EVENT_KINDS, MigrationState
from trainmover.subjects import JobSubjects

OPERATIONS = ROOT / "docs" / "operations.md"
INTEGRATION = ROOT / "docs" / "integration.md"
DOCS = [OPERATIONS, INTEGRATION, ROOT / "docs" / "alerts.md"]


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_every_metric_is_documented() -> None:
    text = OPERATIONS.read_text()
    missing = [m for m in metric_names.ALL if f"`{m}`" not in text]
    assert not missing, f"docs/operations.md lacks {missing}"


def test_every_shipped_alert_is_documented() -> None:
    text = OPERATIONS.read_text()
    groups = load_yaml(DEPLOY / "prometheus" / "trainmover-alerts.yaml")["groups"]
    missing = [r["alert"] for g in groups for r in g["rules"] if f"`{r['alert']}`" not in text]
    assert not missing, f"docs/operations.md lacks alerts {missing}"


def test_every_event_kind_state_and_subject_is_documented() -> None:
    text = OPERATIONS.read_text()
    assert all(f"`{kind}`" in text for kind in EVENT_KINDS)
    states = typing.get_args(MigrationState)
    assert not [s for s in states if f"`{s}`" not in text]
    subjects = JobSubjects("JOB")
    for subject in (subjects.events, subjects.progress, subjects.deadletter, subjects.plans):
        assert subject.replace("JOB", "<job>") in text, subject


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_deploy_paths_in_docs_exist(doc: typing.Any) -> None:
    for path in set(re.findall(r"deploy/[\w./{},-]*[\w}]", doc.read_text())):
        # deploy/systemd/trainmover-{a,b}.service: each alternative must exist.
        head, brace, rest = path.partition("{")
        names = [path]
        if brace:
            options, _, tail = rest.partition("}")
            names = [head + o + tail for o in options.split(",")]
        for name in names:
            if name.split("/")[1] in OWNED_ELSEWHERE:
                continue  # deploy/nats/ comes with the bus-security work, tested there
            assert (ROOT / name).exists(), f"{doc.name} names {name}, which does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_cli_commands_in_docs_parse(doc: typing.Any) -> None:
    """Every `trainmover ...` line of a shell example is accepted by the real CLI parser."""
    parser = _parser()
    for block in code_blocks(doc.read_text(), "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("trainmover "):
                argv = shlex.split(line)[1:]
                try:
                    parser.parse_args(argv)
                except SystemExit:
                    raise AssertionError(f"{doc.name}: `{line}` does not parse") from None


def test_python_examples_compile_and_use_the_client_api() -> None:
    for block in code_blocks(OPERATIONS.read_text(), "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "trainmover.client":
                for alias in node.names:
                    assert hasattr(client, alias.name), alias.name
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "tm":
                    assert hasattr(client.TrainMoverClient, node.attr), node.attr


def test_integration_doc_keeps_the_section_for_the_runtime_api() -> None:
    text = INTEGRATION.read_text()
    begin = text.index("<!-- BEGIN runtime API")
    assert text.index("<!-- END runtime API -->") > begin
    assert "wrap your loop with the trainmover runtime" in text.lower()
