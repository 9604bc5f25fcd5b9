"""`triton-sidecar validate`: config, golden files and request schemas checked offline."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from sidecar.cli.arguments import (
    DEFAULT_GOLDEN_DIR,
    EXIT_OK,
    EXIT_USAGE,
    reporting_usage_errors,
)
from sidecar.config import CONFIG_SCHEMA, ConfigError, SidecarConfig, load_config
from sidecar.golden.cases import (
    GOLDEN_SUFFIXES,
    golden_file_problems,
)
from sidecar.messages import counted, short_message
from sidecar.serving.request_rules import load_request_rules


def add_validate_parser(commands: Any) -> None:
    validate = commands.add_parser(
        "validate",
        help="check the config, golden files and request schemas offline (no server)",
        description=(
            "Check, without a server, everything the sidecar reads at start-up: the config file\n"
            "(with SIDECAR_* overrides from the environment), every golden file, and every per-model\n"
            "JSON Schema listed under validation.schemas (each must be a valid Draft 2020-12 schema).\n"
            "Every problem is listed with its file and JSON path, not only the first.\n\n"
            "exit codes: 0 no problems; 2 problems found"
        ),
        epilog=(
            "examples:\n"
            "  triton-sidecar validate --golden-dir golden_requests\n"
            "  triton-sidecar validate --config /etc/triton-sidecar/sidecar.yaml\n"
            "  triton-sidecar validate --config k8s/base/sidecar.yaml --golden-dir golden_requests\n"
            "      (a deployment's config names golden_dir inside the pod: point --golden-dir at the\n"
            "      repository's copy)"
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument("--config", type=Path, metavar="FILE", help="YAML config file (default: defaults)")
    validate.add_argument("--golden-dir", type=Path, metavar="DIR",
                          help="golden directory (default: the config's golden_dir, else golden_requests)")
    validate.set_defaults(handler=reporting_usage_errors(_cmd_validate))


@dataclass
class ValidationReport:
    problems: list[str]
    notes: list[str]
    config: str
    golden_dir: Path
    golden_files: int = 0
    models: int = 0
    schemas: int = 0


def _cmd_validate(args: argparse.Namespace) -> int:
    report = validate_files(args.config, args.golden_dir)
    for problem in report.problems:
        print(problem)
    for note in report.notes:
        print(f"note: {note}")
    checked = (f"config {report.config}, {counted(report.golden_files, 'golden file')} for "
               f"{counted(report.models, 'model')} in {report.golden_dir}, "
               f"{counted(report.schemas, 'request schema')}")
    if report.problems:
        print(f"validate: {counted(len(report.problems), 'problem')} ({checked})")
        return EXIT_USAGE
    print(f"validate: OK ({checked})")
    return EXIT_OK


def validate_files(config_path: Path | None, golden_dir: Path | None) -> ValidationReport:
    """Every problem in the config, the golden files and the request schemas, each naming its file."""
    config, raw, problems = _config_problems(config_path)
    given_golden_dir = golden_dir is not None
    if golden_dir is None:
        golden_dir = config.golden_dir if config is not None else Path(
            raw["golden_dir"] if isinstance(raw.get("golden_dir"), str) else DEFAULT_GOLDEN_DIR)
    report = ValidationReport(problems, [], str(config_path) if config_path else "defaults", golden_dir)
    _check_golden_dir(golden_dir, report, named_by=None if given_golden_dir else config_path)
    if config is not None:
        schemas: Mapping[str, Any] = config.validation.schemas
    else:
        section = raw.get("validation")
        found = section.get("schemas") if isinstance(section, dict) else None
        schemas = {m: f for m, f in found.items() if isinstance(f, str)} if isinstance(found, dict) else {}
    for model, file in schemas.items():
        report.schemas += 1
        report.problems.extend(_schema_problems(model, Path(file)))
    return report


def _config_problems(path: Path | None) -> tuple[SidecarConfig | None, dict[str, Any], list[str]]:
    """The loaded config (None if it does not load), the file's raw mapping, and every problem.

    `load_config` stops at the first problem; the schema's remaining complaints about the file are
    added so that one run lists all of them.
    """
    try:
        return load_config(path), _raw_config(path) if path else {}, []
    except ConfigError as e:
        first = str(e)
    raw = _raw_config(path) if path else {}
    problems = [first]
    validator = jsonschema.Draft202012Validator(CONFIG_SCHEMA)
    for error in sorted(validator.iter_errors(raw), key=lambda e: list(e.absolute_path)):
        for problem in _config_error_lines(str(path), error):
            if problem not in problems:
                problems.append(problem)
    return None, raw, problems


def _raw_config(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}  # load_config has named the problem already
    return data if isinstance(data, dict) else {}


def _config_error_lines(source: str, error: jsonschema.ValidationError) -> list[str]:
    # Worded as sidecar.config words them, so the first problem is not listed twice.
    key_path = ".".join(str(p) for p in error.absolute_path)
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known_keys = error.schema.get("properties", {})
        known = ", ".join(sorted(known_keys))
        return [f"{source}: unknown key {'.'.join(p for p in (key_path, extra) if p)!r} (known here: {known})"
                for extra in sorted(set(error.instance) - set(known_keys))]
    return [f"{source}: key {key_path or '(top level)'!r}: {short_message(error.message)}"]


def _check_golden_dir(golden_dir: Path, report: ValidationReport, *, named_by: Path | None) -> None:
    if not golden_dir.is_dir():
        if named_by is not None and golden_dir.is_absolute():
            # A deployment's config (k8s/base/sidecar.yaml) names where the pod mounts the golden
            # files, which a CI machine or a laptop does not have: say so, and how to check the
            # repository's copy instead.
            report.problems.append(
                f"{golden_dir}: golden directory not found (golden_dir in {named_by}; a path inside the pod? "
                f"pass --golden-dir with the repository's copy, e.g. --golden-dir {DEFAULT_GOLDEN_DIR})")
        else:
            report.problems.append(f"{golden_dir}: golden directory not found")
        return
    for model_dir in sorted(p for p in golden_dir.iterdir() if p.is_dir() and not p.name.startswith(".")):
        report.models += 1
        files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
        golden_files = [p for p in files if p.suffix in GOLDEN_SUFFIXES]
        for ignored in (p for p in files if p.suffix not in GOLDEN_SUFFIXES):
            report.notes.append(f"{ignored}: ignored (golden files end in {', '.join(GOLDEN_SUFFIXES)})")
        if not golden_files:
            report.notes.append(f"{model_dir}: no golden files: the sidecar will only check readiness")
        by_name: dict[str, Path] = {}
        for path in golden_files:
            if path.stem in by_name:
                report.problems.append(f"{path}: case name {path.stem!r} is also used by {by_name[path.stem]}")
            by_name.setdefault(path.stem, path)
            report.golden_files += 1
            report.problems.extend(golden_file_problems(path, model=model_dir.name))


def _schema_problems(model: str, path: Path) -> list[str]:
    """The schema file read by the sidecar's own loader: what stops the start stops `validate`, with
    the same line."""
    try:
        load_request_rules(path, model=model)
    except ConfigError as e:
        return [str(e)]
    return []


