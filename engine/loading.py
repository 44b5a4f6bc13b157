"""Resolve a model name or local path and build an engine for it.

Embedded default models (``tiny-bd``, ``tiny-mdm``, and ``tiny-dg``: a DiffusionGemma) ship inside the package;
model presets (``llada-8b-shape``, ..., ``diffusiongemma-26b-a4b-shape``: random weights of a real shape, for
profiles and benchmarks) are built in place; anything else must be a local
HF-format directory or a hub id (``org/name``, resolved through the hub cache by
``engine.models.hub``; downloaded there only when not cached).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.models.hub import is_hub_id, resolve_hub, snapshot_ref
from engine.models.presets import is_dg_preset, is_preset

DEFAULTS_DIR = Path(__file__).parent / "defaults"
DEFAULT_MODELS = ("tiny-bd", "tiny-mdm", "tiny-dg")  # tiny-dg: a DiffusionGemma (engine/canvas.py)


def resolve_model(name_or_path: str, revision: str | None = None) -> Path:
    """The checkpoint directory of an embedded model, a local directory, a hub id (at ``revision``) or a
    hub cache snapshot's path that this machine lacks (a config pinned elsewhere: resolved again by its
    repo id and commit)."""
    if is_preset(name_or_path):
        raise ValueError(f"{name_or_path!r} is a model preset (random weights), not a checkpoint directory")
    if name_or_path in DEFAULT_MODELS:
        path = DEFAULTS_DIR / name_or_path
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"embedded model {name_or_path!r} is missing at {path}; "
                                    "run `remask train-default` to rebuild it")
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(name_or_path):
        return resolve_hub(name_or_path, revision)
    if (ref := snapshot_ref(path)) is not None:
        return resolve_hub(*ref)
    raise FileNotFoundError(f"unknown model {name_or_path!r}: not an embedded model "
                            f"({', '.join(DEFAULT_MODELS)}), not a local directory and not a hub id (org/name)")


def engine_rule(path: Path | None, rule=None, decoding_config: dict | None = None):
    """The instance's decoding rule: the server's (``rule``, a name or a rule, with ``decoding_config``) over the
    checkpoint's at ``path`` (``engine.models.loader.checkpoint_decoding``) over ``threshold``
    (``engine.commands.resolve_rule``); a ValueError naming the field for an unknown rule or a bad value."""
    from engine.commands import resolve_rule
    from engine.models.loader import checkpoint_decoding

    if rule is not None and not isinstance(rule, str):
        return rule if not decoding_config else resolve_rule(rule, None, decoding_config, where="engine.")
    named = checkpoint_decoding(path) if path is not None else None
    base = None if named is None else resolve_rule(None, *named, where=f"{path}: ")
    if base is None and path is not None and is_canvas_model(path):  # DiffusionGemma: renoise, its generation's
        from engine.decoding.renoise import RenoiseRule
        from engine.models.diffusion_gemma import read_config

        base = RenoiseRule.from_generation(read_config(path).generation)
    chosen = resolve_rule(base, rule, decoding_config, where="engine.")
    if path is not None and base is not None and getattr(base, "canvas_rule", False) \
            and not getattr(chosen, "canvas_rule", False):
        raise ValueError(f"engine.decoding: {chosen.name!r} decodes masked-diffusion blocks; {path} is a "
                         f"DiffusionGemma model, whose canvases decode with {base.name!r}")
    return chosen


def is_canvas_model(path: Path) -> bool:
    """Whether the checkpoint directory at ``path`` holds a canvas (DiffusionGemma) model."""
    from engine.canvas import is_diffusion_gemma

    return is_diffusion_gemma(path)


def load_engine(name_or_path: str, device: str = "cpu", dtype: torch.dtype = torch.float32, **engine_kwargs):
    """An ``Engine`` for a model; its decoding rule: ``rule`` (a name or a rule) and ``decoding_config`` among
    ``engine_kwargs`` over the checkpoint's (``engine_rule``). A DiffusionGemma checkpoint gets a
    ``CanvasServeEngine`` (engine/canvas_serving.py: the same interface, canvas requests; it takes the KV pool
    and CUDA graph arguments, not the cache mode)."""
    from engine.engine import Engine
    from engine.models.loader import load_model
    from engine.tokenizer import load_tokenizer

    rule, config = engine_kwargs.pop("rule", None), engine_kwargs.pop("decoding_config", None)
    if is_dg_preset(name_or_path):  # a canvas model's shape, random weights: its rule is renoise's (generation)
        from engine.models.presets import dg_preset_engine

        return dg_preset_engine(name_or_path, device=device, dtype=dtype, rule=rule, decoding_config=config,
                                **engine_kwargs)
    if is_preset(name_or_path):
        from engine.models.presets import IdTokenizer, build_preset

        model = build_preset(name_or_path, device=device, dtype=dtype)
        return Engine(model, IdTokenizer(model.config), device=device, rule=engine_rule(None, rule, config),
                      **engine_kwargs)
    path = resolve_model(name_or_path)
    if is_canvas_model(path):
        from engine.canvas_serving import CanvasServeEngine

        return CanvasServeEngine.load(path, device=device, dtype=dtype, rule=engine_rule(path, rule, config),
                                      **engine_kwargs)
    model = load_model(path, dtype=dtype, device=device)
    return Engine(model, load_tokenizer(path), device=device, rule=engine_rule(path, rule, config), **engine_kwargs)
