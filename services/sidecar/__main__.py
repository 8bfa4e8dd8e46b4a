"""`python -m trainmover.services.sidecar [flags]`."""

import sys

from trainmover.services.sidecar import main

sys.exit(main())
