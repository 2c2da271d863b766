"""Where each stored Responses API answer lives, and whose it is.

A replica keeps the responses it made (for `previous_response_id` and `GET /v1/responses/{id}`); another replica
has never seen them. The gateway remembers, for the newest ids, the replica that holds one and the namespace of
the key that asked, so a continuation goes back to that replica and no other key can read or continue it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_HOMES = 8192  # a replica keeps its newest 1024; several replicas' worth, then the oldest are forgotten


@dataclass(frozen=True)
class Home:
    namespace: str
    replica_url: str


class ResponseHomes:
    def __init__(self, size: int = MAX_HOMES) -> None:
        self.size = size
        self._homes: OrderedDict[str, Home] = OrderedDict()

    def put(self, response_id: str, namespace: str, replica_url: str) -> None:
        self._homes[response_id] = Home(namespace, replica_url)
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.size:
            self._homes.popitem(last=False)

    def find(self, response_id: str, namespace: str) -> Home | None:
        """The response's home when this namespace made it; None for an unknown id and for another key's."""
        home = self._homes.get(response_id)
        return home if home is not None and home.namespace == namespace else None
