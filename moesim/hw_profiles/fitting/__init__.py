"""Making profiles: fit every family of a measurement table (`calibrate`, `family_fit`), the dense
family from dense twins (`dense_twins`), what-if and datasheet-scaled profiles (`derive`,
`regenerate`)."""
