"""TrainMover: move a machine's role to a pre-warmed standby instead of restarting the job."""

__version__ = "0.1.0"
