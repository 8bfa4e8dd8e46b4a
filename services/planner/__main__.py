"""`python -m trainmover.services.planner [flags]`."""

import sys

from trainmover.services.planner import main

sys.exit(main())
