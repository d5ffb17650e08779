"""Triton's interpreter without its repeated patching: the same results, a quarter less time.

triton 3.6's interpreter, at every call of a ``@triton.jit`` helper inside a kernel
(``InterpretedFunction.__call__``), patches the ``triton.language`` modules the helper's
module sees (``_patch_lang``: a few hundred attributes set), although the launch
(``GridExecutor.__call__``) patched them for the kernel's whole run, and nothing undoes a
patch before the launch ends. ``install()`` patches once per launch and helper module (the
first call of a helper from each module: ``triton.language.standard``'s ``zeros`` sees
``core``, which the kernel's module does not) and otherwise calls the helper as triton does.
The patches themselves are triton's, unchanged.

It also undoes them: triton restores what a launch patched but not what its helpers did,
so after one interpreted launch ``triton.language.core`` keeps interpreter versions of
125 of its builtins, and a Gluon kernel compiled later in the same process fails
(tests/test_gluon_compile.py after any interpreter test on the same xdist worker, when
the kernel is not in Triton's cache: "'ir.value' object has no attribute 'dtype'"). The
outermost launch now saves every attribute a kernel or helper may patch and puts them
back when it ends. And ``install()`` imports Gluon before any launch: the interpreter
imports it during its first launch otherwise, while ``triton.language`` is patched, and
Gluon's modules keep what they saw then ("Did you forget to add @triton.gluon.jit?").

Measured on the 2-core CPU machine (2026-11-27): the six Triton cases of
tests/test_kernels.py::test_backward_reads_a_sequence_joined_from_two_tensors, 39.3 s ->
29.6 s. Installed by tests/conftest.py (pytest's processes) and tests/dist_utils.py (the
spawned gloo ranks) when TRITON_INTERPRET=1; the GPU never runs the interpreter.
"""

from __future__ import annotations

import functools
import types


def install() -> None:
    """Patch triton's interpreter in this process (idempotent). Only triton 3.6, whose
    ``InterpretedFunction.__call__`` this repeats less its patching; other versions run as
    they come."""
    import triton
    from triton.runtime import interpreter

    try:  # before any launch (the module's docstring)
        import triton.experimental.gluon.language  # noqa: F401
    except ImportError:
        pass
    if not triton.__version__.startswith("3.6."):
        return
    launch, call = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__
    if getattr(call, "_once_per_launch", False):
        return
    state = {"depth": 0, "patched": set()}  # patched: id of each helper module's globals

    @functools.wraps(launch)
    def counted_launch(self, *args, **kwargs):
        outermost = state["depth"] == 0
        if outermost:
            state["patched"] = set()
            saved = _patch_every_lang(interpreter)
        state["depth"] += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            state["depth"] -= 1
            if outermost:
                saved.restore()

    @functools.wraps(call)
    def helper_call(self, *args, **kwargs):
        if state["depth"] == 0:  # outside a launch: as triton does it
            return call(self, *args, **kwargs)
        if id(self.fn.__globals__) not in state["patched"]:
            interpreter._patch_lang(self.fn)
            state["patched"].add(id(self.fn.__globals__))
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    helper_call._once_per_launch = True
    interpreter.GridExecutor.__call__ = counted_launch
    interpreter.InterpretedFunction.__call__ = helper_call


def _patch_every_lang(interpreter):
    """triton's ``_patch_lang`` for a function that sees both ``triton.language`` and
    ``triton.language.core``: it patches (and its scope restores) everything a kernel's or
    a helper's patch touches."""
    import triton.language as tl

    probe = types.FunctionType((lambda: None).__code__, {"tl": tl, "core": tl.core})
    return interpreter._patch_lang(probe)
