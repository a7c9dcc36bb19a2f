"""The simulator and what answers the questions: pass costs (`cost`), closed forms (`analysis`),
the SimPy server (`serving`), sweeps (`sweep`), predicted vs measured (`validate`), reports
(`report`) and the demo. Floors and data flow: docs/architecture.md."""
