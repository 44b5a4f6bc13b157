"""``remask generate``: decode one prompt (or a prompt per input line) with an engine, optionally showing the
canvas after each step."""

from __future__ import annotations


def _show(engine, seq, report) -> None:
    tok = engine.tokenizer
    text = tok.decode(seq.canvas()[: seq.max_tokens], skip_special=False).replace("<eos>", "·")
    print(f"step {len(seq.history):3d} {report.kind.value:9s} +{report.committed:<2d} |{text}|")


def _local(model: str, revision: str | None) -> str:
    """A hub id resolved to its snapshot directory (said on stderr); any other model as it is."""
    import sys

    from engine.models.hub import local_model

    path = local_model(model, revision)
    if path != model:
        print(f"remask: {model} resolved to {path}", file=sys.stderr)
    return path


def _generate_canvas(args, path: str) -> int:
    """A DiffusionGemma checkpoint: canvas requests (engine/canvas.py), the renoise rule's knob the entropy
    bound (``--entropy-bound``; the checkpoint's generation_config.json by default)."""
    from engine.canvas import CanvasEngine, CanvasParams

    if args.threshold is not None:
        raise ValueError("--threshold applies to masked-diffusion models; DiffusionGemma's knob is --entropy-bound")
    engine = CanvasEngine.from_pretrained(path, device=args.device)
    tok = engine.tokenizer
    params = CanvasParams(max_tokens=args.max_tokens, seed=args.seed, entropy_bound=args.entropy_bound)

    def answer(prompt: str) -> None:
        if args.raw:
            ids = tok.completion_ids(prompt)
        else:
            system = [{"role": "system", "content": args.system}] if args.system else []
            ids = tok.chat_ids([*system, {"role": "user", "content": prompt}])
        seq = engine.add_request(ids, params)
        while not seq.finished:
            for report in engine.step([seq]):
                if args.show_steps:
                    canvas = "" if seq.canvas is None else tok.decode(seq.canvas.tolist(), skip_special=False)
                    print(f"canvas {seq.canvas_index} {report.kind:7s} kept {report.kept:3d} |{canvas}|")
        out = engine.output(seq)
        engine.sequences.pop(seq.seq_id, None)
        print(out.text)
        if args.show_steps or args.prompt is None:
            print(f"[{out.finish_reason}; steps per canvas {out.steps_per_canvas}, {out.prefill_steps} prefill steps]")

    if args.prompt is not None:
        answer(args.prompt)
        return 0
    while True:  # interactive
        try:
            line = input("prompt> ").strip()
        except EOFError:
            return 0
        if line:
            answer(line)


def cmd_generate(args) -> int:
    from engine.canvas import is_diffusion_gemma
    from engine.loading import load_engine, resolve_model
    from engine.sequence import SamplingParams

    local = _local(args.model, args.revision)
    if is_diffusion_gemma(resolve_model(local)):
        return _generate_canvas(args, str(resolve_model(local)))
    if args.entropy_bound is not None:
        raise ValueError("--entropy-bound applies to DiffusionGemma models (the renoise rule)")
    engine = load_engine(local, device=args.device, cache=args.cache)
    tok, block = engine.tokenizer, engine.cfg.block_size
    defaults = getattr(tok, "generation_defaults", {})
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    sampling = {k: v if v is not None else defaults.get(k) for k, v in sampling.items()}
    params = SamplingParams(max_tokens=args.max_tokens, threshold=args.threshold, seed=args.seed,
                            **{k: v for k, v in sampling.items() if v is not None})

    def prompt_ids(text: str) -> list[int]:
        if args.raw:
            return tok.completion_ids(text, block)
        system = [{"role": "system", "content": args.system}] if args.system else []
        return tok.chat_ids([*system, {"role": "user", "content": text}], block)
    prompts = [args.prompt] if args.prompt is not None else None
    interactive = prompts is None
    while True:
        if interactive:
            try:
                line = input("prompt> ").strip()
            except EOFError:
                return 0
            if not line:
                continue
            prompts = [line]
        for prompt in prompts:
            seq = engine.add_request(prompt_ids(prompt), params)
            while not seq.finished:
                result = engine.step([seq])
                if args.show_steps:
                    _show(engine, seq, result.reports[0])
            out = engine.output(seq)
            engine.sequences.pop(seq.seq_id, None)
            print(out.text)
            if args.show_steps or interactive:
                print(f"[{out.finish_reason}; {out.rounds} rounds, {out.prefill_steps} prefill steps]")
        if not interactive:
            return 0

def add_parsers(sub) -> None:
    """Add ``generate`` to the ``remask`` sub-parsers."""
    g = sub.add_parser("generate", help="generate an answer (interactive without --prompt)")
    g.add_argument("--model", default="tiny-bd", help="an embedded model, a local directory or a hub id (org/name)")
    g.add_argument("--revision", help="a hub id's branch, tag or commit (default: main)")
    g.add_argument("--prompt")
    g.add_argument("--threshold", type=float)
    g.add_argument("--entropy-bound", type=float,
                   help="DiffusionGemma: the renoise rule's entropy bound (higher: faster, lower quality)")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--system", help="a system message before the prompt (chat format)")
    g.add_argument("--raw", action="store_true", help="the prompt as raw text, without the chat template")
    g.add_argument("--temperature", type=float, help="0: greedy (default: the checkpoint's generation_config.json)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int, help="the same seed gives the same text")
    g.add_argument("--show-steps", action="store_true", help="print the canvas after each step")
    g.add_argument("--cache", default="dual", choices=["none", "prefix", "dual"])
    g.add_argument("--device", default="cpu")
    g.set_defaults(func=cmd_generate)
