"""The lookup ladder of a calibrated family (pure numpy; the profile contract uses it).

Per MoE layer, the first rung that applies (the order of TokenSim's and LLMServingSim's lookups):

1. `exact`: the layer's interpolation features equal a knot of the same expert shape and n (a
   calibration row of the family, equal knots merged) -> that knot's measured time;
2. `interpolated`: they lie inside the knots' hull (1-D: an interval; 2-D: a triangulation) ->
   the fitted model plus the barycentric interpolation of the knots' residuals (measured − fitted);
   the model carries what the knots do not vary;
3. `fitted`: the family's model (for a shape the table has, fitted with that shape's rows weighted);
4. `extrapolated`: an input outside the calibrated range -> the model, floored by the roofline.

`interpolate` holds the barycentric weights, `grid` the knots a profile carries, `rungs` the rung
names, their error bounds and the choice of rung, `transfer` the pass-level terms fitted on whole
passes.
"""
