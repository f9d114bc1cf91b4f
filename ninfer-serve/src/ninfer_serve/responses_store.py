"""The server's memory of recent responses (``store: true``), for ``previous_response_id`` and
``GET``/``DELETE /v1/responses/{id}``.

A bounded LRU held in memory (``--responses-store-size`` entries; 0 keeps none): storing or reading
an entry makes it the most recent, and the least recently used one goes when the store is full.
Nothing survives a restart.

Each entry keeps the whole conversation of its chain in the chat form the template renders (the
input of every response before it, their outputs as assistant turns, its own input and output),
not a link to its predecessor: a follow-up renders ``conversation + new input``, which repeats the
earlier prompt token for token, so the engine's context cache serves that prefix; and a chain still
resolves after its older links were evicted. ``instructions`` are not part of it: as in OpenAI's
API, a follow-up's instructions are its own.

Only the event loop touches the store (routes are async), so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ninfer_serve.responses_models import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    """``response``: the object as answered; ``conversation``: the chat messages its chain rendered
    (without instructions), its own output last."""

    response: ResponseObject
    conversation: tuple[Mapping[str, Any], ...]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"the responses store size must be >= 0, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: Sequence[Mapping[str, Any]]) -> None:
        if self.capacity == 0:
            return
        self._entries[response.id] = StoredResponse(response, tuple(conversation))
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None
