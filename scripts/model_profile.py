"""Write the modelled H200 latency profiles of google/diffusiongemma-26B-A4B-it (engine/profile_model.py):

    .venv/bin/python scripts/model_profile.py                 # profiles/h200-diffusiongemma-26b-a4b-modelled.json
                                                              # and its -tp2, -tp4 siblings (TP instances)
    .venv/bin/python scripts/model_profile.py --out /tmp/p.json --check
    .venv/bin/python scripts/model_profile.py --count-kernels  # the kernels per layer the launch term uses
    .venv/bin/python scripts/model_profile.py --steps-curve EVAL_JSON  # planner.costs' steps-per-canvas curves

(``EVAL_JSON``: what `remask eval --model tiny-dg --n 300 --json --entropy-bounds 0.05,0.1,0.2,0.4,0.8` prints.)

It prints the fit of the profile's RoundModel to the architectural model, the launch-time calibration on the
LLaDA2-mini H200 run, a few priced rounds and the published figure it is compared with; for each TP degree
(``--tp-degrees``, default 2,4: ``NAME-tpN.json`` beside ``--out``, which ``load_tp_profiles`` prefers to TP-1's
scaled) its fit and its rounds against TP-1's. ``--check``: exit 1 if a written file differs from the shipped
one. A GPU run (`remask profile` of the checkpoint, ``--tp N`` for a TP instance) replaces each.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def count_kernels() -> dict[str, float]:
    """Dispatched torch operators per layer (views, metadata and bare allocations excluded) of this engine's
    forwards (as served: projections fused), on tiny
    random models of each family's layout: a model of two layers minus one of one (LLaDA2-mini: three minus
    two, its first layer dense)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine.models import diffusion_gemma as dg
    from engine.models.presets import build_preset

    # views and metadata launch nothing; allocations without a fill neither
    skip = {"view", "_unsafe_view", "reshape", "expand", "t", "transpose", "unsqueeze", "squeeze", "permute",
            "slice", "select", "split", "split_with_sizes", "chunk", "unflatten", "flatten", "alias", "detach",
            "as_strided", "unbind", "lift_fresh", "empty", "empty_like", "empty_strided", "_local_scalar_dense",
            "item", "sym_size", "sym_stride", "sym_numel", "is_same_size", "_reshape_alias"}

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__.rstrip("_") not in skip:
                self.n += 1
            return func(*args, **(kwargs or {}))

    def ops(fn) -> int:
        with torch.no_grad(), Count() as c:
            fn()
        return c.n

    def preset_ops(name: str, layers: int) -> int:
        small = "hidden=64,heads=4,kv_heads=4,intermediate=128,vocab=256"
        if name == "llada2-mini-shape":
            small = "hidden=64,heads=4,kv_heads=2,head_dim=16,intermediate=128,vocab=256,experts=16," \
                    "experts_per_token=4,moe_intermediate=32"
        model = build_preset(f"{name}:layers={layers},{small}", dtype=torch.float32).fuse_projections()  # as served
        ids = torch.randint(0, 200, (2, 32))
        pos = torch.arange(32).expand(2, 32)
        model(ids, pos, None)  # warm (lazy tables)
        return ops(lambda: model(ids, pos, None))

    def dg_ops(layers: int) -> int:
        text = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": layers, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "num_global_key_value_heads": 1,
                "attention_k_eq_v": True, "sliding_window": 16, "vocab_size": 256, "num_experts": 16,
                "top_k_experts": 4, "moe_intermediate_size": 32, "enable_moe_block": True,
                "layer_types": ["sliding_attention"] * layers}
        cfg = dg.config_from_hf({"text_config": text, "canvas_length": 32})
        torch.manual_seed(0)
        model = dg.DiffusionGemma(cfg).eval()
        cache = dg.DGCache(cfg)
        model.encode(torch.randint(0, 200, (1, 8)), cache)
        canvas = torch.randint(0, 200, (1, 32))
        model.decode(canvas, cache)
        return ops(lambda: model.decode(canvas, cache))

    return {"llada-8b-shape": float(preset_ops("llada-8b-shape", 2) - preset_ops("llada-8b-shape", 1)),
            "llada2-mini-shape": float(preset_ops("llada2-mini-shape", 3) - preset_ops("llada2-mini-shape", 2)),
            "diffusiongemma": float(dg_ops(2) - dg_ops(1))}


