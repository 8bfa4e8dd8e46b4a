"""A worker entry for the fork server's tests: what it does comes from FORK_TEST_MODE."""

import os
import sys
import time

import torch

mode = os.environ.get("FORK_TEST_MODE", "")
if __name__ == "__main__":
    print(f"entry {mode} pgid={os.getpgrp()} threads={torch.get_num_threads()}", flush=True)
    if mode == "exit3":
        sys.exit(3)
    if mode == "raise":
        raise ValueError("the entry failed")
    if mode == "rand":
        print("rand", torch.rand(3).tolist(), flush=True)
    if mode == "sleep":
        time.sleep(600)
