"""`python -m trainmover.services.health_monitor [flags]`."""

import sys

from trainmover.services.health_monitor import main

sys.exit(main())
