"""Compile checks of the CUDA C++ backend, for machines without a GPU.

The kernels in ``csrc/cuda/*.cu`` must compile with bare ``nvcc`` (no torch headers) for
sm_80 and sm_90 with the flags ``setup.py`` uses; ``bindings.cpp`` must at least compile
against torch's headers. Skipped only where ``nvcc`` (or a C++ compiler for the binding)
is missing. Both archs are compiled in one nvcc call per file and the files in parallel.
"""

import hashlib
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: each worker compiles for itself
    fcntl = None

import pytest
from cuda_optim_calls import cuda_combos, rule_rows

ROOT = Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "csrc" / "cuda"
CU_FILES = sorted(CUDA_DIR.glob("*.cu"))
TIMEOUT_S = 300
# the compiles are shared by the session (one nvcc run under a lock); make test's --dist loadfile keeps
# this file on one xdist worker, so the other workers run other tests meanwhile instead of waiting on it
# optim_'s kernel template (csrc/cuda/optim.cuh) takes a rule (rules::<Name>, csrc/rules/<name>.h) and a
# state format by type; the format's file instantiates it (optim_fp32.cu, optim_bf16.cu, optim_q8.cu).
FORMAT_TYPES = {"kFloat32": "F32State", "kBFloat16": "Bf16State", "kQ8": "Q8State"}
FORMAT_FILES = {"kFloat32": "optim_fp32.cu", "kBFloat16": "optim_bf16.cu", "kQ8": "optim_q8.cu"}
DTYPE_PAIRS = 9  # (param, grad) in {fp32, fp16, bf16}^2, one instance each


def rule_types() -> dict[str, str]:
    """``{"kAdamW": "rules::AdamW", ...}``: each rule's enumerator and its struct (csrc/optim_rules.h's list)."""
    return {f"k{name}": f"rules::{name}" for name, _ in rule_rows()}


def optim_combos() -> list[tuple[str, str]]:
    """The (rule, state format) pairs of the CUDA kernel: each rule's kCudaStates (``("kAdamW", "kQ8")``)."""
    return cuda_combos()


def optim_instances() -> dict[str, dict[tuple[str, str], int]]:
    """{file: {(rule type, format type): instances}}: what each state format's file must hold."""
    types = rule_types()
    out: dict[str, dict[tuple[str, str], int]] = {}
    for rule, fmt in optim_combos():
        out.setdefault(FORMAT_FILES[fmt], {})[(types[rule], FORMAT_TYPES[fmt])] = DTYPE_PAIRS
    return out


def instance_rule(mangled: str) -> str:
    """The rule type (``rules::AdamW``) an optim_kernel instance's mangled arguments name, or the text itself."""
    return next((t for t in rule_types().values() if f"5rules{len(t) - 7}{t[7:]}E" in mangled), mangled)


def _nvcc():
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").exists():
            return str(Path(home) / "bin" / "nvcc")
    return None


NVCC = _nvcc()
requires_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (CUDA toolkit not installed)")


def _nvcc_cmd(src: Path, out: Path):
    # setup.py's nvcc flags; warnings are errors so a new one is noticed here, not on a GPU machine.
    return [
        NVCC, "-std=c++17", "--fmad=false", "-O3", "-lineinfo", "-DFASTAMP_WITH_CUDA=1",
        "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90",
        "-Wno-deprecated-gpu-targets", "--Werror", "all-warnings",
        "-c", str(src), "-o", str(out),
    ]  # fmt: skip


