"""Stand-ins shared by the tests."""

from __future__ import annotations

import threading

from engine.progress import ErrorItem, StepItem


class RecordingLink:
    """A control channel that records what the dispatcher sends and never breaks."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def close(self) -> None:
        pass


class Sink:
    """A round loop's progress items per request (its ``on_batch``); ``wait`` until the given requests ended."""

    def __init__(self) -> None:
        self.items: dict[str, list] = {}
        self.cond = threading.Condition()

    def __call__(self, batch) -> None:
        with self.cond:
            for item in batch.items:
                self.items.setdefault(item.req_id, []).append(item)
            self.cond.notify_all()

    def ended(self, req_id: str):
        """The item that ended the request (an error, or its last step), or None while it runs."""
        items = self.items.get(req_id, ())
        return next((i for i in items if isinstance(i, ErrorItem) or isinstance(i, StepItem) and i.done), None)

    def wait(self, req_ids, timeout: float = 60.0) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: all(self.ended(r) for r in req_ids), timeout), \
                {r: self.ended(r) for r in req_ids}

    def ids(self, req_id: str) -> list[int]:
        return [t for i in self.items[req_id] if isinstance(i, StepItem) for t in i.ids]
