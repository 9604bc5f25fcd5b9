"""The command line: `run`, `demo`, `check`, `record`, `validate`.

structlog imports rich (and with it pygments) whenever rich is installed, for the pretty tracebacks
of its development console. The sidecar logs JSON, and its console format prints plain tracebacks;
the pod's image has no rich at all (it comes into a development venv with nvidia-pytriton's typer
and import-linter). So the command line keeps it out before anything imports structlog: 4.2 MB of
resident memory less at idle (issue 18's budget is 80 MB; bench/RESULTS.md §4c).
"""

import sys

if "rich" not in sys.modules:  # already imported by the caller (a test runner's plugin): leave it
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` raises ImportError
