"""Closed forms, one module per question: the scenario they start from, `predict` (T(n)),
`best_draft` (k*(α), staircase, break-even), `crossover` (u(n), r(n), win set), `batch` (MoESD's
target efficiency vs B); the formulas of speculation (`speculation`) and MoESD (`moesd`)."""
