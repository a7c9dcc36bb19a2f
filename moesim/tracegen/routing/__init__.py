"""Synthetic routing: the generators (a registry, `synth`) and their fit to a trace (`fit`)."""
