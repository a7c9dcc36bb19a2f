"""File formats: the routing trace (contract 1: `schema`, `trace`), the measured speculative run
(contract 2: `specrun`) and a trace's summary. Nothing here runs a model."""
