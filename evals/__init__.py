"""Offline evaluation: local MTEB task data and definitions (``evals.tasks``) and the sweep CLI (``evals.run``)."""
