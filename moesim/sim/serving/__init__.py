"""Serving, simulated in SimPy: the server loop (`server`), workloads, acceptance models and
speculation policies (registries; Cascade in `cascade`), the config of `moesim simulate`
(`config`), its outputs (`outputs`) and the run (`run`)."""
