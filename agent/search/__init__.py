"""The search: the in-run tuning of a run's knobs (``gpuwatch tune``).

It tries candidate settings on the live run and keeps the fastest that is safe.
:mod:`agent.search.tune` is the agent's side of the ``tune`` command and the thread that
sends the search's commands; :mod:`~agent.search.request` parses the request;
:mod:`~agent.search.tuner` is the search's state machine (trials, verdicts, blame);
:mod:`~agent.search.coordinate` chooses the candidates (ladders, trades);
:mod:`~agent.search.stats` measures them (blocks, MSER, the paired t-interval).
"""
