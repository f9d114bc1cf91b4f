"""The request router of the engine replicas: session affinity first, least outstanding requests otherwise.

Ray Serve calls :meth:`AffinityRouter.choose_replicas` for every request sent through a handle to the
replica deployment, in the process holding the handle (the ingress). It returns ranks of replicas; Ray
picks, within the first rank that has room, the replica with the fewest requests in flight (its own
count, kept exact for requests this handle sent, refreshed from the replicas otherwise), and falls to the
next rank only when every replica of a rank is full (``max_ongoing_requests``). So:

- a request pinned to a replica (it names a response stored there) or whose affinity key was last routed
  to a replica that is still running gets ``[[that replica], [all the others]]``: it stays with its
  context cache unless that replica is full, when it spills to the least loaded other one;
- every other request gets ``[all replicas]``: least outstanding requests.

After routing, :meth:`on_request_routed` records key -> replica, so the next turn follows the last one
(after a spill, the cache is fresher where the turn went). The table is a bounded LRU; a key whose replica
has died or was scaled away is routed by load again and re-recorded. Only keys (hashes) are kept.

A custom Ray Serve ``RequestRouter`` rather than per-replica deployments picked by the ingress: Ray keeps
owning replica placement, autoscaling, health checks and replacement of dead replicas, and the router
sees the live replica set and the queue lengths it already tracks.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from ninfer_serve.ray_serve.envelope import ForwardedRequest

DEFAULT_TABLE_SIZE = 65536


def _forwarded(pending: PendingRequest | None) -> ForwardedRequest | None:
    if pending is None or not pending.args:
        return None
    first = pending.args[0]
    return first if isinstance(first, ForwardedRequest) else None


class AffinityRouter(RequestRouter):
    """Invariants: the table holds at most ``table_size`` keys, each mapped to the unique id of the replica
    the key's request was last routed to; routing never waits for a preferred replica that is full or gone."""

    def initialize_state(self, table_size: int = DEFAULT_TABLE_SIZE, **_: object) -> None:
        if table_size < 1:
            raise ValueError(f"table_size must be >= 1, got {table_size}")
        self._table_size = table_size
        self._table: OrderedDict[str, str] = OrderedDict()

    def _ensure_state(self) -> None:
        # Ray calls initialize_state after construction; a router built without it still routes correctly.
        if not hasattr(self, "_table"):
            self.initialize_state()

    def preferred(self, request: ForwardedRequest | None) -> str | None:
        """The unique id of the replica this request should go to, if any (it may no longer be running)."""
        self._ensure_state()
        if request is None:
            return None
        if request.pinned_replica is not None:
            return request.pinned_replica
        if request.affinity_key is None:
            return None
        replica = self._table.get(request.affinity_key)
        if replica is not None:
            self._table.move_to_end(request.affinity_key)
        return replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        want = self.preferred(_forwarded(pending_request))
        if want is not None:
            first = [r for r in candidate_replicas if r.replica_id.unique_id == want]
            if first:
                return [first, [r for r in candidate_replicas if r.replica_id.unique_id != want]]
        return [list(candidate_replicas)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        self._ensure_state()
        request = _forwarded(pending_request)
        if request is None or request.affinity_key is None:
            return
        self._table[request.affinity_key] = replica_id.unique_id
        self._table.move_to_end(request.affinity_key)
        while len(self._table) > self._table_size:
            self._table.popitem(last=False)
