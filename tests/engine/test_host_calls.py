"""Host calls (``NINFER_HOST_CALLS=1``, ``ninfer_qwen3_5/layers/host_mailbox.py``, ``ninfer/program/host_calls.py``):
a host-expert layer's decode-sized routed sum queued as a host function on the device's stream.

On the CPU the host function runs at once on the calling thread and torch copies stand in for the mailbox kernels
(their Triton form: tests/ops_triton/test_mailbox_triton.py; on CUDA: tests/engine/test_host_experts_gpu.py). Checked
here: the layer through the mailbox gives the eager native path's bits, for every format the native kernel reads, at
top-8 of 256 and top-10 of 512, for one token and for a full mailbox, and over repeated calls; larger calls, a cache,
other kernels and fp16 take the eager host step; the job's failures are raised by name; the environment switch.
"""

from __future__ import annotations

import ctypes

import pytest
import torch
from ninfer.contracts.options import InvalidEngineOptions
from ninfer.program.host_calls import HostCallError, launch_host_fn
from ninfer_qwen3_5.layers import host_experts as he
from ninfer_qwen3_5.layers.host_experts import HostExperts
from ninfer_qwen3_5.layers.host_mailbox import HostMailbox
from ninfer_qwen3_5.layers.host_native import NativeRows
from ninfer_qwen3_5.layers.host_options import HOST_CALLS_ENV, host_calls_enabled
from support.native import require_native_kernel

from engine.test_host_experts import _case
from engine.test_host_native import _bank

CPU = torch.device("cpu")


@pytest.fixture(scope="module", autouse=True)
def _built():
    require_native_kernel()


def _layer(gate_up, down, dtype, k, **kw):
    return HostExperts(gate_up, down, device=CPU, dtype=dtype, threads=2, rows=NativeRows(2), top_k=k, **kw)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "q4_g64_fp16", "q8_g32_fp16"])
@pytest.mark.parametrize("experts,k", [(256, 8), (512, 10)])
def test_the_mailbox_gives_the_eager_native_bits(fmt, experts, k):
    dtype = torch.bfloat16 if fmt == "bfloat16" else torch.float32
    gate_up, down = _bank(fmt, experts, 64, 48, seed=1), _bank(fmt, experts, 48, 32, seed=2)
    eager = _layer(gate_up, down, dtype, k)
    mailed = _layer(gate_up, down, dtype, k, host_calls=True)
    assert eager.mailbox is None and mailed.mailbox is not None
    capacity = mailed.mailbox.capacity
    assert capacity == he.MAILBOX_PAIRS // k
    for tokens in (1, 3, capacity, 1):   # a full mailbox, then one token again: no rows of the last call left
        x, w, ids, _, _, shared = _case(dtype, experts=experts, k=k, tokens=tokens, hidden=48, inter=32,
                                        seed=tokens)
        want = eager(x, w, ids, shared)
        got = mailed(x, w, ids, shared)
        assert got.dtype == dtype and torch.equal(got, want), tokens
        assert torch.equal(mailed(x, w, ids, None), eager(x, w, ids, None))
    assert mailed.mailbox.calls == 8


def test_what_does_not_fit_takes_the_host_step(monkeypatch):
    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    layer = _layer(gate_up, down, torch.float32, 2, host_calls=True)
    x, w, ids, _, _, shared = _case(torch.float32, experts=16, k=2, tokens=layer.mailbox.capacity + 1, hidden=48,
                                    inter=32)
    steps = []
    monkeypatch.setattr(he, "host_step", lambda fn, *a: steps.append(1) or fn())
    layer(x, w, ids, shared)
    assert steps == [1] and layer.mailbox.calls == 0
    layer(x[:2], w[:2], ids[:2], shared=None)
    assert steps == [1] and layer.mailbox.calls == 1


@pytest.mark.parametrize("case", ["torch kernel", "cache", "fp16", "no top-k", "off"])
def test_no_mailbox_where_host_calls_cannot_run(case):
    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    kw = dict(device=CPU, dtype=torch.float32, threads=2, rows=NativeRows(2), top_k=2, host_calls=True)
    if case == "torch kernel":
        kw["rows"] = None
    elif case == "cache":
        import types

        from ninfer.ops.reference.moe import moe_experts
        kw.update(cache_slots=2, ops=types.SimpleNamespace(moe_experts=moe_experts))
    elif case == "fp16":
        gate_up, down = gate_up.half(), down.half()
        kw["dtype"] = torch.float16
    elif case == "no top-k":
        kw["top_k"] = None
    else:
        kw["host_calls"] = False
    assert HostExperts(gate_up, down, **kw).mailbox is None


def test_a_failed_host_function_is_raised_by_name():
    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    box = HostMailbox(gate_up, down, top_k=2, capacity=4, dtype=torch.float32, threads=1, device=CPU)
    x, w, ids, _, _, _ = _case(torch.float32, experts=16, k=2, tokens=2, hidden=48, inter=32)
    ids[1, 0] = 99   # outside the bank: the job records -3, the call raises it
    with pytest.raises(RuntimeError, match="an expert id outside the bank"):
        box(x, w, ids, None)
    with pytest.raises(RuntimeError, match="expert id outside"):   # and every later call, before it runs
        box(x, w, ids.clamp(max=15), None)
    box2 = HostMailbox(gate_up, down, top_k=2, capacity=4, dtype=torch.float32, threads=1, device=CPU)
    box2.count[0] = 5   # more tokens than the mailbox holds
    launch_host_fn(box2._fn, ctypes.addressof(box2.job), CPU)  # noqa: SLF001
    with pytest.raises(RuntimeError, match="a token count outside the mailbox"):
        box2.check()


