"""tools/sass_report.py builds a decode kernel for sm_90 on a machine without a GPU and reads its SASS.

Run in a subprocess without TRITON_INTERPRET (the Triton kernel suite sets it for this process when there is no
GPU, and interpreted kernels cannot be compiled). Checked on the MoE router, whose ninth-session build property
the report shows: no spills, and its k rounds as warp-wide REDUX maxima rather than shuffle trees.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton ships no cuobjdump here")
def _report(tmp_path, *presets: str) -> tuple[dict, subprocess.CompletedProcess]:
    """tools/sass_report.py run on ``presets`` (compiled, never interpreted): its JSON report and the process."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "sass_report.py"), *presets, "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text()), run


def test_router_build_report(tmp_path):
    reports, run = _report(tmp_path, "router")
    report = reports["router"]
    assert report["kernel"] == "moe_router._router_kernel" and report["warps"] == 1
    assert report["reg"] > 0 and report["stack"] == 0
    assert report["counts"].get("REDUX", 0) >= 8 and report["counts"].get("SHFL", 0) == 0, report["counts"]
    assert report["issue_order"].startswith("LDG"), report["issue_order"]
    assert "== router (moe_router._router_kernel, 1 warps)" in run.stdout


def test_unknown_preset_is_named():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "sass_report.py"), "no-such-kernel"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 2 and "no preset matches ['no-such-kernel']" in run.stderr


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="triton ships no cuobjdump here")
def test_nvfp4_moe_kernels_build_for_sm90(tmp_path):
    # The interpreter runs the quantized MoE kernels' nvfp4 variants but never lowers them: the sm_90 build does.
    # The decode GEMVs keep everything in registers; the grouped GEMMs build (the down kernel's 64 x 128 fp32
    # accumulator spills a little at every format).
    report, _ = _report(tmp_path, "qmoe_nvfp4")
    assert sorted(report) == ["qmoe_nvfp4_down", "qmoe_nvfp4_gate_up", "qmoe_nvfp4_grouped_down",
                              "qmoe_nvfp4_grouped_gate_up"]
    for name in ("qmoe_nvfp4_gate_up", "qmoe_nvfp4_down"):
        assert report[name]["reg"] > 0 and report[name]["stack"] == 0, (name, report[name])
    assert all(r["instructions"] > 0 for r in report.values())


def test_the_varlen_prefill_kernels_build_for_sm90(tmp_path):
    """The kernels that run a step's chunks from device offsets (their early return and device-bounded loops) build
    for the H200; the GDN prep and scan keep the one-sequence builds' property of no spills, and the varlen conv at its
    launch's 8 warps has none either."""
    reports, _ = _report(tmp_path, "varlen")
    assert set(reports) == {"gdn_prep_varlen", "gdn_scan_varlen", "conv_varlen", "conv_varlen_state"}
    assert all(reports[k]["stack"] == 0 for k in ("gdn_prep_varlen", "gdn_scan_varlen", "conv_varlen"))
    assert all(r["reg"] > 0 and r["instructions"] > 0 for r in reports.values())


def test_the_qwen4exp_kernels_build_for_sm90(tmp_path):
    """Qwen4-Exp's kernels at the published shapes build for the H200 with no spills: QSA's (the selection's, the
    attention's decode and prefill builds, the combine), the hyper-connection steps, the norms and the sigmoid-gated
    GDN decode kernel. (A build catches
    what the interpreter lets through: a variable whose type two branches disagree on.)"""
    reports, _ = _report(tmp_path, "qsa", "q4x")
    assert set(reports) == {"qsa_side_write", "qsa_block_keys", "qsa_scores", "qsa_scores_narrow", "qsa_select",
                            "qsa_attn_decode", "qsa_attn_prefill", "qsa_combine", "q4x_hc_act", "q4x_hc_mix",
                            "q4x_hc_write", "q4x_hc_write_fp32", "q4x_grouped_norm", "q4x_gated_norm_sigmoid",
                            "q4x_gdn_decode_sigmoid"}
    assert all(r["stack"] == 0 and r["reg"] > 0 and r["instructions"] > 0 for r in reports.values()), reports
    # hc_write's contract rounds the product before the sum: no fused multiply-add in its PTX (with fp fusion
    # on, the GPU made x + a*y one fma in both dtypes and lost the bitwise match).
    assert reports["q4x_hc_write"]["ptx_fma"] == reports["q4x_hc_write_fp32"]["ptx_fma"] == 0


def test_the_scores_dot_is_never_narrower_than_the_tensor_cores_take():
    """A dot's K below 16 does not build for the GPU (a test model's indexer width of 8 failed there): the launch
    widens it (qsa_scores_narrow builds that width above)."""
    from ninfer_qwen4exp.ops.triton.indexer import dot_width

    assert [dot_width(d) for d in (1, 8, 16, 24, 128)] == [16, 16, 16, 32, 128]


