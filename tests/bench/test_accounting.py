"""FLOP and byte accounting of ``ninfer bench`` against hand-computed values for a tiny Qwen3.5.

Config: hidden 8, vocab 10 (untied), layers [GDN, attention], attention 2q/1kv heads x 4, GDN 1k/2v heads
with Dk 2, Dv 3, conv kernel 4 (conv_dim 2*2 + 2*3 = 10), MLP 6, rotary 4 * 0.5 = 2.
"""

from __future__ import annotations

import torch
from ninfer.bench.report import causal_pairs, decode_step_bytes, prefill_flops
from ninfer.contracts.features import StartupFeatures
from ninfer_qwen3_5.profile import profile

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 2, "linear_value_head_dim": 3, "linear_num_key_heads": 1, "linear_num_value_heads": 2,
    "intermediate_size": 6, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False,
}


def test_compute_counts_of_the_profile():
    p = profile(CONFIG, StartupFeatures(), dtype=torch.bfloat16)
    gdn = 10 * 8 + 6 * 8 + 2 * 2 * 8 + 10 * 4 + 8 * 6        # qkv, z, b and a, conv, out = 248
    attn = 8 * 8 + 8 * 8 + 4 * 8 + 4 * 8 + 8 * 8               # query, gate, key, value, out = 256
    mlp = 2 * 3 * 6 * 8                                         # gate_up + down, both layers = 288
    assert p.matmul_params_per_token == gdn + attn + mlp == 792
    assert p.head_params == 80
    assert p.mixer_flops_per_token == 2 * 7 * 2 * 3 == 84       # 2 value heads x 7 x Dk x Dv
    assert p.attention_flops_per_query_key == 2 * 4 * 4 == 32   # 2 query heads x (QK + PV) x D


def test_memory_figures_of_the_profile():
    p = profile(CONFIG, StartupFeatures(), dtype=torch.bfloat16,
                stored_dtypes={})                               # stored in the run dtype
    # bf16 elements: embed 80 + norm 8 + head 80; GDN layer 411 (norms 16, qkv 80, z 48, b 16, a 16, conv 40,
    # gated norm 3, out 48, MLP 144); attention layer 424 (norms 16 + 4 + 4, projections 256, MLP 144).
    # fp32: A_log and dt_bias (2 each) and one rotary inverse frequency.
    assert p.weight_bytes == 2 * (168 + 411 + 424) + 4 * 4 + 4 == 2026
    assert p.converted_weight_bytes == 4 * 2 + 4 * 2 + 4       # -exp(A_log), dt_bias.float(), inv_freq
    assert p.kv_bytes_per_token == 1 * 2 * 1 * 4 * 2 == 16
    assert p.state_bytes_per_sequence == 256 + 256              # conv [10, 3] bf16, recurrent [2, 2, 3] fp32
    fp32 = profile(CONFIG, StartupFeatures(), dtype=torch.float32,
                   stored_dtypes={"text/embed": torch.bfloat16})  # only the embedding stored otherwise
    assert fp32.weight_bytes == 4 * 1003 + 16 + 4
    assert fp32.converted_weight_bytes == 4 * 80 + 8 + 4       # the embedding cast, -exp(A_log), inv_freq


def test_prefill_flops_by_hand():
    p = profile(CONFIG, StartupFeatures())
    assert causal_pairs(4) == 10 and causal_pairs(3, start=2) == 12
    assert prefill_flops(p, 4) == 2 * 792 * 4 + 2 * 80 + 84 * 4 + 32 * 10 == 7152
    assert prefill_flops(p, 3, start=2) == 2 * 792 * 3 + 2 * 80 + 84 * 3 + 32 * 12 == 5548


def test_decode_step_bytes_by_hand():
    p = profile(CONFIG, StartupFeatures())
    # The untied [10, 8] bf16 input table (160 bytes) is read one row per token: B rows of 10.
    assert p.embedding_bytes == 160 and p.routed_expert_bytes == 0
    # weights read + per row: 5 positions of KV read, one written, the State read and written back.
    assert decode_step_bytes(p, 2, 5) == 2026 - 160 * 8 / 10 + 2 * (5 * 16 + 16 + 2 * 512) == 4138
    assert decode_step_bytes(p, 1, 0.5) == 2026 - 160 * 9 / 10 + 0.5 * 16 + 16 + 1024
    assert decode_step_bytes(p, 16, 0) == 2026 + 16 * (16 + 1024)          # 16 rows >= 10 table rows: all read
    tied = profile({**CONFIG, "tie_word_embeddings": True}, StartupFeatures())
    # Tied: the table is the LM head, read whole every step (and counted once in weight_bytes).
    assert tied.embedding_bytes == 0 and tied.weight_bytes == 2026 - 160
    assert decode_step_bytes(tied, 1, 0) == tied.weight_bytes + 16 + 1024


