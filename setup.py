"""The one thing pyproject.toml cannot say without setuptools' experimental table:
PrefixIndex's per-block loops in C (kvbus/routing/_ckernels.c; ~1.6x faster event apply,
bench/bench_index_peers.py). Optional: without a C compiler the install goes on and
kvbus runs the same loops in Python (kvbus/routing/_kernels.py)."""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("kvbus.routing._ckernels", ["kvbus/routing/_ckernels.c"], optional=True)]
)