def test_the_tensor_core_gemvs_cut_the_loop_instructions_per_byte(tmp_path):
    """The quantized decode GEMVs' K loop, read from the sm_90 build: the tensor-core kernels (q4 and its
    candidates, q8, fp8: codes decoded by inline PTX, A from registers) spend well under half the CUDA-core
    kernel's instructions per weight byte of the same format, on HMMA, with no barrier-bound layout conversion per
    step; the report's innermost-loop count finds each kernel's K loop."""
    reports, run = _report(tmp_path, "qgemv")
    assert set(reports) == {"qgemv_q4", "qgemv_q4_tc3", "qgemv_q4_tc5", "qgemv_q4_tc", "qgemv_q4_tc_norm",
                            "qgemv_q4_tc_prefetch", "qgemv_q4_tc_norm_prefetch", "qgemv_q8", "qgemv_q8_tc",
                            "qgemv_q8_tc_norm", "qgemv_fp8", "qgemv_fp8_tc", "qgemv_q4_tc_l2", "qgemv_q4_tc_norm_l2",
                            "qgemv_q8_tc_l2", "qgemv_fp8_tc_l2", "qgemv_q4_streamk", "qgemv_q4_streamk_norm"}
    for name, engine in (("qgemv_q4_tc3", "qgemv_q4"), ("qgemv_q4_tc5", "qgemv_q4"), ("qgemv_q4_tc", "qgemv_q4"),
                         ("qgemv_q4_tc_norm", "qgemv_q4"), ("qgemv_q4_tc_prefetch", "qgemv_q4"),
                         ("qgemv_q4_tc_norm_prefetch", "qgemv_q4"), ("qgemv_q8_tc", "qgemv_q8"),
                         ("qgemv_q8_tc_norm", "qgemv_q8"), ("qgemv_fp8_tc", "qgemv_fp8")):
        r = reports[name]
        # Triton 3.9 builds q8 at one row with HGMMA and a few spilled registers (3.6, the device's, with HMMA and
        # none): a small stack is allowed there, a large one is a regression.
        assert r["stack"] <= (0 if "q4" in name else 64), r
        assert r["counts"].get("HMMA", 0) + r["counts"].get("HGMMA", 0) > 0, r
        assert r["loop_per_byte"] < reports[engine]["loop_per_byte"] / 2, (name, r["loop_per_byte"], engine)
    # The prefetch candidate peels the first K step off the loop and leaves the loop itself as it was.
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm"):
        plain, pf = reports[name]["loop_per_byte"], reports[name + "_prefetch"]["loop_per_byte"]
        assert abs(pf - plain) <= 0.02 * plain, (name, plain, pf)
    # The L2 prefetch candidate: one bulk prefetch (in a loop over the rows' addresses) issued before the PDL wait,
    # the K loop as it was.
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm", "qgemv_q8_tc", "qgemv_fp8_tc"):
        plain, l2 = reports[name], reports[name + "_l2"]
        assert l2["counts"].get("UBLKPF", 0) >= 1 and l2["l2_prefetch_before_wait"] is True, (name, l2)
        assert "UBLKPF" not in plain["counts"], (name, plain)
        assert abs(l2["loop_per_byte"] - plain["loop_per_byte"]) <= 0.03 * plain["loop_per_byte"], (name, l2, plain)
    # Stream-K shares: the same K step in the loop over a share's pieces, no spills.
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm"):
        plain, sk = reports[name], reports[name.replace("_tc", "_streamk")]
        assert sk["stack"] == 0 and sk["counts"].get("HMMA", 0) + sk["counts"].get("HGMMA", 0) > 0, (name, sk)
        assert abs(sk["loop_per_byte"] - plain["loop_per_byte"]) <= 0.03 * plain["loop_per_byte"], (name, sk, plain)
    assert "innermost loop" in run.stdout


def test_the_bf16_tensor_core_gemv_streams_through_shared_memory(tmp_path):
    """``linear_tc``'s K loop (NINFER_GEMV_TC=1): the weight tiles arrive by async copies into shared memory
    (LDGSTS, the software pipeline) and feed HMMA (HGMMA on newer Triton builds), with no spills and under one
    instruction a weight byte a thread; a CUDA-core GEMV spends several an element on every row it multiplies. The
    L2-prefetch build (NINFER_GEMV_TC_L2_PREFETCH=1) adds the bulk prefetch (UBLKPF) and nothing to the loop."""
    reports, _ = _report(tmp_path, "gemv_tc_bf16")
    assert set(reports) == {"gemv_tc_bf16", "gemv_tc_bf16_norm_swiglu", "gemv_tc_bf16_l2"}
    for r in reports.values():
        assert r["stack"] == 0 and r["counts"].get("LDGSTS", 0) > 0, r
        assert r["counts"].get("HMMA", 0) + r["counts"].get("HGMMA", 0) > 0, r
    assert reports["gemv_tc_bf16"]["loop_per_byte"] < 1.0, reports
    plain, l2 = reports["gemv_tc_bf16"], reports["gemv_tc_bf16_l2"]
    assert l2["counts"].get("UBLKPF", 0) > 0 and plain["counts"].get("UBLKPF", 0) == 0, (plain, l2)
    assert l2["loop_instructions"] <= plain["loop_instructions"], (plain, l2)
