"""Named policy registries: ``@REGISTRY.register("name")`` on a class, ``REGISTRY.make("name")``.

A registry is a dict of name -> class, so ``sorted(registry)`` lists the known names.
Pure Python (the scheduler and the router both use it)."""

from __future__ import annotations

from typing import Any


class Registry(dict):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind  # "scheduling policy", "router policy": named in errors

    def register(self, name: str):
        def wrap(cls):
            cls.name = name
            self[name] = cls
            return cls

        return wrap

    def make(self, name: str, **kwargs) -> Any:
        try:
            cls = self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self))}") from None
        return cls(**kwargs)