def _bindings_cmd(stub_dir: Path):
    """g++ -fsyntax-only of bindings.cpp with torch's and CUDA's headers, or a skip reason.

    A CPU torch wheel ships c10/cuda and ATen/cuda headers but not the generated
    ``c10/cuda/impl/cuda_cmake_macros.h``; a stub defining the shared-library macro stands in.
    """
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        return None, "no C++ compiler"
    if NVCC is None:
        return None, "no CUDA toolkit (cuda_runtime.h) for the binding's includes"
    from torch.utils.cpp_extension import include_paths

    torch_inc = include_paths()
    if not any((Path(p) / "c10/cuda/CUDAStream.h").exists() for p in torch_inc):
        return None, "this torch ships no c10/cuda headers"
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in torch_inc):
        stub = stub_dir / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "cuda_cmake_macros.h").write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), str(Path(NVCC).resolve().parent.parent)]
    homes.append("/usr/local/cuda")
    cuda_inc = next((Path(h) / "include" for h in homes if h and (Path(h) / "include/cuda_runtime.h").exists()), None)
    if cuda_inc is None:
        return None, "cuda_runtime.h not found (set CUDA_HOME)"
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wextra", "-Werror", "-DFASTAMP_WITH_CUDA=1"]
    for p in torch_inc:
        cmd += ["-isystem", p]
    cmd += ["-isystem", str(stub_dir), "-isystem", str(cuda_inc), "-I", str(ROOT / "csrc")]
    return [*cmd, str(CUDA_DIR / "bindings.cpp")], None


_CU_RESULTS: dict = {}


def _communicate(proc):
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        out = f"timed out after {TIMEOUT_S}s\n{out}"
    return proc.returncode, out


