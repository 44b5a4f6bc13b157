"""Virtual-time simulators driving the live policy code: one instance (``simulator``, ``runner``,
``model_runner``, ``workload``, ``scenarios``, ``threshold_table``) and a cluster behind the cluster driver
(``cluster``, ``cluster_run``, ``cluster_scenarios``, ``cluster_trace``, ``reconfig``), the ``remask
simulate`` command (``cli``) and the report (``report/``)."""
