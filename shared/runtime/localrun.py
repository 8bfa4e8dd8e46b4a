"""Run a job locally and migrate machines from the command line, over `LocalJob`:
``python -m trainmover.runtime.localrun --config job.yaml --standbys 1 --migrate m0=s0@20``."""

from __future__ import annotations

from pathlib import Path

from trainmover.localjob import LocalJob


def main(argv: list[str] | None = None) -> int:
    """Prints each migration's plan, switch step and rebuilt groups, then the losses."""
    import argparse
    import json
    import tempfile

    from trainmover.runtime.config import load_config

    parser = argparse.ArgumentParser(description="Run a job locally and migrate machines.")
    parser.add_argument("--config", type=Path, required=True, help="job config (YAML/JSON)")
    parser.add_argument("--standbys", type=int, default=1)
    parser.add_argument("--run-dir", type=Path, help="logs and states (default: a temp dir)")
    parser.add_argument(
        "--migrate",
        action="append",
        default=[],
        metavar="LEAVER=JOINER@STEP",
        help="a planned migration; several in one plan: m0=s0,m1=s1@20",
    )
    args = parser.parse_args(argv)
    config = load_config(args.config)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="trainmover-"))
    with LocalJob.launch(config, run_dir, standbys=args.standbys) as job:
        for spec in args.migrate:
            pairs, _, step = spec.partition("@")
            moves = dict(pair.split("=", 1) for pair in pairs.split(","))
            report = job.migrate(moves, at_step=int(step) if step else None)
            print(
                json.dumps(
                    {
                        "plan": report.plan.plan_id,
                        "step": report.commit_step,
                        "rebuilt": [g.name for g in report.plan.groups],
                    }
                )
            )
        job.finish()
        losses = job.losses()
    print(
        json.dumps(
            {
                "run_dir": str(run_dir),
                "steps": len(losses),
                "first_loss": losses.get(1),
                "last_loss": losses.get(max(losses)),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
