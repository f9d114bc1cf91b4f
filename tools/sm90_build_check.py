#!/usr/bin/env python3
"""Build for the H200 (sm_90) every Triton kernel launch a CPU run makes, without a GPU.

The interpreter (TRITON_INTERPRET=1) runs any kernel a GPU build would refuse: a ``tl.dot`` narrower than the
tensor cores take, a variable whose type two branches disagree on. Such a kernel passes every CPU test and fails on
the device, where time is scarce. This tool records each distinct launch of a command run under the interpreter
(the kernel, its constexprs, the dtypes of its arguments and its launch options, with ``INTERP`` turned off), then
compiles each one for sm_90 in a second process without the interpreter, and names those that do not build.

    python3 tools/sm90_build_check.py -m pytest -q tests/models/qwen4exp          # record, then build
    python3 tools/sm90_build_check.py --launches /tmp/l.json -m pytest -q tests/x  # keep the record
    python3 tools/sm90_build_check.py --python /tmp/v36/bin/python -m pytest -q tests/x   # the device's Triton

Triton versions differ in what they refuse (3.9 builds a dot of K = 8 that 3.6, the device's, does not): build
with the device's version (docs/kernels.md says how to install it beside this machine's).

Exit status: 0 when every recorded launch builds, 1 when one does not, 2 when the command itself failed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

# torch dtype name -> Triton pointer element type.
_PTR = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64", "int32": "i32",
        "int16": "i16", "int8": "i8", "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1",
        "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
# Launch keywords that are compile options, not kernel arguments.
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas", "maxnreg")


def _constexpr(value):
    """A JSON form of a constexpr's value (None when it has none)."""
    import triton.language as tl

    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, tl.dtype):
        return f"dtype:{value.name}"
    raise TypeError(f"constexpr value {value!r} of type {type(value).__name__}")


def _arg_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _PTR[str(value.dtype).removeprefix("torch.")]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument of type {type(value).__name__}")


def record(argv: list[str], out: Path) -> int:
    """Run ``python3 -m MODULE ARGS`` (``argv`` = ``["-m", MODULE, *ARGS]``) under the interpreter in this process,
    writing the distinct launches to ``out``; returns the command's exit status."""
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        try:
            entry = _launch(self, args, kwargs)
            seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        except (TypeError, KeyError) as exc:   # an argument this tool cannot type: say so, do not stop the run
            print(f"sm90_build_check: {self.fn.__name__} not recorded ({exc})", file=sys.stderr)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    if argv[:1] != ["-m"] or len(argv) < 2:
        raise SystemExit("sm90_build_check: give the command as -m MODULE [ARGS]")
    sys.argv = [argv[1], *argv[2:]]
    status = 0
    try:
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        InterpretedFunction.run = original
        out.write_text(json.dumps(list(seen.values()), indent=1))
    if not seen and any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in argv[2:]):
        # pytest-xdist runs the tests in worker processes, where this process's recorder does not reach
        print("sm90_build_check: no launch recorded: run pytest without -n (its workers are other processes)",
              file=sys.stderr)
    return status


def _launch(kernel, args, kwargs) -> dict:
    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(kernel.arg_names, args, strict=False))   # the rest by keyword or default
    bound.update({k: v for k, v in kwargs.items() if k not in _OPTIONS})
    constexprs, signature = {}, {}
    for name, param in params.items():
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            constexprs[name] = False if name == "INTERP" else _constexpr(value)
            signature[name] = "constexpr"
        else:
            signature[name] = _arg_type(value)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    return {"module": kernel.fn.__module__, "kernel": kernel.fn.__name__, "constexprs": constexprs,
            "signature": signature, "options": options}


def build(launches: list[dict]) -> list[tuple[dict, str]]:
    """Compile each launch for sm_90 (this process must not interpret); the failures with their messages."""
    import importlib

    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def value(v):
        if isinstance(v, str) and v.startswith("dtype:"):
            return getattr(tl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(v[6:], v[6:]))
        return v

    failures = []
    for entry in launches:
        fn = getattr(importlib.import_module(entry["module"]), entry["kernel"])
        consts = {k: value(v) for k, v in entry["constexprs"].items()}
        try:
            src = ASTSource(fn=fn, signature=entry["signature"], constexprs=consts)
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, **entry["options"]})
        except Exception as exc:   # noqa: BLE001 - every build error is reported, none stops the others
            lines = [ln for ln in str(exc).splitlines() if ln.strip()]
            failures.append((entry, " | ".join(lines[-3:])[:400]))
    return failures


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--build"]:     # the second process: build a record
        launches = json.loads(Path(argv[1]).read_text())
        failures = build(launches)
        for entry, msg in failures:
            print(f"DOES NOT BUILD {entry['module']}.{entry['kernel']} {entry['constexprs']}: {msg}")
        print(f"sm90_build_check: {len(launches) - len(failures)} of {len(launches)} distinct launches build")
        return 1 if failures else 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=Path, default=None, help="keep the record here")
    ap.add_argument("--python", default=sys.executable,
                    help="the interpreter of the build (e.g. a virtual environment with the device's Triton)")
    args, command = ap.parse_known_args(argv)
    out = args.launches or Path(tempfile.mkstemp(suffix=".json")[1])
    status = record(command, out)
    if status not in (0, 5):   # pytest's 5: nothing collected (still a valid record)
        print(f"sm90_build_check: the command exited with {status}", file=sys.stderr)
        return 2
    # "0", not unset: a test module that defines a kernel may `setdefault` the interpreter on when imported.
    env = dict(os.environ, TRITON_INTERPRET="0")
    # The run's own import paths (this checkout's sources, the tools, a test's folder), not this interpreter's
    # installed packages: the build's interpreter may bring another Triton.
    prefixes = (sys.prefix, sys.base_prefix)
    # Every entry, not a slice: where a test's folder lands in sys.path depends on PYTHONPATH being set.
    own = [p for p in sys.path if p and not p.startswith(prefixes)]
    env["PYTHONPATH"] = os.pathsep.join(own + [env.get("PYTHONPATH", "")])
    return subprocess.run([args.python, __file__, "--build", str(out)], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
