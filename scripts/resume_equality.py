"""Does a resumed request decode the uninterrupted run's text? The engine alone, no service.

For each of ``--requests`` fault-harness requests (``tools.faults.checks.fault_requests``: task-suite prompts, a fixed
threshold, greedy or seeded), it runs the request uninterrupted, then for every round k stops a fresh engine
after k rounds and resumes the request on another fresh engine from its committed tokens (the prefix up to
the first mask: what the ingress holds when an instance dies), and compares the token ids. Resume points are
counted apart by whether the stopped canvas had tokens committed *past* the first mask (the threshold rule
unmasks the most confident positions anywhere in a block): those tokens are dropped by the resume and decoded
again from a canvas the uninterrupted run never had, so equality there is the model's doing, not a guarantee.

    .venv/bin/python scripts/resume_equality.py --requests 40 [--model tiny-bd]
"""

from __future__ import annotations

import argparse
import json
import time

from engine.device import set_threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-bd")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    set_threads(args.threads)

    from engine.loading import load_engine
    from engine.sequence import SamplingParams
    from tools.faults.checks import fault_requests

    def params(body: dict) -> SamplingParams:
        kw = {"max_tokens": body["max_tokens"], "threshold": body["threshold"]}
        if body["temperature"]:
            kw.update(temperature=body["temperature"], seed=body["seed"])
        return SamplingParams(**kw)

    def finish(engine, seq) -> list[int]:
        while not seq.finished:
            engine.step()
        return engine.output(seq).token_ids

    counts = {"resume_points": 0, "past_first_mask": 0, "past_first_mask_differs": 0, "clean_differs": 0}
    differing = []
    t0 = time.monotonic()
    for i, body in enumerate(fault_requests(args.requests)):
        engine = load_engine(args.model, max_slots=4)
        want = finish(engine, engine.add_request(body["prompt"], params(body)))
        for k in range(1, 400):
            engine = load_engine(args.model, max_slots=4)
            seq = engine.add_request(body["prompt"], params(body))
            for _ in range(k):
                engine.step()
            if seq.finished:
                break
            done = seq.output_ids()
            if not done or len(done) >= body["max_tokens"]:
                continue
            past = any(t != engine.cfg.mask_token_id for t in seq.canvas()[len(done):])
            other = load_engine(args.model, max_slots=4)
            got = finish(other, other.add_request(body["prompt"], params(body), committed=done))
            counts["resume_points"] += 1
            counts["past_first_mask"] += past
            if got != want:
                counts["past_first_mask_differs" if past else "clean_differs"] += 1
                differing.append({"request": i, "round": k, "past_first_mask": past, **body})
    print(json.dumps({"model": args.model, "requests": args.requests, **counts, "differing": differing[:10],
                      "wall_s": round(time.monotonic() - t0, 1)}))
    return 1 if counts["clean_differs"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
