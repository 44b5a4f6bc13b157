"""Load generation: seeded traces of task-suite requests, open-loop replay and its metrics, plots, the no-op
server that measures the generator itself, Locust users, and the ``remask chat`` client."""
