"""A host-expert layer's routed sum as a host function on the device's stream: host calls
(``NINFER_HOST_CALLS=1``, docs/memory.md "Host calls").

The eager host step (:meth:`~ninfer_qwen3_5.layers.host_experts.HostExperts._routed`) waits for the device, copies
the routing to the host, computes there and queues the copy back, all in Python, and a captured decode graph is cut
in segments around it (:mod:`ninfer.program.host_steps`). A host call queues the same work on the stream instead:

1. :func:`~ninfer_qwen3_5.ops.triton.mailbox.post` stores the call's rows of ``x``, the routing weights and ids
   and the token count into this layer's page-locked mailbox;
2. the native kernel's ``ninfer_host_job_run`` (``host_kernels.c``) runs as a host function
   (:func:`ninfer.program.host_calls.launch_host_fn`): the routed sum of the mailbox's rows into its ``out``;
3. :func:`~ninfer_qwen3_5.ops.triton.mailbox.fetch` reads the sum in place, adds the shared expert's fp32 term
   and rounds once to the activation dtype.

All three are captured into a decode graph as they are, so the graph stays one graph and a replay runs the host's
share without Python. The arithmetic is ``NativeRows.add_routed_ids``'s (the same C function on the same rows),
so the result equals the eager native path's bits. With bus reads (``device_choices`` of :meth:`HostMailbox.post`)
the host function leaves the last choices of each token out, and the layer's device computes them meanwhile
(``HostExperts._host_call``); :meth:`HostMailbox.fetch` adds its part before the term, as the host step does.

Invariants:
- One mailbox per layer, reused by every call: the stream orders a call's post, host function and fetch, and a
  layer's next call behind them. Graphs of different batch sizes share it, as they never replay at once.
- ``capacity`` tokens at most a call (:meth:`HostMailbox.fits`); a larger call takes the eager host step.
- The host function records a failure in the job's ``status`` (it cannot raise); :meth:`HostMailbox.check` raises
  it, and every call through the mailbox checks first.
- On the CPU (tests) the same C function runs at once on the calling thread, and torch copies stand in for the
  two kernels.
"""

from __future__ import annotations

import ctypes

import torch
from ninfer.program.host_calls import launch_host_fn
from ninfer.quant import PackedWeight

from ninfer_qwen3_5.layers.host_native import FORMATS, bank_format, bank_planes, library, status_text

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Job(ctypes.Structure):
    """``ninfer_host_job`` of host_kernels.c, field for field (every field 8 bytes)."""

    _fields_ = [("fmt", _i64), ("x_bf16", _i64), ("round", _i64), ("threads", _i64),
                ("gu_base", _ptr), ("gu_scales", _ptr), ("dn_base", _ptr), ("dn_scales", _ptr),
                ("hidden", _i64), ("inter", _i64), ("experts", _i64), ("k", _i64), ("capacity", _i64),
                ("count", _ptr), ("ids", _ptr), ("skip", _ptr), ("weights", _ptr), ("x", _ptr), ("out", _ptr),
                ("status", _i64), ("calls", _i64)]