def test_decode_step_bytes_of_a_moe_by_hand():
    """A MoE step reads the expected distinct routed experts of B uniform top-k routings, E (1 - (1 - k/E)^B)."""
    from ninfer.bench.report import decode_weight_bytes, expected_distinct_experts

    moe = {**CONFIG, "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 3, "shared_expert_intermediate_size": 5}
    moe.pop("intermediate_size")
    p = profile(moe, StartupFeatures())
    per_expert = 3 * 3 * 8 * 2                                   # gate, up, down [3 x 8] bf16
    assert (p.num_experts, p.experts_per_token) == (4, 2)
    assert p.routed_expert_bytes == 2 * 4 * per_expert           # two layers
    assert expected_distinct_experts(4, 2, 1) == 2 and expected_distinct_experts(4, 2, 2) == 3
    unread_table = 160 * 9 / 10
    assert decode_weight_bytes(p, 1) == p.weight_bytes - unread_table - 2 * 2 * per_expert
    assert decode_weight_bytes(p, 2) == p.weight_bytes - 160 * 8 / 10 - 2 * 1 * per_expert
    # Experts (and, with them, the input embedding) in host memory are not in weight_bytes; the step still counts
    # what it reads, as if resident. With one layer's experts whole on the device, half the experts are on the host.
    hosted = profile(moe, StartupFeatures(host_experts=True))
    half = profile(moe, StartupFeatures(host_experts=True, device_expert_layers=1))
    assert hosted.routed_experts_on_host and half.routed_experts_on_host and not p.routed_experts_on_host
    assert hosted.routed_expert_bytes == half.routed_expert_bytes == p.routed_expert_bytes
    assert hosted.host_read_bytes == p.routed_expert_bytes + p.embedding_bytes and p.host_read_bytes == 0
    assert half.host_read_bytes == p.routed_expert_bytes // 2 + p.embedding_bytes
    assert hosted.weight_bytes < half.weight_bytes < p.weight_bytes
    # the device cache and staging buffer
    device_rest = hosted.weight_bytes - (p.weight_bytes - p.routed_expert_bytes - p.embedding_bytes)
    for b in (1, 2, 8):
        assert decode_weight_bytes(hosted, b) == decode_weight_bytes(p, b) + device_rest > 0
        assert decode_weight_bytes(half, b) == decode_weight_bytes(hosted, b)


def test_remeasure_copy_waits_only_on_a_gpu(monkeypatch):
    """The second copy measurement idles AFTER_SETTLE_S first on a GPU (measured at once after a decode bench, an
    H200 copied ~10% slower than a few seconds later); a CPU run does not wait."""
    import torch
    from ninfer.bench import limits as lim

    slept = []
    monkeypatch.setattr(lim.time, "sleep", slept.append)
    base = lim.DeviceLimits(device="cpu", copy_buffer_bytes=1 << 20, copy_bytes_per_s=1.0, matmul_n=8,
                            matmul_dtype="float32", matmul_flops_per_s=1.0)
    out = lim.remeasure_copy(base, torch.device("cpu"), repeats=2)
    assert slept == [] and out.copy_bytes_per_s_after > 0 and out.copy_bytes_per_s == 1.0
    monkeypatch.setattr(lim, "measure_copy_bandwidth", lambda *a, **k: 5.0)
    monkeypatch.setattr(lim.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(lim.torch.cuda, "empty_cache", lambda: None)
    out = lim.remeasure_copy(base, torch.device("cuda"))
    assert slept == [lim.AFTER_SETTLE_S] and lim.AFTER_SETTLE_S >= 1.0 and out.copy_bytes_per_s_after == 5.0
    lim.remeasure_copy(base, torch.device("cuda"), settle_s=0.5)
    assert slept[-1] == 0.5


def test_the_limits_prime_the_matmul_workspace_and_empty_the_cache_between_measurements(monkeypatch):
    """On CUDA: the matmul library's long-lived workspace is made on an empty cache, before the 1 GiB copy buffers,
    and the cache is emptied after each measurement, so no freed buffer's segment stays pinned (the engine's budget
    would count it as held). Checked as the order of calls; the CPU runs none of it."""
    import torch
    from ninfer.bench import limits as lim

    calls = []
    monkeypatch.setattr(lim, "_prime_matmul", lambda device, dtype: calls.append("prime"))
    monkeypatch.setattr(lim, "measure_copy_bandwidth", lambda *a, **k: calls.append("copy") or 2.0)
    monkeypatch.setattr(lim, "measure_matmul_peak", lambda *a, **k: calls.append("matmul") or 3.0)
    monkeypatch.setattr(lim.torch.cuda, "empty_cache", lambda: calls.append("empty"))
    out = lim.measure_limits(torch.device("cuda"), torch.bfloat16)
    assert calls == ["prime", "copy", "empty", "matmul", "empty"]
    assert (out.copy_bytes_per_s, out.matmul_flops_per_s) == (2.0, 3.0)
    calls.clear()
    lim.measure_limits(torch.device("cpu"), torch.float32)
    assert calls == ["copy", "matmul"]
