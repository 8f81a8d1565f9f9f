"""The dashboard's screens, one per module: each a modal view over the panels, closed to go back.

The help, the run list, a comparison of runs, the search's progress."""