class HostMailbox:
    """One host-expert layer's mailbox (module docstring) for banks ``gate_up [E, 2I, H]`` and ``down [E, H, I]`` as
    stored (in a format the native kernel reads: :func:`~ninfer_qwen3_5.layers.host_native.bank_format`), calls of
    up to ``capacity`` tokens with ``top_k`` experts each, activations in ``dtype`` (fp32 or bf16) on ``device``,
    and ``threads`` host threads."""

    def __init__(self, gate_up, down, *, top_k: int, capacity: int, dtype: torch.dtype, threads: int,
                 device: torch.device) -> None:
        fmt = bank_format(gate_up)
        if fmt is None or bank_format(down) != fmt:
            raise ValueError("host calls need both banks in one format the native kernel reads")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"host calls take fp32 or bf16 activations, not {dtype}")
        if capacity < 1 or top_k < 1 or threads < 1:
            raise ValueError(f"host calls need capacity, top_k and threads >= 1, got {capacity}, {top_k}, {threads}")
        experts, hidden, inter = gate_up.shape[0], down.shape[1], down.shape[2]
        self.device, self.dtype, self.capacity, self.top_k = device, dtype, capacity, top_k
        self.banks = (gate_up, down)   # the job points into them
        pinned = device.type == "cuda"   # the device reads and writes these in place
        self.count = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.x = torch.zeros((capacity, hidden), dtype=dtype, pin_memory=pinned)
        self.weights = torch.zeros((capacity, top_k), dtype=torch.float32, pin_memory=pinned)
        self.ids = torch.zeros((capacity, top_k), dtype=torch.int64, pin_memory=pinned)
        self.skip = torch.zeros((capacity, top_k), dtype=torch.uint8, pin_memory=pinned)   # posted with each call
        self.out = torch.zeros((capacity, hidden), dtype=torch.float32, pin_memory=pinned)
        # The reference's roundings: to bf16 when the wider of the activation and the (decoded) weight dtypes is.
        weight_dtype = torch.float32 if isinstance(gate_up, PackedWeight) else gate_up.dtype
        wide = torch.promote_types(dtype, weight_dtype)
        (gu, gu_scales), (dn, dn_scales) = bank_planes(gate_up), bank_planes(down)
        self.job = _Job(fmt=FORMATS[fmt], x_bf16=int(dtype == torch.bfloat16), round=int(wide == torch.bfloat16),
                        threads=threads, gu_base=gu, gu_scales=gu_scales, dn_base=dn, dn_scales=dn_scales,
                        hidden=hidden, inter=inter, experts=experts, k=top_k, capacity=capacity,
                        count=self.count.data_ptr(), ids=self.ids.data_ptr(), skip=self.skip.data_ptr(),
                        weights=self.weights.data_ptr(),
                        x=self.x.data_ptr(), out=self.out.data_ptr(), status=0, calls=0)
        self._fn = ctypes.cast(library().ninfer_host_job_run, ctypes.c_void_p).value

    @property
    def calls(self) -> int:
        """Host functions run so far (read without waiting for the device: a lower bound while work is queued)."""
        return self.job.calls

    def fits(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether a call with these activations and routing can go through the mailbox."""
        return (1 <= x.shape[0] <= self.capacity and x.dtype == self.dtype and ids.shape[1] == self.top_k
                and x.device.type == self.device.type)

    def check(self) -> None:
        """RuntimeError naming the first failure a host function recorded, if any."""
        status = self.job.status
        if status:
            raise RuntimeError(f"the host-expert kernel failed in a host call: {status_text(status)}")

    def post(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, device_choices: int = 0) -> None:
        """Step 1 (module docstring): the call's rows into the mailbox, the host function told to leave the last
        ``device_choices`` of each token's choices out (the device computes them: bus reads); raises a failure
        recorded earlier."""
        self.check()
        if not 0 <= device_choices <= self.top_k:
            raise ValueError(f"host call: {device_choices} of {self.top_k} choices left to the device")
        if self.device.type == "cuda":
            from ninfer_qwen3_5.ops.triton.mailbox import post

            post(x, weights, ids, self.x, self.weights, self.ids, self.skip, self.count, device_choices)
            return
        tokens = x.shape[0]
        self.x[:tokens].copy_(x)
        self.weights[:tokens].copy_(weights)
        self.ids[:tokens].copy_(ids)
        self.skip[:tokens] = 0
        if device_choices:
            self.skip[:tokens, self.top_k - device_choices:] = 1
        self.count[0] = tokens

    def run(self) -> None:
        """Step 2: the host function, queued on the current stream (on the CPU: run now, and checked)."""
        launch_host_fn(self._fn, ctypes.addressof(self.job), self.device)
        if self.device.type == "cpu":
            self.check()

    def fetch(self, tokens: int, term: torch.Tensor | None, dtype: torch.dtype,
              part: torch.Tensor | None = None) -> torch.Tensor:
        """Step 3: ``((sum + part) + term).to(dtype)`` ``[tokens, H]`` on the device, ``part`` the device's pairs
        (``[tokens, H]``, any float dtype, widened) or None, ``term`` fp32 or None."""
        if self.device.type == "cuda":
            from ninfer_qwen3_5.ops.triton.mailbox import fetch

            return fetch(self.out, tokens, term, dtype, self.device, part)
        routed = self.out[:tokens]
        if part is not None:
            routed = routed + part.float()
        if term is not None:
            routed = routed + term
        return routed.to(dtype, copy=True)

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 term: torch.Tensor | None) -> torch.Tensor:
        """``(routed sum + term).to(x.dtype)`` ``[T, H]`` on x's device, the routed sum (of the pairs the host takes)
        computed by a host function queued on the current stream: the three steps in order (module docstring);
        ``term``: fp32 ``[T, H]`` or None. Needs :meth:`fits`."""
        self.post(x, weights, ids)
        self.run()
        return self.fetch(x.shape[0], term, x.dtype)
