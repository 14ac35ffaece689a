"""Packaging glue: the top-level folders are the parts, imported as kvfleet.<part> (docs/architecture.md §2).

pyproject.toml holds the metadata; this file only computes the package list, since
setuptools' declarative config cannot prefix subpackages found under a mapped folder.
"""

from setuptools import find_packages, setup

PARTS = {
    "kvfleet": "kvfleet",
    "kvfleet.engine": "engine",
    "kvfleet.router": "router",
    "kvfleet.operator": "operator",
}

# kvfleet/engine, kvfleet/router and kvfleet/operator are symlinks to the parts (for tools that read
# the tree as it is); the mapping above is what builds and installs, so the walk skips them.
LINKED = [f"{part}{tail}" for part in ("engine", "router", "operator") for tail in ("", ".*")]
# The operator's test kit (operator/testing) needs the dev extras and a checkout: not in the wheel.
EXCLUDED = {"kvfleet": LINKED, "kvfleet.operator": ["testing", "testing.*"]}
packages: list[str] = []
for name, path in PARTS.items():
    packages.append(name)
    packages.extend(f"{name}.{sub}" for sub in find_packages(path, exclude=EXCLUDED.get(name, ())))

# The native CPU decode kernel ships as C source and is compiled on the user's machine at first use.
PACKAGE_DATA = {
    "kvfleet.engine.kernels.native": ["csrc/*.c", "csrc/*.h"],
    "kvfleet.cluster": ["build.sh", "kwok-stages.yaml", "*.c"],
}

setup(packages=packages, package_dir=dict(PARTS), package_data=PACKAGE_DATA, include_package_data=True)
