"""Profile the engine worker thread's cycles (diagnostics shared by the engine-cost tools).

    with profiled_cycles(engine) as prof:
        ...   # drive the engine; only the worker's step calls are profiled
    print(top_functions(prof))
"""

from __future__ import annotations

import contextlib
import cProfile
import io
import pstats


@contextlib.contextmanager
def profiled_cycles(engine):
    """cProfile enabled around each of the worker's ``step`` calls while the block runs."""
    core = engine._core  # noqa: SLF001 (diagnostics)
    prof, orig = cProfile.Profile(), core.step

    def cycle(*a, **k):
        prof.enable()
        try:
            return orig(*a, **k)
        finally:
            prof.disable()

    core.step = cycle
    try:
        yield prof
    finally:
        core.step = orig


def top_functions(prof: cProfile.Profile, own: int = 40, cumulative: int = 0) -> str:
    """The top functions by own time (and, when asked, by cumulative time) as text."""
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(own)
    if cumulative:
        s.write("\n\n---- cumulative ----\n")
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(cumulative)
    return s.getvalue()
