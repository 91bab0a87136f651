"""Only the optional C part of the build; everything else is in pyproject.toml.

``distdiag/shim/preload/interpose.c`` is the LD_PRELOAD interposer for libc file calls
(see distdiag/shim/preload/__init__.py), ``_binding.c`` the module the shim calls it
through; ``distdiag/shim/_hot.c`` the mpi4py hook's wrappers of blocking calls and the
recorder's per-thread buffer. The interposer is built as a setuptools extension for the
compiler and flags setuptools knows, but it is no Python module (no PyInit; it is loaded
by the dynamic loader, never imported). ``optional=True``: a machine without a compiler,
or where it does not build, still installs, and the file hook records at the Python level.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "distdiag.shim.preload._interpose",
            sources=["distdiag/shim/preload/interpose.c"],
            extra_compile_args=["-O2", "-fvisibility=hidden", "-std=gnu11", "-Wno-nonnull-compare",
                                "-Werror=implicit-function-declaration", "-Werror=int-conversion"],
            extra_link_args=["-ldl", "-lpthread"],
            optional=True,
        ),
        # the Python side's handle on it (no ctypes in the program's process)
        Extension(
            "distdiag.shim.preload._binding",
            sources=["distdiag/shim/preload/_binding.c"],
            extra_link_args=["-ldl"],
            optional=True,
        ),
        # the recorder's thread buffer and the mpi4py hook's blocking-call wrappers in C
        # (distdiag/shim/_hot.c); without it the same objects are pure Python
        Extension(
            "distdiag.shim._hot",
            sources=["distdiag/shim/_hot.c"],
            extra_compile_args=["-O2", "-std=gnu11", "-Werror=implicit-function-declaration",
                                "-Werror=int-conversion", "-Werror=incompatible-pointer-types"],
            optional=True,
        ),
    ],
)
