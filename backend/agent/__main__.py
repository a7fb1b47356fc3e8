"""`python -m backend.agent`: the agent the console starts on a host."""

import sys

from backend.agent.server import main

sys.exit(main())
