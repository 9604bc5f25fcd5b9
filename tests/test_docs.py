"""The documentation stays true: every config key is in the README table and the example file,
and the README opens with the two commands CI runs."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.config import CONFIG_SCHEMA

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def _keys() -> list[str]:
    keys = []
    for name, spec in CONFIG_SCHEMA["properties"].items():
        if spec.get("type") == "object" and "properties" in spec:
            keys += [f"{name}.{key}" for key in spec["properties"]]
        else:
            keys.append(name)
    return keys


def test_every_config_key_is_documented_in_the_readme_table():
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", README, flags=re.MULTILINE))
    missing = [k for k in _keys() if k not in documented]
    assert not missing, f"README's configuration table lacks {missing}"


def test_every_config_key_is_in_the_annotated_example_file():
    text = (REPO / "sidecar.example.yaml").read_text()
    for key in _keys():
        assert re.search(rf"^\s*{re.escape(key.split('.')[-1])}:", text, flags=re.MULTILINE), key


def test_readme_opens_with_the_demo_and_test_commands_and_ci_runs_the_test_command():
    first_block = re.search(r"```\n(.*?)```", README, flags=re.DOTALL).group(1).split("\n")
    commands = [line for line in first_block if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_error_table_gives_each_reason_its_http_status_and_grpc_code():
    from sidecar.serving.refusals import Reason

    rows = re.findall(r"^\| \(?(\d{3})\)? \| ([A-Z_]+) \| (`[a-z_]+`(?:, `[a-z_]+`)*) \|", README, flags=re.MULTILINE)
    documented = {}
    for status, code, reasons in rows:
        for name in re.findall(r"`([a-z_]+)`", reasons):
            documented[name] = (int(status), code)
    assert documented == {r.value: (r.http_status, r.grpc_code) for r in Reason}
