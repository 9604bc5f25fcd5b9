"""The documentation stays true: every config key is in docs/configuration.md and the example file,
every refusal reason is in docs/errors.md with its status and code, the README opens with the two
commands CI runs, every relative link leads somewhere, and the README's Layout names every module."""

from __future__ import annotations

import os
import re
from pathlib import Path

from sidecar.config import CONFIG_SCHEMA

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()
CONFIGURATION = REPO / "docs" / "configuration.md"
ERRORS = REPO / "docs" / "errors.md"
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def _keys() -> list[str]:
    keys = []
    for name, spec in CONFIG_SCHEMA["properties"].items():
        if spec.get("type") == "object" and "properties" in spec:
            keys += [f"{name}.{key}" for key in spec["properties"]]
        else:
            keys.append(name)
    return keys


def test_every_config_key_is_documented_in_the_configuration_table():
    documented = set(re.findall(r"^\| `([a-z_.]+)` \|", CONFIGURATION.read_text(), flags=re.MULTILINE))
    missing = [k for k in _keys() if k not in documented]
    assert not missing, f"docs/configuration.md's table lacks {missing}"


def test_every_config_key_is_in_the_annotated_example_file():
    text = (REPO / "sidecar.example.yaml").read_text()
    for key in _keys():
        assert re.search(rf"^\s*{re.escape(key.split('.')[-1])}:", text, flags=re.MULTILINE), key


def test_readme_says_what_it_is_then_opens_with_the_demo_and_test_commands_and_ci_runs_the_test_command():
    before_commands = README.split("```")[0]
    title, what_it_is, *_ = before_commands.split("\n\n")
    assert title.startswith("# triton-sidecar")
    # One or two sentences first: what it is and for whom, before any command.
    assert "Triton" in what_it_is and "Kubernetes" in what_it_is and "make" not in what_it_is, what_it_is
    assert 1 <= what_it_is.count(". ") + what_it_is.rstrip().endswith(".") <= 2, what_it_is
    first_block = re.search(r"```\n(.*?)```", README, flags=re.DOTALL).group(1).split("\n")
    commands = [line for line in first_block if line.strip()]
    assert commands == ["make demo", "make test"]
    assert "fresh Debian" in before_commands and "Python 3.11" in before_commands
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_the_readme_and_the_testing_page_state_one_test_time():
    def minutes(text: str) -> set[str]:
        return set(re.findall(r"about\s+(\d+)\s+minutes\s+on\s+2\s+cores", text))

    in_readme, in_testing = minutes(README), minutes((REPO / "docs" / "testing.md").read_text())
    assert len(in_readme) == 1 and in_readme == in_testing, (in_readme, in_testing)


def test_the_error_table_gives_each_reason_its_http_status_and_grpc_code():
    from sidecar.serving.refusals import Reason

    rows = re.findall(r"^\| \(?(\d{3})\)? \| ([A-Z_]+) \| (`[a-z_]+`(?:, `[a-z_]+`)*) \|",
                      ERRORS.read_text(), flags=re.MULTILINE)
    documented = {}
    for status, code, reasons in rows:
        for name in re.findall(r"`([a-z_]+)`", reasons):
            documented[name] = (int(status), code)
    assert documented == {r.value: (r.http_status, r.grpc_code) for r in Reason}


# -- links ---------------------------------------------------------------------------------------

_FENCED = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans: `[x](y)` there is not a link."""
    return re.sub(r"`[^`\n]*`", "", _FENCED.sub("", text))


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    headings = re.findall(r"^#{1,6} +(.+?) *$", _FENCED.sub("", markdown), flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _broken_links(document: Path) -> list[str]:
    broken = []
    for target in _LINK.findall(_prose(document.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not a file here
            continue
        path, _, anchor = target.partition("#")
        linked = (document.parent / path).resolve() if path else document
        if not linked.exists():
            broken.append(f"{target} (no file {os.path.relpath(linked, REPO)})")
        elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(linked, REPO)})")
    return broken


def test_every_relative_link_in_the_readme_and_docs_leads_to_a_file_and_heading_that_exist():
    broken = {str(d.relative_to(REPO)): links for d in DOCUMENTS if (links := _broken_links(d))}
    assert not broken, f"broken links: {broken}"


_REPO_PATH = re.compile(r"`((?:sidecar|tests|bench|k8s|examples|golden_requests|docs)/[^`\s<>*{}]*)`")


def test_every_repository_path_the_docs_name_exists():
    """`sidecar/serving/core.py` in prose is a reference too: after a module moves, the docs must follow."""
    gone = {str(d.relative_to(REPO)): missing for d in DOCUMENTS
            if (missing := sorted({p for p in _REPO_PATH.findall(_FENCED.sub("", d.read_text()))
                                   if not (REPO / p).exists()}))}
    assert not gone, f"the docs name paths that do not exist: {gone}"


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Roll out\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#roll-out) [gone](missing.md) [no heading](other.md#nope) "
                    "`[code](missing.md)` [web](https://example.com/x.md)\n")
    assert [link.split(" ")[0] for link in _broken_links(page)] == ["missing.md", "other.md#nope"]


# -- layout --------------------------------------------------------------------------------------


def _layout_modules() -> set[str]:
    """Modules the README's Layout table names: a row's first path is its package (`sidecar/serving/`)
    or a module in it (`sidecar/config.py`); bare names in the row (`core.py`) are in that package."""
    section = README.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = set()
    for row in re.findall(r"^\| `(sidecar/[^`]*)`(.*)$", section, flags=re.MULTILINE):
        first, rest = row
        package = first if first.endswith("/") else first.rsplit("/", 1)[0] + "/"
        for name in [first, *re.findall(r"`([\w/]+\.py)`", rest)]:
            if name.endswith(".py"):
                named.add(name if name.startswith("sidecar/") else package + name)
    return named


def test_the_readme_layout_names_every_module_and_no_module_that_is_gone():
    modules = {str(p.relative_to(REPO)) for p in (REPO / "sidecar").glob("**/*.py") if p.name != "__init__.py"}
    named = _layout_modules()
    assert not modules - named, f"README's Layout table does not name {sorted(modules - named)}"
    assert not named - modules, f"README's Layout table names modules that do not exist: {sorted(named - modules)}"
