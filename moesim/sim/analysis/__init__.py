"""Closed forms, one module per question: the scenario they start from, `predict` (T(n)),
`crossover` (u(n), r(n), win set), `batch` (MoESD's target efficiency vs B); the formulas of
speculation and `best-draft`'s k*(α), staircase and break-even (`speculation`), its verdicts
(`verdict`) and MoESD (`moesd`)."""
