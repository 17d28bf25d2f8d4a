"""The op table of ``fastamp/ops/registry.py``: one schema and fake per op, registered in both namespaces.

Every check that loads ``fastamp._C`` or changes what can be imported runs in a subprocess:
a registration the dispatcher refuses inside ``_C``'s static initialisers aborts the process,
and that must show as a failed test, not a dead test run.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict | None = None) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON object as its last line."""
    full_env = {**os.environ, **(env or {})}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=full_env,
    )
    assert out.returncode == 0, f"subprocess failed (rc {out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# OPS, gradient release's check-pass ops (defined from RELEASE_OPS in the native namespace; CPU and CUDA kernels)
# and AdamW on q8 moments (Q8_OPS, likewise)
@pytest.mark.parametrize("table", ["OPS", "RELEASE_OPS", "Q8_OPS"])
def test_native_ops_have_the_table_schema_and_a_cpu_kernel(table):
    got = _run(
        f"""
        import json, torch
        from fastamp.ops import registry
        res = {{"loaded": registry.NATIVE_LOADED, "error": registry.NATIVE_ERROR, "ops": {{}}}}
        for op in registry.{table}:
            if registry.NATIVE_LOADED:
                have = str(getattr(torch.ops.fastamp, op).default._schema)
                res["ops"][op] = [have, str(registry.schema("fastamp", op)), registry.native_has_kernel(op, "cpu")]
        print(json.dumps(res))
        """
    )
    if not got["loaded"] and "No module named 'fastamp._C'" in (got["error"] or ""):
        pytest.skip("fastamp._C is not built")
    assert got["loaded"], got["error"]
    from fastamp.ops import registry

    assert set(got["ops"]) == set(getattr(registry, table))
    assert not set(registry.RELEASE_OPS) & set(registry.OPS)
    assert not set(registry.Q8_OPS) & (set(registry.OPS) | set(registry.RELEASE_OPS))
    for op, (have, want, has_cpu) in got["ops"].items():
        assert have == want, op
        assert has_cpu, f"fastamp::{op} has no CPU kernel"


def test_a_kernel_that_differs_from_the_schema_is_refused_without_an_abort():
    """The dispatcher's check can fail, and it fails as a Python error, after ``_C`` loaded."""
    got = _run(
        """
        import glob, importlib.machinery, importlib.util, json, torch
        # load the extension alone (fastamp/__init__ would define the schemas first)
        paths = glob.glob("fastamp/_C*.so") + glob.glob("fastamp/_C*.pyd")
        if not paths:
            print(json.dumps({"skip": "fastamp._C is not built"}))
            raise SystemExit
        loader = importlib.machinery.ExtensionFileLoader("fastamp._C", paths[0])
        importlib.util.module_from_spec(importlib.util.spec_from_file_location("fastamp._C", paths[0], loader=loader))
        lib = torch.library.Library("fastamp", "FRAGMENT")
        try:
            lib.define("optim_(Tensor(a!)[] params, Tensor[] grads) -> ()")
            print(json.dumps({"error": None}))
        except RuntimeError as e:
            print(json.dumps({"error": str(e)}))
        """
    )
    if "skip" in got:
        pytest.skip(got["skip"])
    assert got["error"] is not None and "fastamp::optim_" in got["error"]
    assert "inferred schema" in got["error"]


def test_import_without_the_extension():
    """A build without ``fastamp._C`` (``FASTAMP_NO_EXT=1``): fastamp imports, the torch backend runs."""
    got = _run(
        """
        import json, sys
        sys.modules["fastamp._C"] = None  # import fails as it does where _C was never built
        import torch, fastamp
        from fastamp import backends, functional
        from fastamp.ops import registry
        g, f = [torch.full((3,), 2.0)], torch.zeros(1)
        functional.unscale_check_(g, f, torch.tensor([0.5]))
        print(json.dumps({
            "loaded": registry.NATIVE_LOADED,
            "error": registry.NATIVE_ERROR,
            "defined": hasattr(torch.ops.fastamp, "adamw_"),
            "cpu": backends.resolve("adamw_", "cpu"),
            "grad": g[0].tolist(),
        }))
        """,
        env={"FASTAMP_BACKEND": ""},
    )
    assert got["loaded"] is False and "fastamp._C" in got["error"]
    assert got["defined"] is False
    assert got["cpu"] in ("torch", "triton")
    assert got["grad"] == [1.0, 1.0, 1.0]


