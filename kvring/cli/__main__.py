"""``python -m kvring.cli ...``: what the container image and the local cluster run."""

import sys

from kvring.cli.main import main

sys.exit(main())
