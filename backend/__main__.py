"""`python -m backend`: same as the `eagle3-host` command."""

import sys

from backend.cli import main

sys.exit(main())
