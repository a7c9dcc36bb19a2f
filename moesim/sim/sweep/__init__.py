"""Sweeps (`moesim sweep`): the config, the plan of work units, one unit's rows (`unit`; SimPy
cells in `cells`), executors (a registry) and the resumable driver (`run`)."""
