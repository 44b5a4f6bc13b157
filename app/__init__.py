"""Remask application layer: config, OpenAI-compatible API, router core, CLI."""