def main(argv: list[str] | None = None) -> int:
    from engine import profile_model as pm
    from engine.argtypes import int_list
    from engine.latency_profile import PROFILES_DIR

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(PROFILES_DIR / f"{pm.NAME}.json"))
    ap.add_argument("--source", default=pm.SOURCE, help="the measured profile whose rates are scaled")
    ap.add_argument("--calibration", default=pm.CALIBRATION, help="a measured MoE profile the experts' rate is "
                    "fitted to ('' for none: moe_efficiency 1)")
    ap.add_argument("--tp-degrees", type=lambda t: int_list(t) if t.strip() else [], default=[2, 4],
                    help="TP degrees whose profiles are written beside --out as NAME-tpN.json ('' for none)")
    ap.add_argument("--check", action="store_true", help="exit 1 if a written file differs from the shipped one")
    ap.add_argument("--count-kernels", action="store_true", help="print the kernels per layer and exit")
    ap.add_argument("--steps-curve", metavar="EVAL_JSON", help="print the steps-per-canvas curves of a `remask eval "
                    "--model tiny-dg --json --entropy-bounds ...` output (planner.costs) and exit")
    args = ap.parse_args(argv)
    if any(d < 2 for d in args.tp_degrees):
        ap.error(f"--tp-degrees: TP degrees of at least 2 (TP-1's is --out), got {args.tp_degrees}")
    if args.steps_curve:
        from planner.costs import scaled_steps_curve

        data = json.loads(Path(args.steps_curve).read_text())
        tiny = {float(r["entropy_bound"]): float(r["steps_per_canvas"]) for r in data["results"]}
        print(json.dumps({"TINY_DG_STEPS_PER_CANVAS": tiny, "DG_STEPS_PER_CANVAS": scaled_steps_curve(tiny),
                          "model": data.get("model"), "n": data.get("n"), "seed": data.get("seed")}))
        return 0
    if args.count_kernels:
        got = count_kernels()
        print(json.dumps({"counted": got, "used": pm.KERNELS_PER_LAYER}))
        return 0 if got == pm.KERNELS_PER_LAYER else 1
    prof, model = pm.model_profile(args.source, args.calibration or None)
    text = pm.profile_json(prof)
    out = Path(args.out)
    out.write_text(text)
    written = {prof.name: (out, text)}
    report = {"written": args.out, "fit": pm.fit_check(prof, model), "moe_efficiency": model.moe_efficiency,
              "calibration": prof.meta["calibration"], "rounds": pm.rounds_summary(prof),
              "published": pm.published_check(prof, model), "tp": {}}
    for d in args.tp_degrees:
        tp_prof, tp_model = pm.model_profile(args.source, args.calibration or None, tp=d)
        path = out.with_name(f"{out.stem}-tp{d}.json")
        written[tp_prof.name] = (path, pm.profile_json(tp_prof))
        path.write_text(written[tp_prof.name][1])
        report["tp"][d] = {"written": str(path), "fit": tp_prof.meta["fit_error_vs_model"],
                           "rounds": pm.rounds_summary(tp_prof), "vs_tp1": tp_prof.meta["tensor_parallel"]["vs_tp1"]}
    print(json.dumps(report, indent=1))
    if args.check:
        shipped = {name: PROFILES_DIR / f"{name}.json" for name in written}
        differ = [name for name, (_, text) in written.items()
                  if not shipped[name].exists() or shipped[name].read_text() != text]
        if differ:
            print(f"differs from the shipped profile: {', '.join(differ)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
