"""A worker process that takes its time to start (as on a loaded host: each imports
torch), then runs the reference job; a sidecar test's entry point."""

import sys
import time

from trainmover.runtime.reference import main

if __name__ == "__main__":
    time.sleep(4.0)  # longer than the sidecar's command timeout in the test
    sys.exit(main())
