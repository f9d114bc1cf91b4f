"""The op contracts only Qwen4-Exp models call, registered by this plugin (``ninfer_op_contracts``).

Core's contracts (linear, logits, unit-offset RMSNorm, rope, KV write, paged attention, MoE) and Qwen3.5's (the GDN
ops, causal conv1d, MRoPE, q/k norm + RoPE + KV write) are reused as they are. These add the per-stream norm of the
hyper-connections and PLE, the hyper-connections' stream mixing and injection, the GDN output norm with a sigmoid
gate, the PLE n-gram hash and its host-table gather, and the two halves of QSA: the indexer's block selection and the
attention over the selected keys.

Shapes use: T tokens, B rows (sequences), G groups or hash heads, h indexer heads, d indexer head dim, W the indexer
pool width, r the compression ratio, Hq/Hkv attention heads, D head dim, R rotary dims. Unless stated, outputs have
the activation dtype of the inputs and the math is done in fp32.
"""

from __future__ import annotations

from ninfer.ops.contracts import OpContract

CONTRACTS: tuple[OpContract, ...] = (
    OpContract("rms_norm_unit_offset_grouped",
               "rms_norm_unit_offset_grouped(x[..., G*N], weight[G*N], group N, eps) -> [..., G*N]",
               "rms_norm_unit_offset over each consecutive group of N values of the last dim, each group with its "
               "own slice of weight: fp32 x*rsqrt(mean_group(x^2)+eps)*(1+w), cast to x.dtype once."),
    OpContract("gated_rms_norm_sigmoid", "gated_rms_norm_sigmoid(x[..., N], gate[..., N], weight[N], eps) -> [..., N]",
               "gated_rms_norm with a sigmoid gate: n = fp32 rmsnorm(x) cast to x.dtype; n*weight (plain weight, "
               "x.dtype product); times sigmoid(gate.float()); cast to x.dtype."),
    OpContract("hc_act", "hc_act(d[T, R], streams n) -> [T, R]",
               "A hyper-connection's low-rank activation before its up projection: silu(x.dtype(d / n)), the SiLU "
               "in fp32 rounded once to d.dtype (the checkpoint module's F.silu(d / n))."),
    OpContract("hc_mix",
               "hc_mix(z[T, n*H], xn[T, n*H], g[T, n] or None, streams n) -> (u[T, H], inject[T, n] or None)",
               "A hyper-connection's read after its up projection z: u = mean over streams k of "
               "x.dtype(x.dtype(sigmoid(z_k)) * xn_k), the mean summed in fp32 and rounded once; inject = "
               "2 * x.dtype(sigmoid(x.dtype(g / n))) when g is given (the checkpoint module's roundings)."),
    OpContract("hc_write", "hc_write(x[T, n*H], y[T, H], inject[T, n]) -> [T, n*H]",
               "A hyper-connection's write: x_k + x.dtype(inject_k * y) for every stream k, rounded to x.dtype."),
    OpContract("ngram_hash",
               "ngram_hash(windows[T, n] int64, multipliers[n] int64, sizes[G] int64, offsets[G] int64, eos, "
               "heads_per_ngram) -> ids[T, G] int64",
               "windows[t] are the n most recent token ids ending at token t (column n-1), EOS where the sequence "
               "has none. shift_s = windows[t, n-1-s] unless one of columns n-1-s..n-2 is eos, then eos (a window "
               "never reaches across an EOS). For order m in 2..n, mixed_m = XOR_{s<m} shift_s*multipliers[s] "
               "(non-negative int64, no overflow by the multipliers' bound); head j of order m (global head "
               "(m-2)*heads_per_ngram + j) is mixed_m mod sizes + offsets of that head. G = (n-1)*heads_per_ngram."),
    OpContract("ple_gather",
               "ple_gather(table[R, D], ids[T, G] int64, dtype) -> [T, G*D]",
               "table[ids] rows concatenated per token, cast to dtype, on ids' device. The table may live in host "
               "memory while ids are on the device: only the T*G rows are read and copied."),
    OpContract("indexer_cache_write",
               "indexer_cache_write(key[T, d], cos[T, R], sin[T, R], key_pool[P, page, 1, W], "
               "rope_pool[P, page, 1, W], slot_mapping[T]) -> None",
               "Each token's indexer side-pool rows at its slot, in place: key_pool gets key then zeros, rope_pool "
               "cos then sin (cast to x.dtype) then zeros; kv_cache_write of those zero-padded rows (its slot "
               "checks included)."),
    OpContract("qsa_select",
               "qsa_select(q[T, h, d], key_pool[P, page, 1, W], rope_pool[P, page, 1, W], k_norm[d], eps, "
               "cu_q[B+1] int32, kv_lens[B] int32, page_tables[B, maxp] int32, ratio r, block_topk, rotary R) "
               "-> sel[T, block_topk*r + r - 1] int64",
               "QSA's indexer. Query i of row b sits at position p = kv_lens[b] - q_len_b + i and sees n_vis = "
               "(p+1)//r complete blocks; block j's key is rope(rms_norm_unit_offset(x.dtype(mean_fp32 of the raw "
               "keys key_pool[..., :d] of positions jr..jr+r-1)), k_norm, eps) rotated on its first R dims with the "
               "cos | sin rope_pool[..., :R] | [..., R:2R] of position jr (2R <= W). Score s_j = sum_heads relu(fp32 "
               "q_h . fp32 k_j) / sqrt(d), computed as the fp32 matmul [h, d] x [d, n_vis]; the min(block_topk, "
               "n_vis) best blocks (torch.topk on the [n_vis] scores) give their r positions each, plus the tail "
               "positions n_vis*r..p; -1 pads. Each position appears at most once, in no set order."),
    OpContract("qsa_attention",
               "qsa_attention(q[T, Hq, D], k_pool, v_pool, sel[T, S] int64, cu_q[B+1] int32, kv_lens[B] int32, "
               "page_tables[B, maxp] int32, scale, gate[T, Hq*D] or None) -> o[T, Hq, D]",
               "paged_attention of each query over exactly the positions its sel row lists (-1 entries ignored; "
               "every listed position is < kv_lens[b]): GQA head h reads KV head h // (Hq/Hkv), softmax in fp32; "
               "with gate, times sigmoid(gate) as torch computes it in q.dtype (paged_attention's gate)."),
)
