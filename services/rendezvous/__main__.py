"""`python -m trainmover.services.rendezvous [flags]`."""

import sys

from trainmover.services.rendezvous import main

sys.exit(main())
