"""`python -m trainmover.services.executor [flags]`."""

import sys

from trainmover.services.executor import main

sys.exit(main())
