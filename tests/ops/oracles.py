"""fp64 oracles of the op contracts, and the inputs they are checked on, for both op suites.

The reference suite (tests/ops) and the Triton suite (tests/ops_triton) must hold their implementations to
the same oracles: one copy here means a fix to an oracle reaches both. Oracles are written from the
represented inputs (the values actually passed, after any bf16 rounding), never composed from production ops.
"""

from __future__ import annotations

import math

import torch

from .conftest import f64, rand, randn

# --- gated delta rule (gdn_chunk_prefill / gdn_recurrent_step) ---


def gdn_oracle(q, k, v, g, beta, state, scale):
    """Naive token loop (all heads of a token at once); returns (o[T, Hv, Dv], final state[Hv, Dk, Dv]) in fp64.

    Per value head j (reading key head j // (Hv / Hk)): s = exp(g) s; s += k (beta (v - s^T k))^T; o = s^T q, with
    q and k L2-normalised and q scaled."""
    q, k, v, g, beta, s = f64(q), f64(k), f64(v), f64(g), f64(beta), f64(state).clone()
    t_len, hk, _ = q.shape
    hv = v.shape[1]
    r = hv // hk
    o = torch.empty(t_len, hv, v.shape[2], dtype=torch.float64)
    for t in range(t_len):
        qt, kt = q[t].repeat_interleave(r, 0), k[t].repeat_interleave(r, 0)     # [Hv, Dk]
        qt = scale * qt / torch.sqrt((qt * qt).sum(-1, keepdim=True) + 1e-6)
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        s.mul_(torch.exp(g[t])[:, None, None])
        delta = beta[t][:, None] * (v[t] - torch.bmm(kt[:, None, :], s)[:, 0])
        s.baddbmm_(kt[:, :, None], delta[:, None, :])
        o[t] = torch.bmm(qt[:, None, :], s)[:, 0]
    return o, s


def gdn_inputs(gen, t_len, hk, hv, dk, dv, dtype, device, g_min=-1.0):
    q = randn(gen, t_len, hk, dk, dtype=dtype, device=device)
    k = randn(gen, t_len, hk, dk, dtype=dtype, device=device)
    v = randn(gen, t_len, hv, dv, dtype=dtype, device=device)
    g = rand(gen, t_len, hv, lo=g_min, hi=0.0, device=device)      # log decay <= 0, fp32
    beta = rand(gen, t_len, hv, lo=0.0, hi=1.0, device=device)     # sigmoid range, fp32
    return q, k, v, g, beta


# --- causal_conv1d ---


def conv1d_oracle(x, w, state):
    """Returns (y, new_state) for one sequence: x[T, C], w[C, K], state[C, K-1], fp64."""
    x, w, state = f64(x), f64(w), f64(state)
    k = w.shape[1]
    u = torch.cat((state.t(), x), dim=0)
    y = torch.empty_like(x)
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(k):
            acc += w[:, j] * u[t + j]
        y[t] = acc / (1.0 + torch.exp(-acc))
    return y, u[u.shape[0] - (k - 1):].t()


# --- moe_experts ---


def moe_experts_oracle(x, weights, ids, gate_up, down, shared=None):
    """sum_j w[t, j] * down[e] @ (silu(gate[e] x) * (up[e] x)), e = ids[t, j]; gate rows come first; plus
    sigmoid(shared.gate_logit[t]) * shared.down @ (silu(g) * u), [g | u] = shared.projected[t], when given."""
    xd, w = f64(x), f64(weights)
    inter = down.shape[-1]
    ids = ids.cpu()
    ref = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for e in torch.unique(ids).tolist():                # one expert at a time, over every (token, slot) routed to it
        t, j = (ids == e).nonzero(as_tuple=True)
        gu, dn = f64(gate_up[e]), f64(down[e])          # only the routed experts, not the whole bank, in fp64
        h_gate, h_up = xd[t] @ gu[:inter].t(), xd[t] @ gu[inter:].t()
        ref.index_add_(0, t, w[t, j][:, None] * ((h_gate / (1.0 + torch.exp(-h_gate)) * h_up) @ dn.t()))
    if shared is not None:
        p, sd, gl = f64(shared.projected), f64(shared.down), f64(shared.gate_logit)
        si = sd.shape[-1]
        act = p[:, :si] / (1.0 + torch.exp(-p[:, :si])) * p[:, si:]
        ref += torch.sigmoid(gl)[:, None] * (act @ sd.t())
    return ref


