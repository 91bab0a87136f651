"""Only the optional C part of the build; everything else is in pyproject.toml.

``distdiag/shim/preload/interpose.c`` is the LD_PRELOAD interposer for libc file calls
(see distdiag/shim/preload/__init__.py), ``_binding.c`` the module the shim calls it
through; ``distdiag/shim/_hot.c`` the mpi4py hook's wrappers of blocking calls and the
recorder's per-thread buffer. The interposer is built as a setuptools extension for the
compiler and flags setuptools knows, but it is no Python module (no PyInit; it is loaded
by the dynamic loader, never imported). ``optional=True``: a machine without a compiler,
or where it does not build, still installs, and the file hook records at the Python level.
"""

import json
import os
import subprocess
import sys

from setuptools import Extension, setup


def _torch_kernel() -> list[Extension]:
    """``distdiag/shim/hooks/_ddpk.cpp``, the C++ kernel that records DDP's buckets on CPU
    (distdiag/shim/hooks/torch_dist.py), built against the torch of the interpreter that
    installs distdiag, or nothing where that interpreter has no torch (the shim then uses
    the Python kernel). torch is asked through ``python -I``: pip's build isolation hides
    the installed packages behind PYTHONPATH, which isolated mode ignores. The module
    carries the torch version it was built for and is used only with that one.
    DISTDIAG_BUILD_DDP_KERNEL=0 skips it."""
    if os.environ.get("DISTDIAG_BUILD_DDP_KERNEL", "1") == "0":
        return []
    code = ("import json, torch, torch.utils.cpp_extension as c; print(json.dumps(dict(version=torch.__version__, "
            "include=c.include_paths(), lib=c.library_paths(), abi=int(torch._C._GLIBCXX_USE_CXX11_ABI))))")
    try:
        out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=600, check=True)
        t = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:
        return []
    return [
        Extension(
            "distdiag.shim.hooks._ddpk",
            sources=["distdiag/shim/hooks/_ddpk.cpp"],
            language="c++",
            include_dirs=t["include"],
            library_dirs=t["lib"],
            runtime_library_dirs=t["lib"],
            libraries=["c10", "torch_cpu"],
            define_macros=[("DDPK_TORCH_VERSION", json.dumps(t["version"])),
                           ("_GLIBCXX_USE_CXX11_ABI", str(t["abi"]))],
            extra_compile_args=["-O2", "-std=c++17", "-fvisibility=hidden"],
            optional=True,
        )
    ]


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
            extra_link_args=["-ldl"],  # dlsym: the interposer's dd_site (glibc < 2.34 keeps it in libdl)
            optional=True,
        ),
        *_torch_kernel(),
    ],
)
