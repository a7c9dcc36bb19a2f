"""One fit per engine: an engine's kernels fitted over the rows of every device that ran it
(`engine_pool`), and that fit judged on models and devices it never saw (`pool_validation`)."""
