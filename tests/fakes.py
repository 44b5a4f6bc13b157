"""Stand-ins shared by the tests."""

from __future__ import annotations


class RecordingLink:
    """A control channel that records what the dispatcher sends and never breaks."""

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> bool:
        self.sent.append(msg)
        return True

    def close(self) -> None:
        pass