def test_bad_mailboxes_are_refused():
    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    with pytest.raises(ValueError, match="one format"):
        HostMailbox(gate_up, down.half(), top_k=2, capacity=4, dtype=torch.float32, threads=1, device=CPU)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        HostMailbox(gate_up, down, top_k=2, capacity=4, dtype=torch.float16, threads=1, device=CPU)
    with pytest.raises(ValueError, match=">= 1"):
        HostMailbox(gate_up, down, top_k=2, capacity=0, dtype=torch.float32, threads=1, device=CPU)


def test_host_functions_run_on_cuda_streams_or_the_cpu():
    with pytest.raises(HostCallError, match="not on meta"):
        launch_host_fn(0, 0, torch.device("meta"))


def test_host_calls_are_on_by_default(monkeypatch):
    monkeypatch.delenv(HOST_CALLS_ENV, raising=False)
    assert host_calls_enabled()
    monkeypatch.setenv(HOST_CALLS_ENV, "1")
    assert host_calls_enabled()
    monkeypatch.setenv(HOST_CALLS_ENV, "0")
    assert not host_calls_enabled()
    monkeypatch.setenv(HOST_CALLS_ENV, "yes")
    with pytest.raises(InvalidEngineOptions, match="NINFER_HOST_CALLS='yes'"):
        host_calls_enabled()


def test_a_program_raises_a_failed_host_call_after_its_step(monkeypatch):
    """A host function that failed inside a replayed graph cannot raise: the Program's next forward does."""
    from ninfer_qwen3_5.expert_caches import HostExpertCaches

    class Base:
        def forward(self, batch):
            return batch

    class Program(HostExpertCaches, Base):
        """The mixin over a forward that returns its batch."""

    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    box = HostMailbox(gate_up, down, top_k=2, capacity=4, dtype=torch.float32, threads=1, device=CPU)
    program = Program()
    listed = []
    program.model = type("M", (), {"host_mailboxes": lambda self: listed.append(1) or [box]})()
    assert program.forward("batch") == "batch"
    box.job.status = -2
    with pytest.raises(RuntimeError, match="working buffers could not be allocated"):
        program.forward("batch")
    assert listed == [1]   # listed once


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,bus_s", [(1, 1.0), (3, 1.0), (2, 3.0), (1, 0.01)])
def test_bus_reads_beside_a_host_call_give_the_host_steps_bits(dtype, tokens, bus_s):
    """With bus reads the device computes the last choices of each token (here the CPU's reference op) while the
    host function leaves them out: the same bits as the host step's bus call, all choices on the bus included."""
    import types

    from ninfer.ops.reference.moe import moe_experts
    from ninfer_qwen3_5.layers.expert_costs import ExpertCosts
    from ninfer_qwen3_5.layers.host_experts import ExpertStage

    x, w, ids, gate_up, down, shared = _case(dtype, experts=16, k=4, tokens=tokens)
    costs = ExpertCosts(copy_s=1.0, host_s=1.0, host_token_s=0.5, bus_s=bus_s)

    def layer(**kw):
        return HostExperts(gate_up, down, ops=types.SimpleNamespace(moe_experts=moe_experts), device=CPU,
                           dtype=dtype, costs=costs, stage=ExpertStage(CPU, dtype, slots=2), threads=2,
                           rows=NativeRows(2), top_k=4, **kw)

    eager, mailed = layer(), layer(host_calls=True)
    ranks = costs.bus_ranks(4)
    assert ranks > 0 and eager._bus and mailed._bus and mailed.mailbox is not None  # noqa: SLF001
    want = eager(x, w, ids, shared)
    got = mailed(x, w, ids, shared)
    assert torch.equal(got, want)
    assert mailed.bus_pairs == eager.bus_pairs == tokens * ranks
    assert mailed.mailbox.calls == (0 if ranks == 4 else 1)
    if ranks < 4:
        assert mailed.mailbox.skip[0].tolist() == [0] * (4 - ranks) + [1] * ranks
    # A call too large for bus reads but not for the mailbox posts its own flags (none left to the device), and
    # the next small call its own again: the flags travel with each call, never left over from another.
    big = 64 // 4 + 1
    xb, wb, idsb, _, _, sharedb = _case(dtype, experts=16, k=4, tokens=big, seed=7)
    # (no copies; its experts average over four tokens, so the host step gives them to torch's GEMMs: the same
    # sum in another fp32 order)
    host_only = HostExperts(gate_up, down, device=CPU, dtype=dtype, threads=2, rows=NativeRows(2))
    want_big = host_only(xb, wb, idsb, sharedb).float()
    assert torch.allclose(mailed(xb, wb, idsb, sharedb).float(), want_big, rtol=0,
                          atol=1e-5 if dtype == torch.float32 else 2e-2)
    assert int(mailed.mailbox.skip[:big].sum()) == 0
    assert torch.equal(mailed(x, w, ids, shared), eager(x, w, ids, shared))


def test_leaving_choices_to_the_device_is_checked():
    gate_up, down = _bank("float32", 16, 64, 48, seed=1), _bank("float32", 16, 48, 32, seed=2)
    box = HostMailbox(gate_up, down, top_k=2, capacity=4, dtype=torch.float32, threads=1, device=CPU)
    x, w, ids, _, _, _ = _case(torch.float32, experts=16, k=2, tokens=2, hidden=48, inter=32)
    with pytest.raises(ValueError, match="3 of 2 choices"):
        box.post(x, w, ids, device_choices=3)
    box.post(x, w, ids, device_choices=1)
    assert box.skip[:2].tolist() == [[0, 1], [0, 1]]
    box.post(x, w, ids)
    assert int(box.skip.sum()) == 0
