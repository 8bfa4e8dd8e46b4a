"""Benchmarks (not tests): TrainMover against checkpoint-restart, torchft and its own
ablations, side by side on the same job, and projected to large layouts.

One module per sub-command of ``trainmover bench`` (`downtime`, `rebalance`, `scale`),
the systems they compare (`trainmover_runs`, `ckpt_restart` + `ckpt_train`,
`torchft_peer` + `torchft_train`), and shared helpers (`report`, `plot`, `memory`,
`settings`). Every result is written as JSON, a Markdown table and a PNG plot.
"""
