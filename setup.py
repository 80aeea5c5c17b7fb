"""Builds the native shared-memory extension from native/ (see native/README.md)."""

import glob

from setuptools import Extension, find_packages, setup

setup(
    # here rather than in pyproject's [tool.setuptools]: setuptools < 69 warns on every build
    # that that table is beta (the venv's own setuptools runs build_ext --inplace)
    packages=find_packages(include=["shmdisagg*"]),
    # The packages' root is the repository root. Said out loud, setuptools' editable install
    # (pip install -e .) adds that root to sys.path with a plain .pth file; left implicit, it
    # installs a meta-path finder instead and warns on every install ("Please be careful with
    # folders in your working directory with the same name as your package").
    package_dir={"": "."},
    ext_modules=[
        Extension(
            "shmdisagg._native",
            sources=[
                "native/_native.c",
                "native/hash.c",
                "native/sha256.c",
                "native/hashcache.c",
                "native/index.c",
                "native/picks.c",
                "native/sse.c",
                "native/json_span.c",
                "native/json_ids.c",
                "native/mapping.c",
            ],
            depends=sorted(glob.glob("native/*.h")),  # rebuild when a header changes
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
)
