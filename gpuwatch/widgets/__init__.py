"""The dashboard's widgets, one per module; each draws from a RunState in ``show()``."""
