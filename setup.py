"""The one thing pyproject.toml cannot say: the optional C module (kvstore/_rowsearch.c).

``optional``: without a C compiler or Python's headers the install goes on without it, and
kvstore.rowsearch does the same work in NumPy (``python -m kvstore info`` says which).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvstore._rowsearch",
            ["kvstore/_rowsearch.c"],
            optional=True,
            extra_compile_args=["-O2"],
        )
    ]
)
