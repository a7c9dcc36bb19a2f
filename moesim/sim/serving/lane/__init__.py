"""The server's compiled lane (`custody`: the requests it holds and its runs; `kernel`: the compiled iteration)."""

from moesim.sim.serving.lane.custody import Lane, exact_delays

__all__ = ["Lane", "exact_delays"]
