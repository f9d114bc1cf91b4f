"""tools/host_kernels_engine_ab.py on the CPU at the tests' tiny widths: one decode line per stored format, batch
size and host kernel, every routed expert computed on the host."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support.native import require_native_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import host_kernels_engine_ab  # noqa: E402


def test_one_line_per_format_batch_and_kernel(tmp_path):
    require_native_kernel()
    out = tmp_path / "ab.txt"
    assert host_kernels_engine_ab.main(["--device", "cpu", "--tiny", "--layers", "2", "--experts", "8", "--tokens",
                                        "4", "--batches", "1,2", "--out", str(out)]) == 0
    found = re.findall(r"^(bf16|mixed) B=(\d) host experts \((\w+) kernel, threads auto\): B=\d decode ([\d,.]+) "
                       r"tok/s.* \| .*host [\d.]+", out.read_text(), flags=re.M)
    assert [(f, b, k) for f, b, k, _ in found] == [(f, b, k) for f in ("bf16", "mixed") for b in "12"
                                                    for k in ("torch", "native")]
    assert all(float(rate.replace(",", "")) > 0 for *_, rate in found)
