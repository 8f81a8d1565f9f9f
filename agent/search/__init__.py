"""The search: the in-run tuning of a run's knobs (``gpuwatch tune``), trying candidate
settings on the live run and keeping the fastest that is safe (:mod:`agent.search.tune`).
"""