def _compile_all(out_dir: Path) -> dict:
    procs = {
        src.name: subprocess.Popen(
            [*_nvcc_cmd(src, out_dir / (src.stem + ".o")), "-Xptxas", "-v"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for src in CU_FILES
    }
    return {name: (*_communicate(proc), out_dir / (Path(name).stem + ".o")) for name, proc in procs.items()}


def _sources_key() -> str:
    """A hash of every CUDA source and header and of the nvcc command: what a compile's results depend on."""
    h = hashlib.sha256(" ".join(_nvcc_cmd(Path("x.cu"), Path("x.o"))).encode())
    for path in sorted([*(ROOT / "csrc").glob("*.h"), *CUDA_DIR.iterdir()]):
        if path.is_file():
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def compile_cu_files(make_dir, shared: Path | None = None):
    """Compile every .cu for sm_80 + sm_90 with ``-Xptxas -v``, once per test session, in parallel.

    ``make_dir()`` gives the folder for the objects. Returns {file name: (returncode, nvcc +
    ptxas output, object path)}. This module checks the
    objects, tests/tools/test_cuda_ptxas.py the ptxas report of the same compile (one compile of each
    file for both, not two). ``shared``: a folder every pytest-xdist worker of the session sees; the
    first worker compiles into it under a lock and the others read its results (one compile per
    session, not one per worker: on 2 cores two would take twice as long and run into TIMEOUT_S).
    """
    if _CU_RESULTS:
        return _CU_RESULTS
    if shared is None or fcntl is None:
        _CU_RESULTS.update(_compile_all(make_dir()))
        return _CU_RESULTS
    root = shared / f"cuda_objs-{_sources_key()}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / "results.json"
        if done.exists():
            data = json.loads(done.read_text())
            _CU_RESULTS.update({name: (rc, out, root / (Path(name).stem + ".o")) for name, (rc, out) in data.items()})
        else:
            results = _compile_all(root)
            done.write_text(json.dumps({name: [rc, out] for name, (rc, out, _) in results.items()}))
            _CU_RESULTS.update(results)
    return _CU_RESULTS


def xdist_shared(tmp_path_factory) -> Path | None:
    """The session's folder shared by its pytest-xdist workers (the parent of each worker's base temp), or None."""
    return tmp_path_factory.getbasetemp().parent if os.environ.get("PYTEST_XDIST_WORKER") else None


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Every .cu compiled for sm_80 + sm_90, and bindings.cpp syntax-checked alongside.

    Returns {file name: (returncode or a skip reason string, output, object path)}.
    """
    if NVCC is None:
        pytest.skip("nvcc not found")
    bind_cmd, bind_skip = _bindings_cmd(tmp_path_factory.mktemp("stub"))
    bind_proc = None
    if bind_cmd is not None:
        bind_proc = subprocess.Popen(bind_cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    results = dict(compile_cu_files(lambda: tmp_path_factory.mktemp("cuda_objs"), xdist_shared(tmp_path_factory)))
    results["bindings.cpp"] = (bind_skip, "", None) if bind_proc is None else (*_communicate(bind_proc), None)
    return results


def test_expected_cuda_sources_exist():
    names = {p.name for p in CU_FILES}
    assert {"amp.cu", "optim.cu", *optim_instances()} <= names, names
    for header in ("optim.cuh", "optim_formats.cuh", "optim_combos.h", "launch_plan.h", "launchers.h"):
        assert (CUDA_DIR / header).exists(), header
    assert (CUDA_DIR / "bindings.cpp").exists()
    # the per-rule kernels optim_'s one template replaced
    assert not names & {"adamw.cu", "adamw_q8.cu", "sgd.cu", "lion.cu"}, names
    # and the per-rule units the state formats' ones replaced: a new rule adds no file here
    assert not names & {"optim_adamw.cu", "optim_sgd.cu", "optim_lion.cu"}, names
    assert not (CUDA_DIR / "one_state.cuh").exists()


def test_optim_combos_cover_every_rule_once():
    """The kCudaStates list each (rule, format) pair once; every rule of the reference has its fp32 pair and a header."""
    from fastamp.reference.optim import RULES

    combos = optim_combos()
    assert len(combos) == len(set(combos)) > 0, combos
    assert {r for r, _ in combos} == set(rule_types()) and {f for _, f in combos} <= set(FORMAT_TYPES)
    assert {file for _, file in rule_rows()} == set(RULES)
    for rule in rule_types():
        assert (rule, "kFloat32") in combos, f"{rule}: SGD without momentum and every fp32 call need it"
    for fmt in FORMAT_TYPES:
        assert (CUDA_DIR / FORMAT_FILES[fmt]).exists(), FORMAT_FILES[fmt]


@pytest.mark.slow  # the compiled fixture: nvcc on every .cu (~45 s)
@pytest.mark.parametrize("name", sorted(p.name for p in CU_FILES))
@requires_nvcc
def test_cu_compiles_for_sm80_and_sm90(compiled, name):
    rc, out, obj = compiled[name]
    assert rc == 0, f"nvcc failed on {name}:\n{out}"
    assert obj.exists() and obj.stat().st_size > 0


@pytest.mark.slow
@requires_nvcc
def test_objects_hold_both_archs_and_every_kernel(compiled):
    # Read the object bytes (cuobjdump is not always installed): nvcc records each cubin's
    # ptxas command line, and the mangled kernel names show the template instantiations.
    rc, out, obj = compiled["amp.cu"]
    assert rc == 0, out
    data = obj.read_bytes()
    for arch in (b"-arch sm_80", b"-arch sm_90"):
        assert arch in data, f"amp.cu: no cubin built with {arch.decode()}"
    # 3 grad dtypes x (plain, with health statistics, into per-grad slots for gradient release)
    found = set(re.findall(rb"unscale_check_kernelI(\w*?)EEv", data))
    assert len(found) == 9, f"amp.cu: expected 9 instantiations, got {sorted(found)}"
    for k in (b"sumsq_finalize_kernel", b"sumsq_fold_kernel", b"update_scale_kernel"):
        assert k in data, f"amp.cu: kernel {k.decode()} missing"
    # optim_: each state format's file holds its (rule, format) pairs of the rules' kCudaStates, 9 dtype
    # pairs each, and no other format's (the master formats and flags are run-time branches, not instances)
    for name, want in optim_instances().items():
        rc, out, obj = compiled[name]
        assert rc == 0, out
        data = obj.read_bytes()
        for arch in (b"-arch sm_80", b"-arch sm_90"):
            assert arch in data, f"{name}: no cubin built with {arch.decode()}"
        got: dict[tuple[str, str], int] = {}
        for args in set(re.findall(rb"optim_kernelI(\w*?)EEv", data)):
            text = args.decode()
            rule = instance_rule(text)
            fmt = next((f for f in FORMAT_TYPES.values() if f in text), text)
            got[(rule, fmt)] = got.get((rule, fmt), 0) + 1
        assert got == want, f"{name}: optim_kernel instances {got}, the rules' kCudaStates list {want}"
    rc, out, obj = compiled["optim.cu"]
    assert rc == 0, out
    assert b"optim_kernel" not in obj.read_bytes(), "optim.cu only hands a call to its state format's file"


def test_binding_fills_every_field_of_the_optim_call():
    """optim_cuda sets each field of launchers.h's OptimCall (the GPU tests are the first to run it; a field
    left at its zero, as step_scalars once was, reads address 0 on the device)."""
    header = (CUDA_DIR / "launchers.h").read_text()
    body = header.split("struct OptimCall {", 1)[1].split("};", 1)[0]
    fields = re.findall(r"^\s+[\w:<>\s\*]+?\b(\w+)(?:\[\d+\])?;", body, flags=re.M)
    assert {"rule", "format", "master", "step_scalars", "found_inf", "rng", "rng_base"} <= set(fields), fields
    binding = (CUDA_DIR / "bindings.cpp").read_text()
    fn = binding.split("void optim_cuda(", 1)[1].split("\n}\n", 1)[0]
    unset = [f for f in fields if not re.search(rf"\bcall\.{f}(\[\w+\])? =", fn)]
    assert not unset, f"optim_cuda does not set OptimCall's {unset}"


def test_kernel_sources_include_no_torch_header():
    pattern = re.compile(r'#\s*include\s*[<"](torch|ATen|c10|caffe2)/')
    for path in [*CU_FILES, *CUDA_DIR.glob("*.cuh"), *CUDA_DIR.glob("*.h")]:
        for line in path.read_text().splitlines():
            assert not pattern.search(line), f"{path.name} includes a torch header: {line.strip()}"


@pytest.mark.slow
def test_bindings_compile_against_torch_headers(compiled):
    """bindings.cpp compiles (syntax and templates) against the installed torch's headers."""
    rc, out, _ = compiled["bindings.cpp"]
    if isinstance(rc, str):
        pytest.skip(rc)
    assert rc == 0, f"bindings.cpp does not compile:\n{out[-6000:]}"


def _schema_ops():
    """The ops of the kernel op table ``OPS`` in fastamp/ops/registry.py (its ``    "name": OpDef(`` entries).

    ``OPTIM_OPS`` there holds the optimizers' step-scalar ops, whose kernels are Python: no C++.
    """
    text = (ROOT / "fastamp" / "ops" / "registry.py").read_text()
    table = text.split("\nOPS: dict[str, OpDef] = {\n", 1)[1].split("\n}\n", 1)[0]
    return set(re.findall(r'^    "(\w+)": OpDef\(', table, flags=re.M))


def _table_ops(name):
    """The ops of the table ``name`` in fastamp/ops/registry.py (its ``    "name": OpDef(`` entries)."""
    text = (ROOT / "fastamp" / "ops" / "registry.py").read_text()
    table = text.split(f"\n{name}: dict[str, OpDef] = {{\n", 1)[1].split("\n}\n", 1)[0]
    return set(re.findall(r'^    "(\w+)": OpDef\(', table, flags=re.M))


def _release_ops():
    """The ops of ``RELEASE_OPS`` in fastamp/ops/registry.py: gradient release's check pass (CPU and CUDA kernels)."""
    return _table_ops("RELEASE_OPS")


def _q8_ops():
    """The ops of ``Q8_OPS`` in fastamp/ops/registry.py: the rules on q8 moments."""
    return _table_ops("Q8_OPS")


def test_no_op_schema_is_defined_in_cpp():
    """Schemas come from the op table only; C++ defines just its introspection ops."""
    defined = set()
    for path in [*(ROOT / "csrc").rglob("*.cpp"), *(ROOT / "csrc").rglob("*.cu")]:
        defined |= set(re.findall(r'm\.def\(\s*"(\w+)\(', path.read_text()))
    assert defined == {"build_info", "cpu_isa"}
    assert len(_schema_ops()) == 7


def test_every_kernel_registers_through_the_signature_check():
    """A CPU/CUDA C++ signature mismatch aborts every user's import, so none may bypass FASTAMP_IMPL.

    csrc/op_signatures.h holds one C++ signature per op; FASTAMP_IMPL static_asserts the
    kernel against it. A raw ``m.impl(`` would register unchecked.
    """
    header = (ROOT / "csrc" / "op_signatures.h").read_text()
    declared = set(re.findall(r"^using (\w+) =", header, flags=re.M))
    release = _release_ops()
    assert release == {"unscale_check_partials_", "sumsq_fold"}
    q8 = _q8_ops()
    assert q8 == {"adamw_q8_", "sgd_q8_", "lion_q8_"}
    generic = _table_ops("GENERIC_OPS")
    assert generic == {"optim_"}
    assert declared == _schema_ops() | release | q8 | generic, (
        "op_signatures.h must declare exactly the ops of the op tables (OPS, RELEASE_OPS, Q8_OPS and GENERIC_OPS in "
        "fastamp/ops/registry.py)"
    )
    # the per-rule optimizer ops have no C++ kernel on either device: fastamp.ops.registry registers each
    # as optim_ there (as_optim, in Python), and composes no q8 op from a dense kernel any more
    registry_text = (ROOT / "fastamp" / "ops" / "registry.py").read_text()
    per_rule = set(re.findall(r'"(\w+)"', registry_text.split("\nPER_RULE_OPS = (", 1)[1].split(")", 1)[0]))
    assert per_rule == {"adamw_", "adamw_bf16_", "adamw_q8_", "sgd_", "sgd_q8_", "lion_", "lion_q8_"}
    assert "composed_q8(getattr(torch.ops.fastamp" not in registry_text
    registered = {"CPU": set(), "CUDA": set()}
    for path in [*(ROOT / "csrc").rglob("*.cpp"), *(ROOT / "csrc").rglob("*.cu")]:
        text = path.read_text()
        assert not re.search(r"\bm\.impl\(", text), f"{path.name}: register kernels with FASTAMP_IMPL, not m.impl"
        for key, body in re.findall(r"TORCH_LIBRARY_IMPL\(fastamp, (\w+), m\) \{(.*?)\n?\}", text, flags=re.S):
            registered[key] |= set(re.findall(r"FASTAMP_IMPL\(m, (\w+),", body))
    assert registered["CUDA"] == declared - per_rule
    assert registered["CPU"] == declared - per_rule


@pytest.mark.slow
@requires_nvcc
def test_signature_check_rejects_a_mismatched_kernel(tmp_path):
    """The check itself can fail: a kernel taking ``at::Tensor&`` where the op's takes ``const at::Tensor&``.

    This is the exact mismatch that made the dispatcher abort ``import fastamp`` on CUDA builds.
    """
    src = tmp_path / "mismatch.cpp"
    src.write_text(
        '#include "op_signatures.h"\n'
        "void bad_update_scale(at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&, double, double,\n"
        "                      int64_t, int64_t, double, double) {}\n"
        "void good_update_scale(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,\n"
        "                       double, double, int64_t, int64_t, double, double) {}\n"
        "TORCH_LIBRARY_IMPL(fastamp, CPU, m) { FASTAMP_IMPL(m, update_scale_, BAD_OR_GOOD); }\n"
    )
    cmd, skip = _bindings_cmd(tmp_path / "stub")
    if cmd is None:
        pytest.skip(skip)
    base = [*cmd[:-1], str(src)]
    good = subprocess.run([*base, "-DBAD_OR_GOOD=good_update_scale"], capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr[-4000:]
    bad = subprocess.run([*base, "-DBAD_OR_GOOD=bad_update_scale"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "does not have the C++ signature" in bad.stderr, bad.stderr[-4000:]
