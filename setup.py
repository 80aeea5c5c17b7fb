"""Builds the native shared-memory extension from native/ (see native/README.md)."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shmdisagg._native",
            sources=["native/_native.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter"],
        )
    ],
)
