"""Packages and their folders (everything else is in pyproject.toml).

``patchsets/`` ships as ``gdn_backport.patchsets``: each folder in it is one
patchset package, found here as the registry finds it at run time, so a
new fix is a new folder and no list to edit. ``matrix/`` ships as
``gdn_backport._matrix`` (data), the kernel package as ``gdn_backport_kernels``.
"""

from setuptools import find_packages, setup

PATCHSETS = ["gdn_backport.patchsets"] + [
    f"gdn_backport.patchsets.{name}" for name in find_packages("patchsets")
]

setup(
    packages=[
        *find_packages(include=["gdn_backport", "gdn_backport.*"]),
        *PATCHSETS,
        "gdn_backport._matrix",
        "gdn_backport_kernels",
    ],
    package_dir={
        "gdn_backport.patchsets": "patchsets",
        "gdn_backport._matrix": "matrix",
        "gdn_backport_kernels": "kernels/gdn_backport_kernels",
    },
    package_data={
        "gdn_backport": ["py.typed"],
        "gdn_backport._matrix": ["*.toml"],
        "gdn_backport_kernels": ["py.typed"],
        **{name: ["*.toml"] for name in PATCHSETS},
    },
)