# --- paged attention ---


def attention_oracle(q, ks, vs, rows, scale):
    """q[T, Hq, D]; ks/vs: per-row dense [L, Hkv, D]. Plain per-query, per-head softmax in fp64."""
    q = f64(q)
    hq, hkv = q.shape[1], ks[0].shape[1]
    out = torch.empty_like(q)
    t0 = 0
    for (n, kv_len), k, v in zip(rows, ks, vs, strict=True):
        k, v = f64(k), f64(v)
        kv_head = torch.arange(hq) // (hq // hkv)       # query head h reads KV head h // r
        kh, vh = k[:, kv_head], v[:, kv_head]            # [L, Hq, D]
        for i in range(n):
            pos = kv_len - n + i                         # sees keys 0..pos inclusive
            s = (kh[:pos + 1] * q[t0 + i]).sum(-1) * scale   # [pos+1, Hq]
            p = torch.exp(s - s.max(0).values)
            out[t0 + i] = ((p / p.sum(0))[..., None] * vh[:pos + 1]).sum(0)
        t0 += n
    return out


def page_layouts(rows, page, gen):
    """Yields (name, page_tables[B, maxp] int32, pool_pages) for identity / offset / fragmented layouts."""
    need = [math.ceil(kv_len / page) for _, kv_len in rows]
    total, maxp = sum(need), max(need) + 2
    for name in ("identity", "offset", "fragmented"):
        n_pool = total + (5 if name != "identity" else 0)
        if name == "identity":
            order = list(range(total))
        elif name == "offset":
            order = list(range(5, 5 + total))
        else:
            order = torch.randperm(n_pool, generator=gen)[:total].tolist()
        table = torch.full((len(rows), maxp), n_pool + 1000, dtype=torch.int32)  # never to be read
        at = 0
        for b, n_pages in enumerate(need):
            table[b, :n_pages] = torch.tensor(order[at:at + n_pages], dtype=torch.int32)
            at += n_pages
        yield name, table, n_pool


