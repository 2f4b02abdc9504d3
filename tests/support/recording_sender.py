"""A publish loop's sender that keeps every message instead of sending it (the loop's tests
read what it would have put on the wire)."""

from __future__ import annotations

from typing import Any


class RecordingSender:
    def __init__(self) -> None:
        self.messages: list[tuple[str, dict[str, Any]]] = []
        self.send_drops = 0

    def send(self, topic: str, body: dict[str, Any]) -> None:
        self.messages.append((topic, body))

    def topics(self) -> list[str]:
        return [t for t, _ in self.messages]

    def last(self, topic: str) -> dict[str, Any]:
        return [b for t, b in self.messages if t == topic][-1]
