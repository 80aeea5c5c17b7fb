"""Builds the native shared-memory extension from native/ (see native/README.md)."""
import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmdisagg._native",
            sources=["native/_native.c", "native/hash.c", "native/sha256.c", "native/hashcache.c", "native/index.c", "native/picks.c"],
            depends=sorted(glob.glob("native/*.h")),  # rebuild when a header changes
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
)