def fill_pools(ks, vs, table, n_pool, page, dtype):
    """NaN-filled pools holding each row's K/V where its page table says: reading any other slot poisons."""
    hkv, d = ks[0].shape[1:]
    k_pool = torch.full((n_pool, page, hkv, d), float("nan"), dtype=dtype)
    v_pool = torch.full((n_pool, page, hkv, d), float("nan"), dtype=dtype)
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        for p in range(k.shape[0]):  # position p -> page table[b, p // page], offset p % page
            k_pool[table[b, p // page], p % page] = k[p]
            v_pool[table[b, p // page], p % page] = v[p]
    return k_pool, v_pool


# --- norms ---

NORM_EPS = 1e-6


def rms_oracle(x, w):
    """Zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    x = f64(x)
    inv = 1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS)
    return x * inv * (1.0 + f64(w))


def gated_rms_oracle(x, gate, w, dtype):
    """Gated RMSNorm with the contract's declared cast of the normalised value to dtype; plain weight."""
    xd = f64(x)
    n = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + NORM_EPS)).to(dtype).double()
    g = f64(gate)
    return n * f64(w) * (g / (1.0 + torch.exp(-g)))


def gated_rms_bf16_cast_chain(x, gate, w):
    """Every declared bf16 rounding of gated RMSNorm modelled exactly (bf16*bf16 products are exact in fp64)."""
    xd, g = f64(x), f64(gate)
    n = (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + NORM_EPS)).to(torch.bfloat16)
    nw = (n.double() * f64(w)).to(torch.bfloat16)              # bf16 * bf16 product, rounded to bf16
    return (nw.double() * (g / (1.0 + torch.exp(-g)))).to(torch.bfloat16)


def assert_bf16_within_one_ulp(out, ref, what=""):
    """At most 1% of bf16 results differ from ref, each by at most one bf16 ulp: fp32-vs-fp64 noise may
    straddle a rounding boundary, nothing more."""
    out, ref = out.cpu(), ref.cpu()
    differ = out != ref
    assert differ.float().mean().item() <= 0.01, f"{what}: {int(differ.sum())} of {out.numel()} differ"
    ulp = (ref.double().abs() * 2.0 ** -7).clamp_min(2.0 ** -133)
    assert ((out.double() - ref.double()).abs() <= ulp).all(), f"{what}: a difference above one ulp"


# --- sampling ---

MASK = (1 << 64) - 1
PHI = 0x9E3779B97F4A7C15


def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def uniform(seed, step, token):
    """The normative per-(seed, step, token) uniform, with Python's unbounded integers modulo 2^64."""
    row = mix64((mix64((seed + PHI) & MASK) + (step + 1) * PHI) & MASK)
    h = mix64((row + (token + 1) * PHI) & MASK)
    return ((h >> 12) + 0.5) / 2.0 ** 52


def oracle_token(logits, temperature, top_k, top_p, min_p, seed, step, margin=1e-4):
    """Returns the contract's token, or None if the row sits within `margin` of a decision boundary."""
    v = len(logits)
    if temperature == 0:
        best = max(logits)
        return min(i for i in range(v) if logits[i] == best)
    x = [lv / temperature for lv in logits]
    keep = [True] * v
    order = sorted(range(v), key=lambda i: -x[i])
    if 0 < top_k < v:
        kth = x[order[top_k - 1]]
        keep = [keep[i] and x[i] >= kth for i in range(v)]
    if top_p < 1:
        surv = [i for i in order if keep[i]]
        m = x[surv[0]]
        w = [math.exp(x[i] - m) for i in surv]
        total = sum(w)
        excl, n_keep = 0.0, 0
        for wi in w:
            if abs(excl - top_p) < margin:
                return None
            if excl < top_p:
                n_keep += 1
            excl += wi / total
        cutoff = x[surv[max(n_keep, 1) - 1]]
        keep = [keep[i] and x[i] >= cutoff for i in range(v)]
    if min_p > 0:
        m = max(x)
        ratios = [math.exp(x[i] - m) for i in range(v)]
        if any(abs(r - min_p) < margin for r in ratios):
            return None
        keep = [keep[i] and ratios[i] >= min_p for i in range(v)]
    scores = sorted(((x[i] - math.log(-math.log(uniform(seed, step, i))), i) for i in range(v) if keep[i]),
                    reverse=True)
    if len(scores) > 1 and scores[0][0] - scores[1][0] < margin:
        return None
    return scores[0][1]


def penalties_oracle(logits, counts, prompt, rep, pres, freq):
    """The vLLM penalty rule evaluated per element in fp64."""
    out = logits.double().clone()
    for b in range(out.shape[0]):
        for i in range(out.shape[1]):
            c = int(counts[b, i])
            if bool(prompt[b, i]) or c > 0:
                out[b, i] = out[b, i] / float(rep[b]) if out[b, i] > 0 else out[b, i] * float(rep[b])
            out[b, i] -= float(pres[b]) * (c > 0) + float(freq[b]) * c
    return out


def penalty_inputs(gen, vocab):
    """(logits, counts, prompt, rep, pres, freq) on CPU for 4 rows; row 2 is neutral and holds a -0.0."""
    rows = 4
    logits = randn(gen, rows, vocab, scale=3.0)
    logits[2, 5] = -0.0  # a signed zero in a neutral row must survive bit-exactly
    counts = torch.randint(0, 4, (rows, vocab), generator=gen, dtype=torch.int32) * (
        torch.rand(rows, vocab, generator=gen) < 0.3)
    prompt = torch.rand(rows, vocab, generator=gen) < 0.25
    rep = torch.tensor([1.3, 0.8, 1.0, 1.0])
    pres = torch.tensor([0.5, 0.0, 0.0, -1.0])
    freq = torch.tensor([0.2, -0.4, 0.0, 0.0])
    return logits, counts.to(torch.int32), prompt, rep, pres, freq
