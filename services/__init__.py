"""TrainMover's services: one folder each (health_monitor, planner, executor, sidecar)."""
