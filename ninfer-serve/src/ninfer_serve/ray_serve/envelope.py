"""What the ingress hands a replica: one HTTP request, whole, plus the routing hints read from it.

A :class:`ForwardedRequest` is plain data (it crosses process and node boundaries through Ray's object
store). The replica rebuilds an ASGI scope from it and runs the ordinary ``ninfer serve`` app; the
router reads only ``affinity_key`` and ``pinned_replica`` and never the body.
"""

from __future__ import annotations

from dataclasses import dataclass

# Response header naming the replica that answered (Ray Serve's replica unique id): operators see where a
# session landed, and the ingress learns which replica stores a /v1/responses result.
REPLICA_HEADER = "x-ninfer-replica"


@dataclass(frozen=True)
class ForwardedRequest:
    """- ``method``, ``path``, ``query_string``, ``headers`` (lower-cased names, as ASGI gives them), ``body``:
      the client's request as received, the body complete.
    - ``client``: the client's ``(host, port)`` when the ingress knows it.
    - ``affinity_key``: requests with the same key go to the replica that served the key last, while it is
      alive and not full (:mod:`ninfer_serve.ray_serve.affinity` derives it); ``None``: least loaded.
    - ``pinned_replica``: the replica that must answer (it holds the stored response the request names);
      takes precedence over ``affinity_key``. A pinned replica that is gone is not waited for: the request
      goes elsewhere and gets that server's honest "not found"."""

    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    client: tuple[str, int] | None = None
    affinity_key: str | None = None
    pinned_replica: str | None = None
