#!/bin/sh
# Download, on a machine with PyPI, the wheels the device needs for the GPU test lane (tools/gpu_tests.sh) and
# the architecture A/B (tools/gpu_ab_arch.py): the device has no network and its own torch, triton and
# transformers, which must never be replaced (docs/dev/gpu-tests.md).
#
#   sh tools/gpu_wheels.sh [DIR]          # default .gpu-wheels (git-ignored); then carry DIR in the device call
#   sh tools/gpu_wheels.sh --vision [DIR] # default .gpu-wheels-vision: ninfer-core's requirements and PyAV only
#   sh tools/gpu_wheels.sh --vision-halves # that set in two folders that each fit a device call beside the tree
#
# PyAV (~36 MB) is left out of the lane's set: with the working tree it would pass the device tool's 64 MiB. The
# tests that decode video on the GPU run in a call of their own that carries the vision set instead
# (docs/dev/gpu-tests.md).
#
# What is downloaded: the third-party requirements of requirements-dev.txt and of the four distributions'
# pyproject.toml files that the device image lacks (less NOT_FOR_THE_DEVICE), and their own requirements,
# recursively, for the device's Python (3.12, CPython, manylinux x86_64). Each is pinned to the version installed
# here when that satisfies its requirement (the versions the CPU suite runs with), else the newest that does.
# Packages the device image already has (DEVICE_HAS below, the image's package list) are not
# downloaded, except as a fallback: a small pure-Python wheel of one that a downloaded package requires with a
# version bound, so that an older copy on the device can be upgraded from the carried folder instead of failing
# the install. DIR/requirements.txt lists the top-level pins that tools/gpu_tests.sh installs; DIR/MANIFEST.txt
# every wheel with its role and size.
set -eu
cd "$(dirname "$0")/.."
vision=0
[ "${1:-}" = "--vision" ] && { vision=1; shift; }
if [ "${1:-}" = "--vision-halves" ]; then
    # The vision set cut in two folders of about 24 and 18 MiB, so that each fits beside the working tree in one
    # device call: .gpu-wheels-vision-1 (every wheel but PyAV's, the first half of PyAV's, the requirements and
    # PyAV's SHA-256) and .gpu-wheels-vision-2 (the second half). tools/gpu_vision_tests.sh joins them on the device.
    sh "$0" --vision .gpu-wheels-vision || exit 1
    rm -rf .gpu-wheels-vision-1 .gpu-wheels-vision-2
    mkdir -p .gpu-wheels-vision-1 .gpu-wheels-vision-2
    av=$(ls .gpu-wheels-vision/av-*.whl) || exit 1
    half=$(( ($(wc -c < "$av") + 1) / 2 ))
    head -c "$half" "$av" > .gpu-wheels-vision-1/av.part1
    tail -c +"$(( half + 1 ))" "$av" > .gpu-wheels-vision-2/av.part2
    (cd .gpu-wheels-vision && sha256sum "$(basename "$av")") > .gpu-wheels-vision-1/av.sha256
    for f in .gpu-wheels-vision/*; do [ "$f" = "$av" ] || cp "$f" .gpu-wheels-vision-1/; done
    rm -rf .gpu-wheels-vision
    du -sh .gpu-wheels-vision-1 .gpu-wheels-vision-2
    exit 0
fi
if [ "$vision" -eq 1 ]; then dest="${1:-.gpu-wheels-vision}"; else dest="${1:-.gpu-wheels}"; fi
rm -rf "$dest"
mkdir -p "$dest"
python3 - "$dest" "$vision" <<'PY'
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

dest = Path(sys.argv[1])
VISION = sys.argv[2] == "1"
PYTHON = ("3.12", "3.12.3")        # the device's python3 (/opt/torch/.venv, Python 3.12.3)
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)]   # pip matches a platform tag exactly: name them all
MARKERS = {"python_version": PYTHON[0], "python_full_version": PYTHON[1], "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
# The device image's Python packages (as listed for the image on 2026-11-17): present, never downloaded as needed.
DEVICE_HAS = set(map(canonicalize_name, """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy
seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy
tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()))
# Never carried, not even as a fallback: the device's own accelerator stack and the big shared libraries.
NEVER = set(map(canonicalize_name, "torch triton transformers tokenizers numpy safetensors huggingface-hub hf-xet "
                                    "jinja2 markupsafe regex pyyaml setuptools pip".split())) | {
    n for n in DEVICE_HAS if n.startswith(("nvidia-", "cuda-", "jax"))}
# Test requirements the lane never needs on the device: only CPU tests use them, through pytest.importorskip
# (selenium drives the chat page in a browser the device does not have; Ray Serve is tested on the CPU only, and
# its wheels alone would pass the device tool's 64 MiB carry limit).
NOT_FOR_THE_DEVICE = {"import-linter", "selenium", "ray"} | (set() if VISION else {"av"})
FALLBACK_MAX_BYTES = 1 << 20
OUR_DIRS = ["ninfer-core", "ninfer-qwen3_5", "ninfer-qwen4exp", "ninfer-convert", "ninfer-serve"]
OURS = set(map(canonicalize_name, OUR_DIRS))   # compared by canonical name: ninfer-qwen3_5 is ninfer-qwen3-5


def top_level() -> list[Requirement]:
    if VISION:
        core = tomllib.loads(Path("ninfer-core/pyproject.toml").read_text())["project"]["dependencies"]
        return [Requirement(r) for r in [*core, *vision_extra()]]
    lines = [ln.split("#", 1)[0].strip() for ln in Path("requirements-dev.txt").read_text().splitlines()]
    reqs = [Requirement(ln) for ln in lines if ln]
    for dist in OUR_DIRS:
        project = tomllib.loads(Path(dist, "pyproject.toml").read_text())["project"]
        reqs += [Requirement(r) for r in project.get("dependencies", [])]
    return [r for r in reqs
            if canonicalize_name(r.name) not in OURS and (r.marker is None or r.marker.evaluate(MARKERS))]


def vision_extra() -> list[str]:
    project = tomllib.loads(Path("ninfer-qwen3_5/pyproject.toml").read_text())["project"]
    return project["optional-dependencies"]["vision"]


def local_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def download(req: str) -> Path:
    before = set(dest.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--dest", str(dest),
           "--python-version", PYTHON[0], "--implementation", "cp", "--abi", "cp312", "--abi", "abi3",
           "--abi", "none", *[a for p in PLATFORMS for a in ("--platform", p)], req]
    subprocess.run(cmd, check=True)
    new = set(dest.glob("*.whl")) - before
    name = canonicalize_name(Requirement(req).name)
    mine = [p for p in new | before if canonicalize_name(parse_wheel_filename(p.name)[0]) == name]
    if len(mine) != 1:
        sys.exit(f"gpu_wheels: expected one wheel of {name}, found {[p.name for p in mine]}")
    return mine[0]


def requires(wheel: Path) -> list[Requirement]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [Requirement(v) for k, v in re.findall(r"^(Requires-Dist): (.+)$", text, re.M)]


def pin(req: Requirement) -> str:
    """name==local version when it satisfies req, else req itself (pip then takes the newest that does)."""
    here = local_version(req.name)
    if here is not None and req.specifier.contains(here, prereleases=True):
        return f"{req.name}=={here}"
    return f"{req.name}{req.specifier}"


top = list({canonicalize_name(r.name): r for r in top_level()
            if canonicalize_name(r.name) not in DEVICE_HAS | NOT_FOR_THE_DEVICE}.values())
todo = list(top)
needed: dict[str, Path] = {}
expanded: set[tuple[str, str]] = set()     # (package, extra) whose requirements are queued
bounds: dict[str, list[str]] = {}           # device-present packages that downloaded ones require with a bound
while todo:
    req = todo.pop(0)
    name = canonicalize_name(req.name)
    if name in DEVICE_HAS:
        if str(req.specifier):
            bounds.setdefault(name, []).append(str(req.specifier))
        continue
    if name in needed:
        version = parse_wheel_filename(needed[name].name)[1]
        if not req.specifier.contains(version, prereleases=True):
            sys.exit(f"gpu_wheels: {name} {version} was chosen but something requires {req}")
    else:
        needed[name] = download(pin(req))
    for extra in {"", *req.extras} - {e for n, e in expanded if n == name}:
        expanded.add((name, extra))
        env = dict(MARKERS, extra=extra)
        todo += [r for r in requires(needed[name]) if r.marker is None or r.marker.evaluate(env)]

fallback: dict[str, Path] = {}
for name in sorted(set(bounds) - NEVER):
    here = local_version(name)
    if here is None:
        continue
    wheel = download(f"{name}=={here}")
    pure = all(t.platform == "any" for t in parse_wheel_filename(wheel.name)[3])
    if not pure or wheel.stat().st_size > FALLBACK_MAX_BYTES:
        wheel.unlink()
        continue
    fallback[name] = wheel

versions = {n: str(parse_wheel_filename(w.name)[1]) for n, w in needed.items()}
(dest / "requirements.txt").write_text(
    "# top-level packages the GPU lane installs (tools/gpu_wheels.sh); the rest comes in as their requirements\n"
    + "".join(f"{r.name}=={versions[canonicalize_name(r.name)]}\n" for r in top))
rows = [(w, "needed") for w in needed.values()] + [(w, f"fallback ({'; '.join(bounds[n])})") for n, w in
                                                     fallback.items()]
manifest = [f"{w.stat().st_size:>10}  {w.name}  {role}" for w, role in sorted(rows, key=lambda r: r[0].name)]
total = sum(w.stat().st_size for w, _ in rows)
(dest / "MANIFEST.txt").write_text("\n".join(manifest) + f"\n{total:>10}  total\n")
print("\n".join(manifest))
print(f"{len(rows)} wheels, {total / 2**20:.1f} MiB in {dest}/ (top level: {', '.join(r.name for r in top)})")
PY
