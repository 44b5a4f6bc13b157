"""The serving library, below the Ray Serve deployments: configuration (``config``), the HTTP API and its
front (``api/``, ``routes``, ``frontend``, ``completions``, ``middleware``, ``gate``, ``auth``), the
dispatcher that carries out the cluster driver over live instances (``dispatch``), the control channel and
its protocol (``channel``, ``protocol``), the replica server (``replica``), the planner service and Serve's
autoscaling policies (``planner_service``, ``autoscaling``), metrics, GC pauses, control timing and the
playground. The router core lives in ``cluster/``, the command line in ``tools/``."""
