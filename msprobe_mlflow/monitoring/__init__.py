"""The monitor's assembly, what both framework monitors share above the sinks and ``tracking/``: the options as one
checked object (``options.py``, :class:`~msprobe_mlflow.monitoring.options.MonitorOptions`, also
``msprobe_mlflow.MonitorOptions``), the always-on tier (``directions_schedule.py``) and ``SessionMonitor``
(``session_monitor.py``: the options turned into a session and its sinks). Imports nothing here, so that importing
one of them loads only what it needs."""
