"""Pass costs: expert bytes per pass (`passbytes`), the step-time model (`steptime`), drafter
costs (`drafters`, a registry), what the server asks of a cost model and the pass-cost table
(`pass_table`), the trace-driven batch cost (`trace_batch`), and the passes of measured
speculative runs (`measured_passes`)."""
