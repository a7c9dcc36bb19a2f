"""Routing traces: file formats (`formats`), synthetic routing and its fit (`routing`), the
llama.cpp adapter that records and measures them (`llamacpp`), and importers of routing recorded
elsewhere (`importers`). Map: docs/architecture.md."""
