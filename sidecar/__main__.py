import sys

from sidecar.cli.main import main

sys.exit(main())
