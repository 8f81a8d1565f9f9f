"""The dashboard's screens, one per module: each a modal view over the panels (the help,
the run list, a comparison of runs, the search's progress), closed to go back."""
