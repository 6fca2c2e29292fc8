"""Prometheus recording and alerting rules for syncwatch, written as Python data.

``thresholds.py`` holds every threshold and window; ``recording.py`` and ``alerts.py`` build the
rules; ``render.py`` writes them as the rule files committed in ``alerts/``; ``main.py`` is the
``syncwatch rules`` subcommand.
"""
