"""The host-call mailbox kernels (``ninfer_qwen3_5/ops/triton/mailbox.py``) against torch copies.

``post`` stores a call's rows of x (as they are), its routing weights (to fp32) and ids (to int64) and the token
count into the mailbox, and leaves the rows past the call alone; ``fetch`` is ``(sum + term).to(dtype)`` bit for bit
(fp32 add, one rounding to nearest even), with and without the term, strided inputs included. Under the interpreter
the mailbox is ordinary CPU memory; on CUDA it is page-locked host memory the kernels read and write in place, and
a CUDA graph replays both with new values each time.
"""

import pytest
import torch

pytest.importorskip("triton")

from .conftest import CUDA, DEVICE  # noqa: E402


def _mailbox(capacity, hidden, k, dtype):
    pin = CUDA
    return (torch.full((capacity, hidden), 7.0, dtype=dtype, pin_memory=pin),
            torch.full((capacity, k), 7.0, dtype=torch.float32, pin_memory=pin),
            torch.full((capacity, k), 7, dtype=torch.int64, pin_memory=pin),
            torch.full((capacity, k), 7, dtype=torch.uint8, pin_memory=pin),
            torch.zeros(1, dtype=torch.int64, pin_memory=pin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,hidden,k", [(1, 48, 8), (3, 1030, 10), (5, 64, 2)])
def test_post_stores_the_call_and_leaves_the_rest(dtype, tokens, hidden, k):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden + 3, generator=g).to(dtype)[:, :hidden]   # strided rows
    w = torch.rand(tokens, k, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 512, (tokens, k), generator=g, dtype=torch.int32)
    from ninfer_qwen3_5.ops.triton.mailbox import post

    hx, hw, hids, hskip, count = _mailbox(6, hidden, k, dtype)
    post(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), hx, hw, hids, hskip, count, device_choices=k // 2)
    if CUDA:
        torch.cuda.synchronize()
    assert int(count[0]) == tokens
    assert torch.equal(hx[:tokens], x) and torch.equal(hw[:tokens], w.float())
    assert torch.equal(hids[:tokens], ids.long())
    assert hskip[:tokens].tolist() == [[0] * (k - k // 2) + [1] * (k // 2)] * tokens
    assert (hx[tokens:] == 7).all() and (hw[tokens:] == 7).all() and (hids[tokens:] == 7).all()
    assert (hskip[tokens:] == 7).all()
    post(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), hx, hw, hids, hskip, count)   # none to the device
    if CUDA:
        torch.cuda.synchronize()
    assert int(hskip[:tokens].sum()) == 0


def test_post_refuses_what_does_not_fit():
    from ninfer_qwen3_5.ops.triton.mailbox import post

    hx, hw, hids, hskip, count = _mailbox(2, 16, 2, torch.float32)
    x, w, ids = torch.zeros(3, 16), torch.zeros(3, 2), torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not fit a mailbox of 2 rows"):
        post(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), hx, hw, hids, hskip, count)
    with pytest.raises(ValueError, match="no tokens"):
        post(x[:0].to(DEVICE), w[:0].to(DEVICE), ids[:0].to(DEVICE), hx, hw, hids, hskip, count)
    with pytest.raises(ValueError, match="3 of 2 choices"):
        post(x[:1].to(DEVICE), w[:1].to(DEVICE), ids[:1].to(DEVICE), hx, hw, hids, hskip, count, device_choices=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("term", [True, False])
@pytest.mark.parametrize("tokens,hidden", [(1, 48), (4, 2100)])
def test_fetch_is_the_host_steps_add_and_rounding(dtype, term, tokens, hidden):
    from ninfer_qwen3_5.ops.triton.mailbox import fetch

    g = torch.Generator().manual_seed(hidden)
    host_sum = torch.randn(tokens + 2, hidden, generator=g).pin_memory() if CUDA else torch.randn(
        tokens + 2, hidden, generator=g)
    t = torch.randn(tokens, hidden + 5, generator=g)[:, :hidden] if term else None   # strided
    got = fetch(host_sum, tokens, None if t is None else t.to(DEVICE), dtype, torch.device(DEVICE))
    want = (host_sum[:tokens] + t if term else host_sum[:tokens]).to(dtype)
    assert got.dtype == dtype and got.device.type == DEVICE and torch.equal(got.cpu(), want)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_a_graph_replays_post_and_fetch_with_new_values():
    from ninfer_qwen3_5.ops.triton.mailbox import fetch, post

    hx, hw, hids, hskip, count = _mailbox(4, 256, 8, torch.bfloat16)
    host_sum = torch.zeros(4, 256, pin_memory=True)
    x = torch.zeros(2, 256, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(2, 8, device="cuda")
    ids = torch.zeros(2, 8, dtype=torch.int64, device="cuda")
    post(x, w, ids, hx, hw, hids, hskip, count)
    fetch(host_sum, 2, None, torch.bfloat16, x.device)   # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        post(x, w, ids, hx, hw, hids, hskip, count)
        out = fetch(host_sum, 2, None, torch.bfloat16, x.device)
    for step in range(3):
        x.fill_(step + 1)
        ids.fill_(step)
        host_sum.fill_(10.0 * (step + 1))   # the host's sum, written between replays
        graph.replay()
        torch.cuda.synchronize()
        assert (hx[:2] == step + 1).all() and (hids[:2] == step).all() and int(count[0]) == 2
        assert (out == 10.0 * (step + 1)).all()
