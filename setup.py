"""Package discovery that pyproject.toml alone cannot express.

NOTE: the CLI lives in ./cli but installs as `metrale_jax_cli`, never as a bare `cli` package in
site-packages; every other package is found under its own name.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(
        include=["metrale_jax", "metrale_jax.*", "kernels_pallas", "kernels_pallas.*", "kernels_cpu", "kernels_cpu.*"]
    )
    + ["metrale_jax_cli"],
    package_dir={"metrale_jax_cli": "cli"},
)
