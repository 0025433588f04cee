"""Compile the engine's Triton kernels for a CUDA GPU on a machine without one (test_kernels_compile.py).

CI runs the kernels in Triton's CPU interpreter, which accepts code that real compilation rejects (several
`return`s of different types across static `if` branches, for one). Triton can compile for a CUDA target
without a driver (ptxas is bundled), so this module swaps `JITFunction.run` for a recorder: with
TRITON_INTERPRET unset, an op called on CPU tensors (its Triton path forced by `use_triton`) records each
launch's signature, constexprs, specialization and options exactly as the real launcher derives them,
instead of launching. Outputs are garbage and ignored. The recorded variants are then compiled for
GPUTarget("cuda", 90, 32) (the H200) in a few processes, each compile's error kept as the compiler
wrote it.

Run as a script (what the test does, in a subprocess, since the test session has TRITON_INTERPRET=1 and
Triton decides at import whether kernels are interpreted):

    python tests/helpers/compile_cuda.py OUT.json MODULE [CASE...]

MODULE names a module on sys.path with a `CASES` dict {name: callable}; each case drives some ops. The JSON
is {case: [{"kernel": ..., "variant": ..., "error": str | None}, ...]}.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SM90 = ("cuda", 90, 32)  # backend, compute capability, warp size
H200_SMS = 132  # what num_sms returns on the GPU, so split plans match the engine's there


@dataclass
class Launch:
    """One kernel variant: what `triton.compile` needs, and a readable name for it."""

    fn: Any  # the JITFunction
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    label: str
    cases: list[str] = field(default_factory=list)


@dataclass
class Recorder:
    """Stands in for `JITFunction.run`: records each distinct variant once, in launch order."""

    launches: dict[str, Launch] = field(default_factory=dict)
    case: str = ""
    _binders: dict[int, Any] = field(default_factory=dict)

    def run(self, jit, *args, grid, warmup, **kwargs) -> None:
        from triton.compiler import make_backend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        backend = make_backend(target())
        # as JITFunction.run: the launch's debug flag, then the binder's (params, specialization, options)
        kwargs["debug"] = kwargs.get("debug", jit.debug) or _debug_knob()
        binder = self._binders.get(id(jit))
        if binder is None:
            binder = self._binders[id(jit)] = create_function_from_signature(
                jit.signature, jit.params, backend
            )
        bound_args, specialization, options = binder(*args, **kwargs)
        key = f"{jit.fn.__module__}.{jit.fn.__qualname__}:" + compute_cache_key({}, specialization, options)
        if key not in self.launches:
            options, signature, constexprs, attrs = jit._pack_args(
                backend, kwargs, bound_args, specialization, options
            )
            label = _label(jit, constexprs, options)
            self.launches[key] = Launch(jit, signature, constexprs, attrs, dict(options.__dict__), label)
        if self.case not in self.launches[key].cases:
            self.launches[key].cases.append(self.case)


def target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*SM90)


def _debug_knob() -> bool:
    from triton import knobs

    return bool(knobs.runtime.debug)


def _label(jit, constexprs: dict, options) -> str:
    """kernel[NAME=value, ...; num_warps=., num_stages=.]: the constexprs a launch passed by name."""
    names = [p.name for p in jit.params]
    parts = [f"{names[path[0]]}={_short(value)}" for path, value in constexprs.items() if len(path) == 1]
    parts.append(f"num_warps={options.num_warps}, num_stages={options.num_stages}")
    return f"{jit.fn.__module__.rsplit('.', 1)[-1]}.{jit.fn.__name__}[{', '.join(parts)}]"


def _short(value: Any) -> str:
    return str(value.value if hasattr(value, "value") and not isinstance(value, (int, float)) else value)


def compile_launch(launch: Launch) -> str | None:
    """Compile one variant down to a cubin; the compiler's message on failure, else None."""
    import triton
    from triton.compiler import ASTSource

    src = ASTSource(launch.fn, launch.signature, launch.constexprs, launch.attrs)
    try:
        triton.compile(src, target=target(), options=launch.options)
    except Exception as exc:  # noqa: BLE001 (the test reports whatever the compiler raised, as it said it)
        return _describe(exc)
    return None


def _describe(exc: BaseException) -> str:
    """The error and its causes: a CompilationError shows where, its cause (chained) says what."""
    lines, seen = [], set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        lines.append(f"{type(exc).__name__}: {exc}".rstrip())
        exc = exc.__cause__ or exc.__context__
    return "\ncaused by ".join(lines)


_POOL_LAUNCHES: list[Launch] = []  # the forked workers' view of the launches (they inherit it)


