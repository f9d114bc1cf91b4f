#!/usr/bin/env python3
"""What the H200 would run, read on a machine without a GPU: each decode kernel compiled for sm_90 and summarised.

Triton compiles for a target it is told about (``GPUTarget("cuda", 90, 32)``) without a device, and its wheel carries
``cuobjdump``. For each kernel, at the 35B-A3B decode shapes (prefill ones for the quantized MoE GEMMs) with the
launch's constexprs and num_warps, this prints: registers, stack (spills), shared memory, instruction counts of the
memory, shuffle/reduction and barrier kinds, the blocked layouts, and the *issue order* of loads against the math
(``LDGx64 HMMAx16 ...``, runs compressed). The order is what shows latency to cut: a load issued after math it does
not depend on is a second memory round trip in a row (V after the QK dot, a slot id after the recurrence, the gates'
loads after the conv's stores). Device time is the scarce thing; this costs none.

    python3 tools/sass_report.py                 # every preset
    python3 tools/sass_report.py router step     # presets whose name contains a word
    python3 tools/sass_report.py --json out.json

Integer arguments named like strides (or listed in a preset's ``divisible``), and pointers (``*_ptr``, or named in
a preset's ``pointers``: the quantized kernels' plane arguments), are compiled as divisible by 16 (what Triton's
launch-time specialisation sees for the engine's contiguous tensors: without it loads do not vectorise and the
build differs).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace

# Instruction kinds counted; a kind is matched on the opcode's first dot-separated word (LDG.E.128 -> LDG).
KINDS = ("LDG", "LDGSTS", "LDS", "LDL", "STG", "STS", "STL", "SHFL", "REDUX", "BAR", "HMMA", "HGMMA", "FFMA", "HFMA2",
         "MUFU", "UBLKPF", "ACQBULK")
# Issue-order markers: memory traffic against the math it may wait behind.
ORDER = ("LDGSTS", "LDG", "STG", "HMMA", "HGMMA", "MUFU", "BAR", "REDUX", "SHFL")


@dataclass(frozen=True)
class Preset:
    module: str
    kernel: str
    constexprs: dict
    warps: int = 4
    pointers: dict = field(default_factory=dict)      # pointer arg -> dtype (default *bf16)
    floats: tuple = ("eps", "scale", "qk_scale")
    divisible: tuple = ()                              # integer args compiled as divisible by 16 (row strides)
    loop_bytes: float = 0.0                            # weight bytes a thread reads per K-loop iteration, if any
    options: dict = field(default_factory=dict)        # more compile options, as the launch passes them


def _presets() -> dict[str, Preset]:
    import triton.language as tl

    # The quantized MoE kernels in nvfp4 (FMT 2): planes codes (*u8), divisor (*fp32), scale tiles (*u8), their row
    # strides (the divisor's 0) divisible by 16. Decode: one token, the launch's BN/NG/NCH for H = 2048, I = 512
    # (a 512-lane chunk is 32 blocks); prefill: 64-row blocks (T = 2048, k = 8, E = 256), BK one tile column.
    nv_planes = {"w0": "*u8", "w1": "*fp32", "w2": "*u8"}
    nv_strides = ("s0", "s1", "s2")
    presets = {
        "router": Preset("ninfer.ops.triton.moe_router", "_router_kernel", dict(TOPK=8, KP=8, BE=256, PDL=True), 1,
                         {"w_ptr": "*fp32", "i_ptr": "*i64"}),
        "gdn_conv_gates": Preset("ninfer_qwen3_5.ops.triton.gdn_decode", "_conv_gates_kernel",
                                 dict(K=4, BLOCK_C=256, BLOCK_K=4, BH=32, INTERP=False, PDL=True), 4,
                                 {"slots_ptr": "*i64", "out_slots_ptr": "*i64", "na_ptr": "*fp32", "dt_ptr": "*fp32",
                                  "g_ptr": "*fp32", "beta_ptr": "*fp32"}),
        "gdn_step": Preset("ninfer_qwen3_5.ops.triton.gdn_decode", "_step_norm_kernel",
                           dict(R=2, DK=128, DV=128, KEY_DIM=2048, BK=128, BV=128, NW_DTYPE=tl.bfloat16, INTERP=False,
                                PDL=True, SIGMOID=False), 4,
                           {"g_ptr": "*fp32", "beta_ptr": "*fp32", "st_ptr": "*fp32", "slots_ptr": "*i64",
                            "out_slots_ptr": "*i64"}),
        "gdn_one": Preset("ninfer_qwen3_5.ops.triton.gdn_decode", "_decode_kernel",
                          dict(R=2, DK=128, DV=128, KEY_DIM=2048, BK=128, BV=128,
                               NW_DTYPE=tl.bfloat16, INTERP=False, PDL=True, SIGMOID=False), 4,
                          {"st_ptr": "*fp32", "slots_ptr": "*i64", "out_slots_ptr": "*i64", "na_ptr": "*fp32",
                           "dt_ptr": "*fp32", "tk_ptr": "*i32"}),
        # The MoE prefill's grouped expert GEMMs at their 8k launch (64-row blocks, H = 2048, I = 512): whether the
        # dots become Hopper's warpgroup MMA (HGMMA) or the older mma.sync (HMMA).
        "moe_gate_up_prefill": Preset("ninfer.ops.triton.moe", "_moe_gate_up_kernel",
                                      dict(TOPK=8, BM=64, BN=64, BK=64, EVEN_K=True, IEEE=False, UPCAST=False), 4,
                                      {"pair_ptr": "*i64", "bexp_ptr": "*i64"}, divisible=("H", "NI")),
        "moe_down_prefill": Preset("ninfer.ops.triton.moe", "_moe_down_kernel",
                                   dict(BM=64, BN=128, BK=64, EVEN_K=True, IEEE=False, UPCAST=False, INTERP=False),
                                   4, {"pair_ptr": "*i64", "bexp_ptr": "*i64", "y_ptr": "*bf16"},
                                   divisible=("H", "NI")),
        # The prefill kernels that read a step's chunks from device offsets (bf16, the 35B-A3B GDN heads).
        "gdn_prep_varlen": Preset("ninfer_qwen3_5.ops.triton.gdn", "_gdn_chunk_prep_kernel",
                                  dict(R=2, DK=128, DV=128, BK=128, BV=128, BT=64, PREC="tf32", VARLEN=True, BS=16), 8,
                                  {"g_ptr": "*fp32", "b_ptr": "*fp32", "w_ptr": "*fp32", "u_ptr": "*fp32",
                                   "qg_ptr": "*fp32", "kd_ptr": "*fp32", "aqk_ptr": "*fp32", "gl_ptr": "*fp32",
                                   "cu_ptr": "*i32"}),
        "gdn_scan_varlen": Preset("ninfer_qwen3_5.ops.triton.gdn", "_gdn_chunk_scan_kernel",
                                  dict(DK=128, DV=128, BK=128, BV=128, BVS=16, BT=64, PREC="tf32", VARLEN=True, BS=16),
                                  8,
                                  {"w_ptr": "*fp32", "u_ptr": "*fp32", "qg_ptr": "*fp32", "kd_ptr": "*fp32",
                                   "aqk_ptr": "*fp32", "gl_ptr": "*fp32", "st_ptr": "*fp32", "cu_ptr": "*i32",
                                   "slot_ptr": "*i64"}),
        "conv_varlen": Preset("ninfer_qwen3_5.ops.triton.conv1d", "_conv_varlen_kernel",
                              dict(K=4, BLOCK_T=16, BLOCK_C=256, INTERP=False, BS=16), 8,
                              {"cu_ptr": "*i32", "slot_ptr": "*i64"}),
        "conv_varlen_state": Preset("ninfer_qwen3_5.ops.triton.conv1d", "_conv_varlen_state_kernel",
                                    dict(K=4, BLOCK_C=256, BLOCK_K=4, INTERP=False), 4,
                                    {"cu_ptr": "*i32", "slot_ptr": "*i64"}),
        "attn_prefill_gate": Preset("ninfer.ops.triton.attention", "_prefill_kernel",
                                    dict(R=8, D=256, PAGE=16, BLOCK_B=16, BLOCK_M=64, BLOCK_N=32, BLOCK_D=256,
                                         P_SPLIT=False, FP32_DOT=False, INTERP=False, HAS_GATE=True,
                                         KV_SPLIT=False), 8,
                                    {"cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "pt_ptr": "*i32"}),
        # The prefill's KV-split candidate at the 9B shape's launch (GQA 4, D = 256, 128-pair blocks), and its merge.
        "attn_prefill_kv_split": Preset("ninfer.ops.triton.attention", "_prefill_kernel",
                                        dict(R=4, D=256, PAGE=16, BLOCK_B=32, BLOCK_M=128, BLOCK_N=64, BLOCK_D=256,
                                             P_SPLIT=False, FP32_DOT=False, INTERP=False, HAS_GATE=True,
                                             KV_SPLIT=True), 8,
                                        {"cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "pt_ptr": "*i32",
                                         "part_ptr": "*fp32"}, options={"num_stages": 2}),
        "attn_prefill_combine": Preset("ninfer.ops.triton.attention_parts", "_prefill_combine_kernel",
                                       dict(R=4, D=256, BLOCK_B=32, BLOCK_M=128, BLOCK_D=256, DC=64, INTERP=False,
                                            HAS_GATE=True), 4,
                                       {"cu_q_ptr": "*i32", "part_ptr": "*fp32"}),
        "gdn_verify": Preset("ninfer_qwen3_5.ops.triton.gdn_verify", "_verify_kernel",
                             dict(R=2, DK=128, DV=128, KEY_DIM=2048, BK=128, BV=128,
                                  NW_DTYPE=tl.bfloat16, INTERP=False, PDL=True, SIGMOID=False), 4,
                             {"st_ptr": "*fp32", "sst_ptr": "*fp32", "starts_ptr": "*i64", "counts_ptr": "*i64",
                              "live_ptr": "*i64", "snaps_ptr": "*i64", "na_ptr": "*fp32", "dt_ptr": "*fp32"}),
        "qk_norm_rope": Preset("ninfer_qwen3_5.ops.triton.qk_norm_rope", "_qk_norm_rope_cache_kernel",
                               dict(HQ=16, HKV=2, D=256, HALF=32, PAGE=16, BLOCK_D=256, BLOCK_HALF=32, BLOCK_REST=256,
                                    INTERP=False, PDL=True), 4,
                               {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}),
        "attn_split": Preset("ninfer.ops.triton.attention", "_decode_split_kernel",
                             dict(NUM_SPLITS=64, R=8, D=256, PAGE=16, BLOCK_H=16, BLOCK_D=256, BLOCK_N=32,
                                  MIN_SPLIT_TILES=1, MAX_SPLITS_C=64, DIRECT=False, HAS_GATE=True, P_SPLIT=True,
                                  FP32_DOT=False, INTERP=False, PDL=True), 4,
                             {"kv_lens_ptr": "*i32", "pt_ptr": "*i32", "acc_ptr": "*fp32", "ml_ptr": "*fp32"}),
        "attn_combine": Preset("ninfer.ops.triton.attention", "_decode_combine_kernel",
                               dict(NUM_SPLITS=64, D=256, BLOCK_N=32, MIN_SPLIT_TILES=1, MAX_SPLITS_C=64, BLOCK_S=64,
                                    BLOCK_D=256, HAS_GATE=True, INTERP=False, PDL=True), 4,
                               {"acc_ptr": "*fp32", "ml_ptr": "*fp32", "kv_lens_ptr": "*i32"}),
        "gemv_norm": Preset("ninfer.ops.triton.linear", "_gemv_kernel",
                            dict(BM=1, BN=4, BK=2048, ONE_TILE=True, EXACT=True, NORM=True, SWIGLU=False,
                                 INTERP=False, PDL=True), 4),
        "moe_gate_up": Preset("ninfer.ops.triton.moe_gemv", "_gate_up_gemv_kernel",
                              dict(TOPK=8, BN=8, BK=512, EVEN=True, PDL=True), 4, {"ids_ptr": "*i64"}),
        "moe_down": Preset("ninfer.ops.triton.moe_gemv", "_down_gemv_one_shot_kernel",
                           dict(TOPK=8, KP=8, BN=4, BK=512, BKS=512, HAS_SHARED=True, PDL=True), 8,
                           {"ids_ptr": "*i64", "rw_ptr": "*fp32"}),
        # Qwen4-Exp's QSA at the published shapes (4 indexer heads of 128, blocks of 4, 512 kept, 24 query and 2 KV
        # heads of 256, 16-token pages, bf16): the selection's kernels and the attention's decode and prefill builds.
        "qsa_side_write": Preset("ninfer_qwen4exp.ops.triton.indexer", "_side_write_kernel",
                                 dict(DI=128, R=64, W=256, PAGE=16, BLOCK_W=256, INTERP=False), 1,
                                 {"c_ptr": "*fp32", "s_ptr": "*fp32", "slot_ptr": "*i64"}),
        "qsa_block_keys": Preset("ninfer_qwen4exp.ops.triton.indexer", "_block_keys_kernel",
                                 dict(RATIO=4, DI=128, ROT=64, PAGE=16, BLOCK_J=16, BLOCK_R=4, BLOCK_D=128,
                                      BLOCK_HALF=32, BLOCK_REST=64, INTERP=False), 4,
                                 {"kv_lens_ptr": "*i32", "pt_ptr": "*i32"}),
        "qsa_scores": Preset("ninfer_qwen4exp.ops.triton.indexer", "_scores_kernel",
                             dict(H=4, DI=128, RATIO=4, BLOCK_B=8, BLOCK_H=16, BLOCK_D=128, BLOCK_J=64, INTERP=False),
                             8, {"cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "sc_ptr": "*fp32"},
                             floats=("sqrt_d",)),
        # The scores kernel at a test model's indexer width (8), with the launch's dot width for it (16).
        "qsa_scores_narrow": Preset("ninfer_qwen4exp.ops.triton.indexer", "_scores_kernel",
                                    dict(H=4, DI=8, RATIO=4, BLOCK_B=8, BLOCK_H=16, BLOCK_D=16, BLOCK_J=64,
                                         INTERP=False),
                                    8, {"cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "sc_ptr": "*fp32"},
                                    floats=("sqrt_d",)),
        "qsa_select": Preset("ninfer_qwen4exp.ops.triton.indexer", "_select_kernel",
                             dict(RATIO=4, TOPK=512, WIDTH=2051, SPARSE=True, BLOCK_B=8, BLOCK_J=256, BLOCK_R=4,
                                  BLOCK_W=1024), 4,
                             {"sc_ptr": "*fp32", "cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "sel_ptr": "*i64"}),
        "qsa_attn_decode": Preset("ninfer_qwen4exp.ops.triton.sparse_attention", "_attn_kernel",
                                  dict(R=12, D=256, PAGE=16, WIDTH=2051, PER=64, BLOCK_B=8, BLOCK_H=16, BLOCK_D=256,
                                       BLOCK_N=32, DIRECT=False, P_SPLIT=True, FP32_DOT=False, INTERP=False,
                                       HAS_GATE=True), 4,
                                  {"sel_ptr": "*i64", "cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "pt_ptr": "*i32",
                                   "acc_ptr": "*fp32", "ml_ptr": "*fp32"}),
        "qsa_attn_prefill": Preset("ninfer_qwen4exp.ops.triton.sparse_attention", "_attn_kernel",
                                   dict(R=12, D=256, PAGE=16, WIDTH=2051, PER=2080, BLOCK_B=8, BLOCK_H=16,
                                        BLOCK_D=256, BLOCK_N=32, DIRECT=True, P_SPLIT=False, FP32_DOT=False,
                                        INTERP=False, HAS_GATE=True), 4,
                                   {"sel_ptr": "*i64", "cu_q_ptr": "*i32", "kv_lens_ptr": "*i32", "pt_ptr": "*i32",
                                    "acc_ptr": "*fp32", "ml_ptr": "*fp32"}),
        "qsa_combine": Preset("ninfer_qwen4exp.ops.triton.sparse_attention", "_combine_kernel",
                              dict(D=256, SPLITS=33, BLOCK_S=64, BLOCK_D=256, INTERP=False, HAS_GATE=True), 4,
                              {"acc_ptr": "*fp32", "ml_ptr": "*fp32"}),
        # Qwen4-Exp's hyper-connection steps and per-stream norm at the published bank (4 streams of 2560, bf16).
        "q4x_hc_act": Preset("ninfer_qwen4exp.ops.triton.hyper", "_act_kernel",
                             dict(R=320, STREAMS=4, BLOCK_T=8, BLOCK_R=512, INTERP=False), 4),
        "q4x_hc_mix": Preset("ninfer_qwen4exp.ops.triton.hyper", "_mix_kernel",
                             dict(STREAMS=4, HAS_G=True, BLOCK_H=1024, BLOCK_S=4, INTERP=False), 4),
        # hc_write as launched: fp fusion off (the product rounds before the sum), in bf16 and fp32.
        "q4x_hc_write": Preset("ninfer_qwen4exp.ops.triton.hyper", "_write_kernel",
                               dict(STREAMS=4, BLOCK=2048, INTERP=False), 4, options={"enable_fp_fusion": False}),
        "q4x_hc_write_fp32": Preset("ninfer_qwen4exp.ops.triton.hyper", "_write_kernel",
                                    dict(STREAMS=4, BLOCK=2048, INTERP=False), 4,
                                    {p: "*fp32" for p in ("x_ptr", "y_ptr", "a_ptr", "out_ptr")},
                                    options={"enable_fp_fusion": False}),
        "q4x_grouped_norm": Preset("ninfer.ops.triton.norm", "_rms_norm_kernel",
                                   dict(N=2560, GROUPS=4, BLOCK_M=1, BLOCK_N=4096, INTERP=False, PDL=True), 4),
        "q4x_gdn_decode_sigmoid": Preset("ninfer_qwen3_5.ops.triton.gdn_decode", "_decode_kernel",
                                         dict(R=3, DK=128, DV=128, KEY_DIM=2048, BK=128, BV=128,
                                              NW_DTYPE=tl.bfloat16, INTERP=False, PDL=True, SIGMOID=True), 4,
                                         {"st_ptr": "*fp32", "slots_ptr": "*i64", "out_slots_ptr": "*i64",
                                          "na_ptr": "*fp32", "dt_ptr": "*fp32", "tk_ptr": "*i32"}),
        "q4x_gated_norm_sigmoid": Preset("ninfer_qwen3_5.ops.triton.gated_norm", "_gated_rms_norm_kernel",
                                         dict(N=128, NW_DTYPE=tl.bfloat16, BLOCK_M=32, BLOCK_N=128, INTERP=False,
                                              PDL=True, SIGMOID=True), 4),
        # The q4 decode GEMV at one row of x (9B projections: K = 4096): the engine's CUDA-core kernel against the
        # tensor-core candidates of tools/quant_gemv_candidates.py; loop_bytes = base-plane bytes a thread reads
        # per K-loop iteration (engine: 4 rows x 1,024 B / 128 threads; tc3/tc5: 128 rows x 256 B / 128 threads).
        "qgemv_q4": Preset("ninfer.ops.triton.quant_gemv", "_qgemv_kernel",
                           dict(KIND=0, BITS=4, BM=1, BN=4, BB=1024, EVEN=True, SPLIT=1, REDUCE=False, NORM=False, SWIGLU=False,
                                INTERP=False, PDL=True), 4,
                           {"b_ptr": "*u8", "h_ptr": "*u8", "s_ptr": "*fp16", "part_ptr": "*fp32"},
                           divisible=("K", "BYTES", "sx", "sb", "sh", "ss", "sy", "sr", "shn", "sro"), loop_bytes=32),
        "qgemv_q4_tc3": Preset("quant_gemv_candidates", "_qgemv_tc3", dict(BN=128, GPI=8, MP=1, M=1, INTERP=False), 4,
                               {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32"},
                               divisible=("BYTES", "sx", "sb", "ss", "sp"), loop_bytes=256),
        "qgemv_q4_tc5": Preset("quant_gemv_candidates", "_qgemv_tc5", dict(BN=128, GPI=8, MP=1, M=1, INTERP=False), 4,
                               {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32"},
                               divisible=("BYTES", "sx", "sb", "ss", "sp"), loop_bytes=256),
        "qgemv_q4_tc": Preset("ninfer.ops.triton.quant_gemv_tc", "_q4_tc_kernel",
                              dict(BN=128, GPI=8, MP=1, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=False, PREFETCH=False, L2PF=False, INTERP=False, PDL=True), 4,
                              {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32", "cnt_ptr": "*i32"},
                              divisible=("K", "BYTES", "sx", "sb", "ss", "sy", "sp", "sr", "sh", "sro"),
                              loop_bytes=256),
        "qgemv_q4_tc_norm": Preset("ninfer.ops.triton.quant_gemv_tc", "_q4_tc_kernel",
                                   dict(BN=128, GPI=8, MP=1, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=True, PREFETCH=False, L2PF=False, INTERP=False, PDL=True), 4,
                                   {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32", "cnt_ptr": "*i32"},
                                   divisible=("K", "BYTES", "sx", "sb", "ss", "sy", "sp", "sr", "sh", "sro"),
                                   loop_bytes=256),
        "qgemv_q8": Preset("ninfer.ops.triton.quant_gemv", "_qgemv_kernel",
                           dict(KIND=1, BITS=8, BM=1, BN=4, BB=1024, EVEN=True, SPLIT=1, REDUCE=False, NORM=False, SWIGLU=False,
                                INTERP=False, PDL=True), 4,
                           {"b_ptr": "*u8", "h_ptr": "*u8", "s_ptr": "*fp16", "part_ptr": "*fp32"},
                           divisible=("K", "BYTES", "sx", "sb", "sh", "ss", "sy", "sr", "shn", "sro"), loop_bytes=32),
        "qgemv_fp8": Preset("ninfer.ops.triton.quant_gemv", "_qgemv_kernel",
                            dict(KIND=2, BITS=8, BM=1, BN=4, BB=1024, EVEN=True, SPLIT=1, REDUCE=False, NORM=False, SWIGLU=False,
                                 INTERP=False, PDL=True), 4,
                            {"b_ptr": "*u8", "h_ptr": "*u8", "s_ptr": "*bf16", "part_ptr": "*fp32"},
                            divisible=("K", "BYTES", "sx", "sb", "sh", "ss", "sy", "sr", "shn", "sro"), loop_bytes=32),
        # The 8-bit tensor-core GEMVs at one row (q8: 128 rows x 256 B / 128 threads a step; fp8: x as 8 columns).
        "qgemv_q8_tc": Preset("ninfer.ops.triton.quant_gemv_tc8", "_tc8_kernel",
                              dict(BN=128, BB=256, MP=1, FP8=False, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=False, PERM=1, L2PF=False, INTERP=False, PDL=True,
                                   ASM="ref:ninfer.ops.triton.quant_gemv_tc8.Q8_ASM"), 4,
                              {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32", "cnt_ptr": "*i32"},
                              divisible=("K", "BYTES", "sx", "sb", "ss", "sy", "sp", "sr", "sh", "sro"),
                              loop_bytes=256),
        "qgemv_q8_tc_norm": Preset("ninfer.ops.triton.quant_gemv_tc8", "_tc8_kernel",
                                   dict(BN=128, BB=256, MP=1, FP8=False, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=True, PERM=1, L2PF=False, INTERP=False, PDL=True,
                                        ASM="ref:ninfer.ops.triton.quant_gemv_tc8.Q8_ASM"), 4,
                                   {"b_ptr": "*u16", "s_ptr": "*fp16", "p_ptr": "*fp32", "cnt_ptr": "*i32"},
                                   divisible=("K", "BYTES", "sx", "sb", "ss", "sy", "sp", "sr", "sh", "sro"),
                                   loop_bytes=256),
        "qgemv_fp8_tc": Preset("ninfer.ops.triton.quant_gemv_tc8", "_tc8_kernel",
                               dict(BN=128, BB=256, MP=8, FP8=True, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=False, PERM=1, L2PF=False, INTERP=False, PDL=True,
                                    ASM="ref:ninfer.ops.triton.quant_gemv_tc8.FP8_ASM"), 4,
                               {"b_ptr": "*u16", "s_ptr": "*bf16", "p_ptr": "*fp32", "cnt_ptr": "*i32"},
                               divisible=("K", "BYTES", "sx", "sb", "ss", "sy", "sp", "sr", "sh", "sro"),
                               loop_bytes=256),
        "qmoe_nvfp4_gate_up": Preset("ninfer.ops.triton.quant_moe_gemv", "_gate_up_kernel",
                                     dict(FMT=2, TOPK=8, BN=8, NG=32, NCH=4, INTERP=False, PDL=True), 4,
                                     {"ids_ptr": "*i64", "act_ptr": "*fp32", **nv_planes}, divisible=nv_strides),
        "qmoe_nvfp4_down": Preset("ninfer.ops.triton.quant_moe_gemv", "_down_kernel",
                                  dict(FMT=2, SFMT=2, TOPK=8, BN=8, NG=32, NCH=1, SNG=32, SNCH=1, HAS_SHARED=True,
                                       ODT=tl.bfloat16, INTERP=False, PDL=True), 4,
                                  {"act_ptr": "*fp32", "ids_ptr": "*i64", "rw_ptr": "*fp32", **nv_planes,
                                   "q0": "*u8", "q1": "*fp32", "q2": "*u8"},
                                  divisible=(*nv_strides, "t0", "t1", "t2")),
        "qmoe_nvfp4_grouped_gate_up": Preset("ninfer.ops.triton.quant_moe", "_gate_up_kernel",
                                             dict(FMT=2, TOPK=8, BM=64, BN=64, BK=64, DT=tl.bfloat16, FP32_DOT=False,
                                                  INTERP=False), 4,
                                             {"pair_ptr": "*i64", "bexp_ptr": "*i64", **nv_planes},
                                             divisible=nv_strides),
        "qmoe_nvfp4_grouped_down": Preset("ninfer.ops.triton.quant_moe", "_down_kernel",
                                          dict(FMT=2, BM=64, BN=128, BK=64, DT=tl.bfloat16, ACT_BY_PAIR=False,
                                               FP32_DOT=False, INTERP=False), 4,
                                          {"pair_ptr": "*i64", "bexp_ptr": "*i64", "rw_ptr": "*fp32",
                                           "y_ptr": "*fp32", **nv_planes}, divisible=nv_strides),
    }
    # The q4 tensor-core GEMVs with the first weight tile loaded before the PDL wait (the prefetch candidate).
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm"):
        p = presets[name]
        presets[name + "_prefetch"] = replace(p, constexprs={**p.constexprs, "PREFETCH": True})
    # The bf16 GEMV of 2-8 rows on the tensor cores (NINFER_GEMV_TC=1): [128, 128] weight tiles, 256 B a thread a step.
    presets["gemv_tc_bf16"] = Preset("ninfer.ops.triton.linear_tc", "_tc_kernel",
                                     dict(BN=128, BK=128, MP=8, SPLIT=True, REDUCE=True, SWIGLU=False, NORM=False,
                                          L2PF=False, INTERP=False, PDL=True), 4,
                                     {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "p_ptr": "*fp32",
                                      "cnt_ptr": "*i32"},
                                     divisible=("K", "sx", "sw", "sy", "sp"), loop_bytes=256)
    presets["gemv_tc_bf16_norm_swiglu"] = replace(presets["gemv_tc_bf16"], constexprs={
        **presets["gemv_tc_bf16"].constexprs, "NORM": True, "SWIGLU": True})
    # ... with each program's weight run asked of L2 before the PDL wait (NINFER_GEMV_TC_L2_PREFETCH=1).
    presets["gemv_tc_bf16_l2"] = replace(presets["gemv_tc_bf16"], constexprs={
        **presets["gemv_tc_bf16"].constexprs, "L2PF": True})
    # The q4 GEMV with stream-K shares (NINFER_QUANT_SPLIT=streamk): the same K step in a loop over a share's pieces.
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm"):
        p = presets[name]
        c = {k: v for k, v in p.constexprs.items() if k not in ("SPLIT", "REDUCE", "PREFETCH")}
        presets[name.replace("_tc", "_streamk")] = replace(p, module="ninfer.ops.triton.quant_gemv_streamk",
                                                           kernel="_q4_streamk_kernel", constexprs=c)
    # The tensor-core GEMVs asking L2 for each program's weight run before the PDL wait (the L2 prefetch candidate).
    for name in ("qgemv_q4_tc", "qgemv_q4_tc_norm", "qgemv_q8_tc", "qgemv_fp8_tc"):
        p = presets[name]
        presets[name + "_l2"] = replace(p, constexprs={**p.constexprs, "L2PF": True})
    return presets


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _resolve(value):
    """A constexpr's value; ``"ref:module.NAME"`` is that module attribute (e.g. a kernel's PTX decode string)."""
    if isinstance(value, str) and value.startswith("ref:"):
        module, name = value[4:].rsplit(".", 1)
        return getattr(importlib.import_module(module), name)
    return value


def compile_sm90(p: Preset):
    """The preset's kernel built for sm_90 (no device needed); returns triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(p.module), p.kernel)
    names = [prm.name for prm in fn.params]
    missing = [prm.name for prm in fn.params if prm.is_constexpr and prm.name not in p.constexprs]
    if missing:
        raise ValueError(f"{p.kernel}: constexprs {missing} have no value in the preset")
    sig, div = {}, []
    for n in names:
        if n in p.constexprs:
            sig[n] = "constexpr"
        elif n.endswith("_ptr") or n in p.pointers:
            sig[n] = p.pointers.get(n, "*bf16")
            div.append(n)
        elif n in p.floats:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if re.match(r"^(stride|s[a-z]{0,2}_)", n) or n in p.divisible:
                div.append(n)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div}
    consts = {k: _resolve(v) for k, v in p.constexprs.items() if k in names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": p.warps, **p.options})


def _inner_loop(sass: str) -> list[str]:
    """Opcodes of the largest innermost loop (a backward branch's body, with no loop inside it); [] if none."""
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            words = [w for w in m.group(2).split() if not w.startswith("@")]
            if words:
                ins.append((int(m.group(1), 16), words))
    loops = []
    for addr, words in ins:
        target = re.search(r"0x([0-9a-f]+)", " ".join(words[1:])) if words[0].startswith("BRA") else None
        if target and int(target.group(1), 16) <= addr:
            loops.append((int(target.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    if not inner:
        return []
    lo, hi = max(inner, key=lambda lp: lp[1] - lp[0])
    return [words[0] for addr, words in ins if lo <= addr <= hi]


def report(name: str, p: Preset) -> dict:
    k = compile_sm90(p)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("cuobjdump"), "-sass", path], capture_output=True, text=True,
                              check=True).stdout
    res = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    ops = []
    for line in sass.splitlines():
        if "*/" not in line or ";" not in line:
            continue
        words = line.split("*/", 1)[1].strip().rstrip(";").split()
        words = [w for w in words if not w.startswith("@")]      # drop predicates
        if words:
            ops.append(words[0])
    counts = collections.Counter(op.split(".")[0] for op in ops)
    order: list[list] = []
    for op in ops:
        head = op.split(".")[0]
        mark = next((m for m in ORDER if head == m), None)
        if mark is None:
            continue
        if order and order[-1][0] == mark:
            order[-1][1] += 1
        else:
            order.append([mark, 1])
    layouts = [ln.split("=", 1)[1].strip() for ln in k.asm["ttgir"].splitlines() if ln.startswith("#blocked")]
    loop = _inner_loop(sass)
    per_byte = {"loop_per_byte": round(len(loop) / p.loop_bytes, 2)} if p.loop_bytes and loop else {}
    # sm_90 builds PDL's griddepcontrol.wait as ACQBULK: a bulk L2 prefetch (UBLKPF) ahead of it streams while the
    # previous kernel finishes.
    heads = [op.split(".")[0] for op in ops]
    if "UBLKPF" in heads:
        wait = heads.index("ACQBULK") if "ACQBULK" in heads else len(heads)
        per_byte["l2_prefetch_before_wait"] = heads.index("UBLKPF") < wait
    ptx_fma = sum(1 for ln in k.asm["ptx"].splitlines() if ln.strip().startswith("fma."))
    return {"loop_instructions": len(loop), **per_byte, "ptx_fma": ptx_fma,
            "kernel": f"{p.module.rsplit('.', 1)[-1]}.{p.kernel}", "warps": p.warps,
            **{key.lower(): int(v) for key, v in res.items()}, "instructions": len(ops),
            "counts": {kind: counts[kind] for kind in KINDS if counts[kind]},
            "issue_order": " ".join(f"{m}x{n}" for m, n in order), "layouts": layouts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("words", nargs="*", help="run the presets whose name contains one of these (default all)")
    ap.add_argument("--json", default=None, help="also write the reports to this file")
    args = ap.parse_args(argv)
    presets = _presets()
    picked = {n: p for n, p in presets.items() if not args.words or any(w in n for w in args.words)}
    if not picked:
        print(f"no preset matches {args.words}; presets: {', '.join(presets)}", file=sys.stderr)
        return 2
    out = {}
    for name, p in picked.items():
        r = out[name] = report(name, p)
        print(f"== {name} ({r['kernel']}, {r['warps']} warps): {r.get('reg')} registers, stack {r.get('stack')} B, "
              f"shared {r.get('shared')} B, {r['instructions']} instructions")
        print("   " + ", ".join(f"{k} {v}" for k, v in r["counts"].items()))
        print("   order: " + r["issue_order"])
        if r["loop_instructions"]:
            per = f" = {r['loop_per_byte']} per weight byte a thread" if "loop_per_byte" in r else ""
            print(f"   innermost loop: {r['loop_instructions']} instructions{per}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