def test_import_without_triton():
    got = _run(
        """
        import json, sys
        sys.modules["triton"] = None
        import torch, fastamp
        from fastamp import backends, kernels
        ok, why = backends.available("triton", "adamw_", "cpu")
        print(json.dumps({"ok": ok, "why": why, "op": kernels.get_op("adamw_") is None,
                          "ns": hasattr(torch.ops.fastamp_triton, "adamw_")}))
        """
    )
    assert got["ok"] is False and "triton is not importable" in got["why"]
    assert got["op"] is True
    assert got["ns"] is False


def test_triton_ops_have_the_table_schema():
    pytest.importorskip("triton")
    got = _run(
        """
        import json, torch
        from fastamp import kernels
        from fastamp.ops import registry
        res = {}
        for op in (*registry.OPS, *registry.Q8_OPS, *registry.GENERIC_OPS):
            assert kernels.get_op(op) is not None, op
            ns = torch.ops.fastamp_triton
            res[op] = [str(getattr(ns, op).default._schema), str(registry.schema("fastamp_triton", op))] if hasattr(ns, op) else None
        print(json.dumps(res))
        """,
        env={"TRITON_INTERPRET": "1"},
    )
    from fastamp.ops.registry import GENERIC_OPS, OPS, Q8_OPS

    # the per-rule optimizer ops run as optim_ (kernels/optim.py): no Triton op of their own
    per_rule = {"adamw_", "adamw_bf16_", "adamw_q8_", "sgd_", "sgd_q8_", "lion_", "lion_q8_"}
    assert set(got) == set(OPS) | set(Q8_OPS) | set(GENERIC_OPS)
    assert {op for op, r in got.items() if r is None} == per_rule
    for op, r in got.items():
        assert r is None or r[0] == r[1], op


def test_coerce_follows_the_schema():
    from fastamp.ops import registry

    args = registry.coerce("update_scale_", (1, 2, 3, 4, 2, 1, 10.0, True, 0, 5))
    assert args[:4] == (1, 2, 3, 4)
    assert [type(a) for a in args[4:]] == [float, float, int, int, float, float]
    assert isinstance(registry.coerce("sgd_", ((), (), (), (), 0, None, None, 0, 0, 0, 0, 0, 0))[0], list)
    with pytest.raises(TypeError, match="expected 10 arguments, got 2"):
        registry.coerce("update_scale_", (1, 2))


def test_as_optim_runs_a_per_rule_op_as_optim():
    """registry.as_optim, the kernel of a per-rule op on a device with optim_'s kernel but not the op's own
    (native CUDA), is the reference's per-rule op bit for bit: here on the CPU, every dense rule x format."""
    import torch
    from _matrix import RULE_FORMATS, clone_state, make_state, per_rule_call, per_rule_covers
    from helpers import assert_bits_equal

    from fastamp import reference
    from fastamp.ops import registry

    if not registry.NATIVE_LOADED:
        pytest.skip(f"fastamp._C does not load: {registry.NATIVE_ERROR}")
    done = set()
    for rule, fmt in RULE_FORMATS:
        if not per_rule_covers(rule, fmt):
            continue
        h = rule.hypers[sorted(rule.hypers)[0]]
        st = make_state(rule, fmt, fmt.param_dtypes[0], torch.float32, h, [5, 70], 3)
        ref = clone_state(st)
        scalars = rule.step_scalars(h, 0, None, "cpu")
        rng = torch.tensor([1, 2], dtype=torch.int64)
        op, args = per_rule_call(rule, fmt, st, scalars, None, rng, 3, h)
        _, ref_args = per_rule_call(rule, fmt, ref, scalars, None, rng, 3, h)
        registry.as_optim(op)(*args)
        getattr(reference, op)(*ref_args)
        for key in st:
            for i, (a, b) in enumerate(zip(st[key], ref[key])):
                assert_bits_equal(a, b, f"{op} {fmt.name}: {key}[{i}]")
        done.add(op)
    assert done == {"adamw_", "adamw_bf16_", "sgd_", "lion_"}, done
