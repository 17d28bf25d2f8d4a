"""The Triton interpreter without its repeated language patching (test time only).

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches ``triton.language``
for the interpreter once, runs every program of the grid, and restores the language. But every
call of a ``@triton.jit`` helper inside the kernel (``InterpretedFunction.__call__``) patches the
language again, which walks every member of ``tl``, ``tl.core``, ``tl.tensor`` and ``tl.math`` with
``inspect.getmembers`` (~1 ms a call). Our kernels call their rule and format helpers ~100 times
per program, so this re-patching was ~35% of the interpreter's time (profile of
test_optim_matrix's many-tiny-tensors row, triton 3.9: 5.2 of 14.8 s).

The re-patch changes nothing when the kernel's own patch already covers the language modules the
helper sees (its builtins are already replaced: ``tl.core.is_builtin`` is false for the
replacements, so the second walk finds nothing to wrap; the tensor and core attributes it sets
again are the kernel scope's and are restored with it). :func:`install` skips it in exactly that
case: while a kernel launch runs and the helper's globals hold no language module that the
kernel's globals lack. Anything else (a helper called outside a launch, a helper module that
imports ``triton.language.core`` where the kernel module does not) takes triton's own path.

It is installed only when triton's two methods have the shape this was written against (triton
3.6 and 3.9: the helper call is ``_patch_lang(self.fn)`` then ``self.rewrite()``); any other
triton runs unchanged. Nothing in fastamp itself depends on it.
"""

from __future__ import annotations

import inspect

_installed = False


def install() -> bool:
    """Install the shortcut where triton's interpreter has the expected shape; whether it is installed."""
    global _installed
    if _installed:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except Exception:  # no triton, or one without the interpreter: nothing to speed up
        return False
    grid_cls = getattr(interp, "GridExecutor", None)
    fn_cls = getattr(interp, "InterpretedFunction", None)
    error = getattr(interp, "InterpreterError", None)
    if grid_cls is None or fn_cls is None or error is None or not hasattr(interp, "_patch_lang"):
        return False
    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__
    try:
        grid_src, fn_src = inspect.getsource(grid_call), inspect.getsource(fn_call)
    except (OSError, TypeError):
        return False
    if "_patch_lang(self.fn)" not in grid_src or "patch_scope.restore()" not in grid_src:
        return False
    body = [line.strip() for line in fn_src.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    if body[:2] != ["_patch_lang(self.fn)", "fn = self.rewrite()"]:
        return False

    lang_modules = (tl, tl.core)
    active: list[frozenset[int]] = []  # the language modules each running launch patched (innermost last)
    langs_cache: dict[int, frozenset[int]] = {}

    def langs_of(fn) -> frozenset[int]:
        # as _patch_lang selects them: the modules among fn's globals that are tl or tl.core
        key = id(fn.__globals__)
        got = langs_cache.get(key)
        if got is None:
            got = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang_modules)
            langs_cache[key] = got
        return got

    def launch(self, *args, **kwargs):
        active.append(langs_of(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            active.pop()

    def device_call(self, *args, **kwargs):
        if not active or not langs_of(self.fn) <= active[-1]:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise error(repr(e)) from e

    grid_cls.__call__ = launch
    fn_cls.__call__ = device_call
    _installed = True
    return True
