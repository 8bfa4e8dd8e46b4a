"""The chaos soak (`trainmover chaos`): random faults on a local cluster, with invariants.

Modules, one job each:
    faults      the fault kinds: inject one, say what recovery means for it
    observer    what the soak sees of the cluster on the bus (steps, heartbeats, progress)
    invariants  the checks after each recovery (replicas, standby accounting), pure
    soak        the loop, recovery waits, the reference comparison and the summary
"""
