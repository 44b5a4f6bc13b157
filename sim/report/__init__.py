"""``remask report``: every simulator scenario with fixed seeds, the papers' figures beside Remask's,
fidelity checks that can fail, and the combined policy (DWISE inside instances, DiLaServe across them)
against each alone. Entry point: ``sim.report.cli`` (``remask report --out reports/ [--quick]``)."""
