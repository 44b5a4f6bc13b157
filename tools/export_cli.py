"""``remask export MODEL DIR``: a model written as an HF checkpoint that transformers loads.

DiffusionGemma models (a checkpoint directory, a hub id, or an embedded DiffusionGemma default) are written as
``DiffusionGemmaForBlockDiffusion`` checkpoints: config.json, model.safetensors, generation_config.json and the
tokenizer files (``engine.models.diffusion_gemma.save_pretrained``). The masked-diffusion embedded models
(tiny-bd, tiny-mdm) are HF-format directories already, of an architecture transformers does not implement: the
command says so rather than writing a checkpoint transformers would misread.
"""

from __future__ import annotations

import sys


def cmd_export(args) -> int:
    import json

    import torch

    from engine.canvas import is_diffusion_gemma
    from engine.loading import resolve_model
    from engine.models import diffusion_gemma as dg

    path = resolve_model(args.model, args.revision)
    if not is_diffusion_gemma(path):
        arch = (json.loads((path / "config.json").read_text()).get("architectures") or ["?"])[0]
        raise ValueError(f"{args.model} ({arch}) is a masked-diffusion checkpoint, already an HF-format directory at "
                         f"{path}; transformers implements no {arch}, so remask export writes DiffusionGemma models")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    out = dg.save_pretrained(dg.load(path, dtype=dtype), args.dir, tokenizer_dir=path)
    print(f"remask: wrote {args.model} to {out}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    """Add ``export`` to the ``remask`` sub-parsers."""
    e = sub.add_parser("export", help="write a model as an HF checkpoint that transformers loads")
    e.add_argument("model", help="a DiffusionGemma checkpoint directory, hub id or embedded model")
    e.add_argument("dir", help="the directory to write (created)")
    e.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    e.set_defaults(func=cmd_export)
