"""NInfer's own host-expert kernel (``EngineOptions.host_expert_kernel="native"``): ``host_kernels.c``, built with
the host's C compiler at first use and called through ctypes.

A call's whole routed sum (both projections, the SwiGLU between them and the weighted sum over its (token, expert)
pairs, sorted by expert) is one call into it, :meth:`NativeRows.add_routed`, and one OpenMP parallel region there:
each expert's weights read once for all of its tokens, straight from the banks as stored (bf16, fp32,
``q4_g64_fp16``, ``q8_g32_fp16``), quantized codes expanded in registers (no decoded copy of an expert).
A decode-sized call passes the router's ids and weights as they are
(:meth:`NativeRows.add_routed_ids`): the kernel sorts the pairs by expert itself, one crossing from Python instead
of a dozen small tensor operations. :func:`project` is one projection alone (for tests and tools).

Exactness: the projections sum in fp32 in the kernel's order (16-lane partial sums, then across lanes), so the
result equals the reference ``routed_experts_fp32`` within fp32 accumulation-order tolerance; its roundings (a bf16
bank's projections and SwiGLU rounded to bf16, a quantized bank's kept in fp32, as its decoded fp32 weights give)
and its pair order in the weighted sum are the reference's. Where the CPU has bf16 dot-product instructions
(AVX512-BF16) and a projection's inputs are all bf16 values, the kernel multiplies bf16 operands directly
(:func:`bf16_dot`): each product is exact in fp32 either way, so only the order of the fp32 sums changes.

The library is cached under ``<cache dir>/kernels`` (``NINFER_CACHE_DIR``, else ``~/.cache/ninfer``), keyed by the
source, the compiler, its flags and the host CPU, since ``-march=native`` code runs only on CPUs like the one it
was built on. A host without a working C compiler with OpenMP gets a NotSupportedError naming the option.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from importlib.resources import files
from pathlib import Path

import torch
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.errors import NotSupportedError
from ninfer.model_source.store import cache_dir
from ninfer.quant import PackedWeight

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
LIBS = ("-lm",)
#: Rows ahead that the bf16 reads prefetch (host_kernels.c ``NEXT_ROWS``): 0 (none) or 4-64, default
#: :data:`ROW_PREFETCH`; read at build time, so one host can A/B builds (each cached under its own key).
ROW_PREFETCH_ENV = "NINFER_HOST_ROW_PREFETCH"
#: The default: four rows ahead beat none, and eight beat four nowhere measured (docs/memory.md, "Host experts").
ROW_PREFETCH = 4
#: Whether the bf16, q4 and q8 rows multiply bf16 inputs with the CPU's bf16 dot-product instructions where it has
#: them (host_kernels.c ``BF16_DOT``): 1 (default) or 0; read at build time, like :data:`ROW_PREFETCH_ENV`.
BF16_DOT_ENV = "NINFER_HOST_BF16_DOT"
#: The kernel's format codes (host_kernels.c), by bank dtype or quantized format name.
FORMATS: dict[object, int] = {torch.float32: 0, torch.bfloat16: 1, "q4_g64_fp16": 2, "q8_g32_fp16": 3}
_GROUPWISE = ("q4_g64_fp16", "q8_g32_fp16")
_OPTION = "host_expert_kernel='native' (--host-expert-kernel native)"
_library: ctypes.CDLL | None = None


def _cpu_signature() -> str:
    """What ``-march=native`` depends on: the CPU's model and feature flags (the machine name where /proc has
    none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep))) or platform.machine()


