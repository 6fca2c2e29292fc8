"""Helpers shared by the deployment tests: YAML loading, the vendored schemas, polling."""

from __future__ import annotations

import copy
import functools
import json
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / "tests" / "schemas"


def load_all(path: Path) -> list[dict]:
    """Every non-empty YAML document of ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def strict(schema):
    """Copy of an OpenAPI schema that rejects unknown fields wherever the schema lists its fields.

    The API server prunes unknown fields of custom resources silently, so a misspelt
    ``sampelLimit`` would vanish without a trace; ``kubectl --validate=strict`` rejects it, and so
    does this.
    """
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@functools.cache
def crd_validators() -> dict[tuple[str, str], jsonschema.protocols.Validator]:
    """(apiVersion, kind) -> validator of the vendored Prometheus Operator CRDs."""
    validators = {}
    for path in sorted((SCHEMAS / "prometheus-operator").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = strict(version["schema"]["openAPIV3Schema"])
            validators[(f"{group}/{version['name']}", kind)] = jsonschema.Draft7Validator(schema)
    return validators


@functools.cache
def compose_validator() -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / "compose-spec" / "compose-spec.json").read_text())
    # The file names draft 7 as an https URL, which validator_for() does not recognise.
    return jsonschema.Draft7Validator(schema)


def wait_for(predicate, timeout: float, what: str, procs=(), log: Path | None = None):
    """Poll ``predicate`` (an OSError counts as not yet) until it is truthy; fail the test on
    timeout with ``log``'s tail, or at once when one of ``procs`` exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                pytest.fail(f"{p.args[3:5]} exited with {p.returncode} while waiting for {what}")
        try:
            result = predicate()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.25)
    extra = f"\n{log.read_text()[-3000:]}" if log and log.exists() else ""
    pytest.fail(f"timed out after {timeout:g}s waiting for {what}{extra}")
