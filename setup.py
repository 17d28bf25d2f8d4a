"""Build fastamp and its native extension ``fastamp._C``.

The C++ CPU kernels are always compiled. The CUDA kernels are added only when both a
CUDA toolkit (``nvcc``) and a CUDA-enabled torch are present; whether a GPU is visible
does not matter. ``FASTAMP_NO_EXT=1`` skips the extension (the torch reference then runs),
``FASTAMP_NO_CUDA=1`` skips only the CUDA part; ``FASTAMP_REQUIRE_CUDA=1`` makes a CUDA
build that cannot happen an error instead of a CPU-only build. With no GPU visible and no
``TORCH_CUDA_ARCH_LIST``, the CUDA kernels are built for sm_80 and sm_90 (+PTX); the
toolkit is found even behind an ``nvcc`` wrapper script. What was decided is printed.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

import setuptools
from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[fastamp setup] {msg}", file=sys.stderr, flush=True)


# Without a visible GPU torch cannot detect an arch (its detection raises IndexError): build
# for the GPUs fastamp targets (A100 sm_80, H100/H200 sm_90) plus PTX that newer GPUs JIT.
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"


def _find_nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


def _nvcc_release(nvcc):
    """``(major, minor)`` of the toolkit behind ``nvcc``, or None."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _toolkit_root(nvcc):
    """The toolkit folder holding ``include/cuda_runtime.h``.

    The ``nvcc`` on PATH may be a wrapper script (torch then takes the parent of its folder
    as CUDA_HOME, which has no headers); nvcc itself says where it lives (``--dryrun``
    prints ``_HERE_``, the folder of the real binary).
    """
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    try:
        probe = subprocess.run(
            [nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
            capture_output=True,
            text=True,
            timeout=60,
        )
        here = re.search(r"^#\$ _HERE_=(.+)$", probe.stdout + probe.stderr, flags=re.M)
        if here:
            candidates.append(os.path.dirname(here.group(1).strip()))
    except (OSError, subprocess.SubprocessError):
        pass
    for root in candidates:
        if root and os.path.exists(os.path.join(root, "include", "cuda_runtime.h")):
            return os.path.realpath(root)
    return None


def _prepare_cuda(torch, cpp_extension):
    """Find the toolkit and pick the arch list; returns why CUDA cannot be built, or None.

    Sets CUDA_HOME (for torch's build helpers) and TORCH_CUDA_ARCH_LIST when they are missing.
    """
    nvcc = _find_nvcc()
    if nvcc is None:
        return "no nvcc on PATH or in CUDA_HOME"
    root = _toolkit_root(nvcc)
    if root is None:
        return f"found {nvcc} but no toolkit with include/cuda_runtime.h beside it (set CUDA_HOME)"
    release = _nvcc_release(nvcc)
    torch_major = int(torch.version.cuda.split(".")[0])
    if release is None:
        return f"could not read the CUDA release from {nvcc} --version"
    if release[0] != torch_major:
        return (
            f"nvcc is CUDA {release[0]}.{release[1]} but torch {torch.__version__} was built with CUDA "
            f"{torch.version.cuda}; the major versions must match"
        )
    os.environ["CUDA_HOME"] = root
    cpp_extension.CUDA_HOME = root
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        try:
            visible = torch.cuda.device_count()
        except RuntimeError:
            visible = 0
        if visible == 0:
            os.environ["TORCH_CUDA_ARCH_LIST"] = DEFAULT_ARCH_LIST
            _log(f"no GPU visible: TORCH_CUDA_ARCH_LIST={DEFAULT_ARCH_LIST} (set it to choose others)")
    return None


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


def _extensions():
    if os.environ.get("FASTAMP_NO_EXT") == "1":
        _log("FASTAMP_NO_EXT=1: not building fastamp._C (the torch reference backend will run)")
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _log("torch is not importable: not building fastamp._C; install torch first and use --no-build-isolation")
        return [], {}

    sources = _rel(
        glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp"))
    )
    cxx_flags = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-DFASTAMP_WITH_CPU=1"]
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
    nvcc_flags = ["-O3", "-std=c++17", "--fmad=false", "-DFASTAMP_WITH_CUDA=1", "-lineinfo"]

    torch_cuda = torch.version.cuda
    want_cuda = os.environ.get("FASTAMP_NO_CUDA") != "1"
    require_cuda = os.environ.get("FASTAMP_REQUIRE_CUDA") == "1"
    reason = None
    if not want_cuda:
        reason = "FASTAMP_NO_CUDA=1"
    elif torch_cuda is None:
        reason = f"torch {torch.__version__} has no CUDA"
    else:
        reason = _prepare_cuda(torch, cpp_extension)
    with_cuda = reason is None
    if not with_cuda and require_cuda and want_cuda:
        raise RuntimeError(f"FASTAMP_REQUIRE_CUDA=1 but the CUDA kernels cannot be built: {reason}")
    if with_cuda:
        release = ".".join(map(str, _nvcc_release(_find_nvcc())))
        reason = f"torch CUDA {torch_cuda}, nvcc {release} in CUDA_HOME={cpp_extension.CUDA_HOME}"
        cu = glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")) + glob.glob(
            os.path.join(ROOT, "csrc", "cuda", "*.cpp")
        )
        sources += _rel(cu)
        cxx_flags.append("-DFASTAMP_WITH_CUDA=1")
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        _log(f"building CPU + CUDA kernels ({reason}; TORCH_CUDA_ARCH_LIST={arch})")
        ext_cls = cpp_extension.CUDAExtension
        compile_args = {"cxx": cxx_flags, "nvcc": nvcc_flags}
    else:
        _log(f"building CPU kernels only ({reason})")
        ext_cls = cpp_extension.CppExtension
        compile_args = {"cxx": cxx_flags}
    link_args = ["-fopenmp"] if sys.platform.startswith("linux") else []
    _log("sources: " + " ".join(sources))
    ext = ext_cls(
        name="fastamp._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        py_limited_api=False,
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

# setuptools >= 77 deprecates a license given as text (the TOML table `license = {text = ...}`
# printed a warning block at every build) and takes an SPDX expression; older ones, such as the
# 65.x a fresh venv of torch 2.11 gets, know only the text field and reject the SPDX form in
# pyproject.toml. So the license is dynamic and set here in the form this setuptools knows.
_LICENSE = "BSD-3-Clause"
_SETUPTOOLS_MAJOR = int(setuptools.__version__.split(".")[0])
_LICENSE_KW = {"license_expression": _LICENSE} if _SETUPTOOLS_MAJOR >= 77 else {"license": _LICENSE}

setup(
    **_LICENSE_KW,
    # every package under fastamp/ (a folder left out installs without it: an ImportError only
    # users of a non-editable install see; tests/tools/test_packaging.py builds the wheel)
    packages=["fastamp", *(f"fastamp.{p}" for p in find_packages("fastamp")), "fastamp.kernels"],
    package_dir={"fastamp.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