def _defines() -> tuple[str, ...]:
    """The build's ``-D`` flags from the environment (:data:`ROW_PREFETCH_ENV`, :data:`BF16_DOT_ENV`); an error
    naming the variable if its value is out of range (a row count other than 0 or 4 to 64; a switch other than 0
    or 1)."""
    raw = os.environ.get(ROW_PREFETCH_ENV, "").strip() or str(ROW_PREFETCH)
    try:
        rows = int(raw)
    except ValueError:
        rows = -1
    if rows != 0 and not 4 <= rows <= 64:
        # Not a NotSupportedError: "auto" would fall back to torch's kernel on it instead of stopping.
        raise InvalidEngineOptions(f"{ROW_PREFETCH_ENV}={raw!r}: must be 0 (no prefetch) or a row count from 4 to 64")
    dot = os.environ.get(BF16_DOT_ENV, "").strip() or "1"
    if dot not in ("0", "1"):
        raise InvalidEngineOptions(f"{BF16_DOT_ENV}={dot!r}: must be 1 (bf16 dot products where the CPU has them) "
                                   f"or 0 (never)")
    return (f"-DNEXT_ROWS={rows}", f"-DBF16_DOT={dot}")


def build(directory: Path | None = None) -> Path:
    """The kernel library's path, compiled there first unless a build of the same source, compiler, flags and
    CPU is cached; ``directory`` defaults to ``<cache dir>/kernels``. NotSupportedError if it cannot be built."""
    source = files("ninfer_qwen3_5.layers").joinpath("host_kernels.c").read_bytes()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NotSupportedError(f"{_OPTION} needs a C compiler (cc or gcc, or $CC) to build its kernel at start, "
                                f"and this host has none; use host_expert_kernel 'torch'")
    flags = FLAGS + _defines()
    key = hashlib.sha256(b"\0".join([source, compiler.encode(), " ".join(flags + LIBS).encode(),
                                     _cpu_signature().encode()])).hexdigest()[:20]
    directory = directory or cache_dir() / "kernels"
    path = directory / f"host_kernels-{key}.so"
    if path.exists():
        return path
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        src, out = Path(tmp) / "host_kernels.c", Path(tmp) / "host_kernels.so"
        src.write_bytes(source)
        try:
            done = subprocess.run([compiler, *flags, str(src), "-o", str(out), *LIBS], capture_output=True,
                                  text=True, timeout=300, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise NotSupportedError(f"{_OPTION}: running the C compiler {compiler} failed ({exc}); use "
                                    f"host_expert_kernel 'torch'") from None
        if done.returncode != 0:
            raise NotSupportedError(f"{_OPTION}: the C compiler {compiler} could not build the host-expert kernel "
                                    f"(exit {done.returncode}): {done.stderr.strip()[-400:]}; use "
                                    f"host_expert_kernel 'torch'")
        os.replace(out, path)   # atomic: a concurrent start finds a whole library or none
    return path


def library() -> ctypes.CDLL:
    """The loaded kernel library (built on first use, then loaded once per process)."""
    global _library
    if _library is None:
        _library = load(build())
    return _library


def load(path: Path) -> ctypes.CDLL:
    """The kernel library at ``path`` (a :func:`build`), its functions typed."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise NotSupportedError(f"{_OPTION}: the built kernel {path} does not load ({exc}); remove it to rebuild, "
                                f"or use host_expert_kernel 'torch'") from None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.ninfer_expert_rows.restype = lib.ninfer_routed_sum.restype = i32
    lib.ninfer_expert_rows.argtypes = [i32, p, p, i64, i64, p, p, i64, p, p, i32]
    lib.ninfer_routed_sum.argtypes = [i32, p, p, p, p, i64, i64, p, p, i64, p, p, p, i32, p, i32]
    lib.ninfer_routed_sum_ids.restype = i32
    lib.ninfer_routed_sum_ids.argtypes = [i32, p, p, p, p, i64, i64, i64, p, p, p, i64, i64, p, i32, i32, p, i32]
    lib.ninfer_bf16_dot.restype = i32
    lib.ninfer_bf16_dot.argtypes = []
    return lib


def bf16_dot() -> bool:
    """Whether the loaded kernel multiplies bf16 inputs with the CPU's bf16 dot products (built with them, on a CPU
    that has them: AVX512-BF16). Either way the sums agree within fp32 accumulation order."""
    return bool(library().ninfer_bf16_dot())


def bank_format(bank) -> object | None:
    """The kernel's key for ``bank`` (a tensor ``[E, N, K]`` or a :class:`PackedWeight`), None if it has no
    kernel for it (then the host falls back to torch's GEMMs)."""
    if isinstance(bank, PackedWeight):
        return bank.format if bank.format in _GROUPWISE and all(p.is_contiguous() for p in bank.planes) else None
    if isinstance(bank, torch.Tensor) and bank.dtype in FORMATS and bank.is_contiguous():
        return bank.dtype
    return None


def bank_planes(bank) -> tuple[int, int | None]:
    """(the codes' or values' address, the fp16 scales' address or None) of a bank the kernel reads."""
    if isinstance(bank, PackedWeight):
        return bank.planes[0].data_ptr(), bank.planes[2].data_ptr()
    return bank.data_ptr(), None


def _groups(groups: list[tuple[int, int]]) -> torch.Tensor:
    """``[experts..., first...]``: each group's expert, then the groups' first pairs and the pair count."""
    first = [0]
    for _, n in groups:
        first.append(first[-1] + n)
    return torch.tensor([e for e, _ in groups] + first, dtype=torch.int64)


#: What each failure status of host_kernels.c's entry points means (one table for the direct calls' errors and the
#: host calls' recorded ones, :class:`~ninfer_qwen3_5.layers.host_mailbox.HostMailbox`).
STATUSES = {-1: "an unknown bank format", -2: "its working buffers could not be allocated",
            -3: "an expert id outside the bank", -4: "a token count outside the mailbox"}


def status_text(status: int) -> str:
    """``status`` of the native kernel in words, the number with it."""
    return f"{STATUSES.get(status, 'an unknown failure')} (status {status})"


def _check(status: int, fmt) -> None:
    """Raises the native kernel's failure ``status`` of a direct call by kind (none for 0)."""
    if status == 0:
        return
    kind = MemoryError if status == -2 else ValueError if status == -3 else RuntimeError
    what = f" {fmt!r}" if status == -1 else ""
    raise kind(f"the host-expert kernel failed: {status_text(status)}{what}")


def project(x: torch.Tensor, bank, groups: list[tuple[int, int]], threads: int) -> torch.Tensor:
    """``y[p] = W_{e(p)} @ x[p]`` in fp32 ``[pairs, N]`` for ``x [pairs, K]`` (any float dtype) whose rows are
    grouped by expert as ``groups`` ``(expert, count)`` in order, ``bank`` a tensor ``[E, N, K]`` or a packed
    ``q4_g64_fp16`` / ``q8_g32_fp16`` bank (:func:`bank_format` not None)."""
    fmt = bank_format(bank)
    xf = x.float().contiguous()
    y = torch.empty((x.shape[0], bank.shape[1]), dtype=torch.float32)
    meta = _groups(groups)
    step = meta.element_size()
    status = library().ninfer_expert_rows(FORMATS[fmt], *bank_planes(bank), bank.shape[1], x.shape[1], meta.data_ptr(),
                                          meta.data_ptr() + len(groups) * step, len(groups), xf.data_ptr(),
                                          y.data_ptr(), threads)
    _check(status, fmt)
    return y


class NativeRows:
    """The native kernel for a host-expert layer, with ``threads`` OpenMP threads (None: torch's intra-op count at
    the call); see the module docstring for its arithmetic."""

    def __init__(self, threads: int | None = None) -> None:
        library()   # build now: a start-up failure, not a first-request one
        self.threads = threads

    @staticmethod
    def supports(gate_up, down) -> bool:
        """Whether both banks are stored in one format the kernel reads."""
        fmt = bank_format(gate_up)
        return fmt is not None and bank_format(down) == fmt

    def add_routed(self, out: torch.Tensor, xs: torch.Tensor, tokens: torch.Tensor, pair_weights: torch.Tensor,
                   groups: list[tuple[int, int]], gate_up, down, wide: torch.dtype) -> torch.Tensor:
        """Adds the routed sum to ``out`` (fp32 ``[T, H]``, contiguous) and returns it: pair ``p`` (``xs[p]``, its
        rows in ``wide``, grouped by expert as ``groups``) adds ``pair_weights[p]`` times its expert's output to
        row ``tokens[p]``, in pair order; projections and SwiGLU rounded to ``wide`` as the reference does. The
        kernel's working buffers grow with the pairs, so a large call runs as consecutive calls of whole groups
        of at most :data:`CHUNK_PAIRS` pairs (one group may exceed it), in order: the same sum."""
        for args, _ in self.kernel_calls(out, xs, tokens, pair_weights, groups, gate_up, down, wide):
            _check(library().ninfer_routed_sum(*args), bank_format(gate_up))
        return out

    def add_routed_ids(self, out: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                       skip: torch.Tensor | None, gate_up, down, wide: torch.dtype) -> torch.Tensor:
        """:meth:`add_routed` for a call's routing as the router gives it (``ids``/``weights`` ``[T, k]``, ``skip``
        bool ``[T, k]`` or None, ``x [T, H]`` fp32 or bf16): the kernel sorts the pairs by expert, as
        :func:`~ninfer_qwen3_5.layers.host_compute.expert_groups` does, and gathers and widens their rows of x, so
        the sum is the same bits in one call from Python. For calls small enough that their working buffers need
        no chunking (:data:`CHUNK_PAIRS`)."""
        if ids.numel() > CHUNK_PAIRS:
            raise ValueError(f"add_routed_ids: {ids.numel()} pairs, more than one call takes ({CHUNK_PAIRS})")
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"add_routed_ids: x is {x.dtype}, not float32 or bfloat16")
        fmt = bank_format(gate_up)
        x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
        weights = weights.float().contiguous()
        flags = None if skip is None else skip.to(torch.bool).contiguous().view(torch.uint8)
        threads = self.threads or torch.get_num_threads()
        status = library().ninfer_routed_sum_ids(
            FORMATS[fmt], *bank_planes(gate_up), *bank_planes(down), out.shape[1], down.shape[-1], gate_up.shape[0],
            ids.data_ptr(), None if flags is None else flags.data_ptr(), weights.data_ptr(), ids.shape[0],
            ids.shape[1], x.data_ptr(), int(x.dtype == torch.bfloat16), int(wide == torch.bfloat16), out.data_ptr(),
            threads)
        _check(status, fmt)
        return out

    def kernel_calls(self, out: torch.Tensor, xs: torch.Tensor, tokens: torch.Tensor, pair_weights: torch.Tensor,
                     groups: list[tuple[int, int]], gate_up, down, wide: torch.dtype) -> list[tuple[tuple, list]]:
        """The ``ninfer_routed_sum`` calls :meth:`add_routed` makes, in order, each as (its ctypes arguments, the
        tensors those arguments point into, which must outlive the call). Calling them adds to ``out``."""
        fmt = bank_format(gate_up)
        inter = down.shape[-1]
        xf = xs.float().contiguous()
        tokens = tokens.to(torch.int64).contiguous()
        pair_weights = pair_weights.float().contiguous()
        threads = self.threads or torch.get_num_threads()
        calls, start = [], 0
        for chunk in _chunks(groups):
            meta = _groups(chunk)
            args = (FORMATS[fmt], *bank_planes(gate_up), *bank_planes(down), out.shape[1], inter, meta.data_ptr(),
                    meta.data_ptr() + len(chunk) * meta.element_size(), len(chunk),
                    xf[start].data_ptr(), tokens[start:].data_ptr(), pair_weights[start:].data_ptr(),
                    int(wide == torch.bfloat16), out.data_ptr(), threads)
            calls.append((args, [xf, tokens, pair_weights, meta, out]))
            start += sum(n for _, n in chunk)
        return calls


#: Pairs per kernel call of :meth:`NativeRows.add_routed`: its working buffers take about
#: ``pairs * (2 * hidden + 3 * inter) * 4`` bytes (92 MB at the 35B-A3B shape).
CHUNK_PAIRS = 4096


def _chunks(groups: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """``groups`` cut into consecutive runs of whole groups of at most :data:`CHUNK_PAIRS` pairs (a larger group
    alone)."""
    chunks: list[list[tuple[int, int]]] = [[]]
    size = 0
    for group in groups:
        if chunks[-1] and size + group[1] > CHUNK_PAIRS:
            chunks.append([])
            size = 0
        chunks[-1].append(group)
        size += group[1]
    return chunks
