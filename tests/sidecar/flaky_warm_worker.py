"""A worker process whose first warm-up fails, as when the recordings it replays cannot
be read while the bus is away; then it runs the reference job. A sidecar test's entry
point: each failure is noted in $TM_RUN_DIR/warm_failures."""

import os
import sys
from pathlib import Path
from typing import Any

from trainmover.runtime import shadow
from trainmover.runtime.reference import main

_run_shadow = shadow.run_shadow
_failed = False


def _first_fails(*args: Any, **kwargs: Any) -> Any:
    global _failed
    if not _failed:
        _failed = True
        with open(Path(os.environ["TM_RUN_DIR"]) / "warm_failures", "a") as f:
            f.write(f"{os.getpid()}\n")
        raise ConnectionError("the recordings could not be read (the bus is away)")
    return _run_shadow(*args, **kwargs)


if __name__ == "__main__":
    shadow.run_shadow = _first_fails
    sys.exit(main())