def _compile_index(index: int) -> str | None:
    return compile_launch(_POOL_LAUNCHES[index])


def compile_all(launches: list[Launch], workers: int) -> list[str | None]:
    """Compile in `workers` forked processes (they inherit the launches: JITFunctions do not pickle)."""
    if workers <= 1 or len(launches) <= 1:
        return [compile_launch(launch) for launch in launches]
    _POOL_LAUNCHES[:] = launches
    # the biggest tiles first: they are the slowest compiles (one took 35 s), best not left for last
    order = sorted(range(len(launches)), key=lambda i: -_tile_size(launches[i]))
    ctx = multiprocessing.get_context("fork")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        errors = dict(zip(order, pool.map(_compile_index, order)))
    return [errors[i] for i in range(len(launches))]


def _tile_size(launch: Launch) -> int:
    """The product of a launch's integer BLOCK_* constexprs (1 if none)."""
    names = [p.name for p in launch.fn.params]
    size = 1
    for path, value in launch.constexprs.items():
        if names[path[0]].startswith("BLOCK") and isinstance(value, int) and not isinstance(value, bool):
            size *= max(1, value)
    return size


def unavailable() -> str | None:
    """Why this Triton cannot compile a trivial kernel for sm_90 here, or None if it can."""
    try:
        import triton
        import triton.language as tl
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction, compute_cache_key, create_function_from_signature

        # the launcher internals the recorder reuses (Triton 3.6 - 3.9)
        assert compute_cache_key and create_function_from_signature and JITFunction._pack_args

        @triton.jit
        def _probe(x_ptr, BLOCK: tl.constexpr):
            tl.store(x_ptr + tl.arange(0, BLOCK), tl.arange(0, BLOCK).to(tl.float32))

        triton.compile(
            ASTSource(_probe, {"x_ptr": "*fp32", "BLOCK": "constexpr"}, {(1,): 16}), target=target()
        )
    except Exception as exc:  # noqa: BLE001 (any failure here means: skip, saying why)
        why = f"{type(exc).__name__}: {exc}"
        return f"this Triton cannot compile for sm_90 here (or its launcher changed): {why}"
    return None


def record(cases: dict[str, Callable[[], None]]) -> tuple[Recorder, dict[str, str]]:
    """Run each case with launches recorded; -> (the recorder, {case: traceback} of cases that raised)."""
    from triton.runtime.jit import JITFunction

    from minakv.ops import triton_util

    recorder = Recorder()
    failed: dict[str, str] = {}
    saved_run, saved_flag = JITFunction.run, triton_util.TRITON_ON_CPU
    JITFunction.run = lambda jit, *args, **kwargs: recorder.run(jit, *args, **kwargs)  # a method again
    triton_util.TRITON_ON_CPU = True  # every op takes its Triton path on CPU tensors
    _patch_num_sms()
    try:
        for name, case in cases.items():
            recorder.case = name
            try:
                case()
            except Exception:  # noqa: BLE001 (reported as the case's failure, the others still run)
                failed[name] = traceback.format_exc()
    finally:
        JITFunction.run, triton_util.TRITON_ON_CPU = saved_run, saved_flag
    return recorder, failed


def _patch_num_sms() -> None:
    """Size grids and splits for the H200 (num_sms is imported by name into each op module)."""
    import pkgutil

    import minakv.ops

    for info in pkgutil.iter_modules(minakv.ops.__path__):
        module = importlib.import_module(f"minakv.ops.{info.name}")
        if hasattr(module, "num_sms"):
            module.num_sms = lambda device: H200_SMS


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: kernels must be JITFunctions to compile", file=sys.stderr)
        return 2
    out = argv[0]  # a file, not stdout: a library that prints would garble the JSON
    reason = unavailable()
    if reason:
        with open(out, "w") as f:
            json.dump({"skip": reason}, f)
        return 0
    module, names = importlib.import_module(argv[1]), argv[2:]
    cases = {name: module.CASES[name] for name in names or module.CASES}
    recorder, failed = record(cases)
    launches = list(recorder.launches.values())
    errors = compile_all(launches, int(os.environ.get("COMPILE_WORKERS", os.cpu_count() or 1)))
    results: dict[str, list[dict]] = {name: [] for name in cases}
    for launch, error in zip(launches, errors):
        for name in launch.cases:
            results[name].append({"kernel": launch.label, "error": error})
    for name, trace in failed.items():
        results[name].append({"kernel": "(driving the op on CPU)", "error": trace})
    with open(out, "w") as f:
        json.dump({"results": results}, f)
    return 0


if __name__ == "__main__":
    # tests/, not tests/helpers/, first on the path: helpers/triton.py would shadow Triton
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main(sys.argv[1:]))
