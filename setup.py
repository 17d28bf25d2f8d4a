"""Build fastamp and its native extension ``fastamp._C``.

The C++ CPU kernels are always compiled. The CUDA kernels are added only when both a
CUDA toolkit (``nvcc``) and a CUDA-enabled torch are present; whether a GPU is visible
does not matter. ``FASTAMP_NO_EXT=1`` skips the extension (the torch reference then runs),
``FASTAMP_NO_CUDA=1`` skips only the CUDA part. What was decided is printed.
"""

import glob
import os
import shutil
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _log(msg):
    print(f"[fastamp setup] {msg}", file=sys.stderr, flush=True)


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

    sources = _rel(glob.glob(os.path.join(ROOT, "csrc", "*.cpp")) + glob.glob(os.path.join(ROOT, "csrc", "cpu", "*.cpp")))
    cxx_flags = ["-O3", "-std=c++17", "-fno-math-errno", "-ffp-contract=off", "-DFASTAMP_WITH_CPU=1"]
    if sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
    nvcc_flags = ["-O3", "-std=c++17", "--fmad=false", "-DFASTAMP_WITH_CUDA=1", "-lineinfo"]

    torch_cuda = torch.version.cuda
    cuda_home = cpp_extension.CUDA_HOME
    nvcc = shutil.which("nvcc") or (cuda_home and os.path.join(cuda_home, "bin", "nvcc"))
    has_nvcc = bool(nvcc and os.path.exists(nvcc))
    want_cuda = os.environ.get("FASTAMP_NO_CUDA") != "1"
    with_cuda = want_cuda and torch_cuda is not None and has_nvcc
    reason = (
        "FASTAMP_NO_CUDA=1"
        if not want_cuda
        else f"torch {torch.__version__} has no CUDA"
        if torch_cuda is None
        else "no nvcc / CUDA_HOME found"
        if not has_nvcc
        else f"torch CUDA {torch_cuda}, nvcc at {nvcc}"
    )
    if with_cuda:
        cu = glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")) + glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cpp"))
        sources += _rel(cu)
        cxx_flags.append("-DFASTAMP_WITH_CUDA=1")
        arch = os.environ.get("TORCH_CUDA_ARCH_LIST")
        _log(f"building CPU + CUDA kernels ({reason}; TORCH_CUDA_ARCH_LIST={arch or 'torch default'})")
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

setup(
    packages=["fastamp", "fastamp.optim", "fastamp.kernels"],
    package_dir={"fastamp.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
