"""``remask faults``: fault injection against a real Ray Serve app, every answer checked.

Each fault scenario starts the app (tiny-bd) on a local Ray cluster and sends *deterministic* streaming
completions: a client-fixed threshold (so the router never chooses one), greedy (temperature 0) or seeded
sampling. Before the fault it runs every request once on the same app (the *reference pass*); after it,
each request's final text must equal its reference byte for byte, and a stream that ended early (cancelled
by its client, cut, failed cleanly) must have received a prefix of it (``checks.check``). A request is

- *completed* when it streamed its finish_reason and ``[DONE]`` with the reference text;
- *mismatched* when anything it received differs from the reference (whatever its outcome);
- *failed* (cleanly) when it got an HTTP error with an OpenAI-style body, Serve's proxy's 429 +
  ``Retry-After``, or an SSE error event;
- *lost* otherwise (a broken stream, a plain 500, a hang past the timeout).

``checks.verdict`` turns the counts into the exit status: non-zero on any lost or mismatched request, on fewer
kills than asked (so on zero kills), on fewer failovers (requests the dispatcher resumed elsewhere, from its
``/debug/instances`` counters) than kills, or on more clean failures than the scenario's stated bound.

One module per scenario: ``kill`` (``ray.kill`` of the busiest Denoiser replica, or its TP rank 1, under load),
``node`` (a two-node Ray cluster whose second node holds the Denoisers; the node's processes are killed
mid-stream), ``ingress`` (the Ingress killed under long streams; clients retry the cut ones), ``redeploy``
(``serve.run`` of a changed config under long streams), ``soak`` (mixed traffic at ~70% of the measured
capacity with cancellations and a kill every 5 minutes, and the replicas' memory slope), and the load
scenarios ``overload`` and ``cancel``.

The rest: ``checks`` (the requests, the content check, the verdict), ``harness`` (one checked stream, the
reference pass, the app on a local Ray cluster, kills and their watchers, this app's processes) and ``cli``
(``remask faults``).
"""

from tools.faults.cli import add_parsers, cmd_faults

__all__ = ["add_parsers", "cmd_faults"]
