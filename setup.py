"""Maps the repository's layout onto the `trainmover` import package.

shared/   -> trainmover            (schemas, bus helpers, runtime library, client, CLI)
services/ -> trainmover.services   (health_monitor, planner, executor, sidecar)
examples/ -> trainmover.examples   (training scripts run under TrainMover, each one tested)

Everything else lives in pyproject.toml.
"""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "trainmover": "shared",
    "trainmover.services": "services",
    "trainmover.examples": "examples",
}

packages = [
    f"{name}.{sub}" if sub else name
    for name, folder in PACKAGE_DIRS.items()
    for sub in ["", *find_packages(folder)]
]

setup(packages=packages, package_dir=PACKAGE_DIRS, package_data={"trainmover": ["py.typed", "statuspage.html"]})
