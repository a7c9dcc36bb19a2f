"""The llama.cpp adapter (llama-cpp-python): the runtime (model, contexts, routing capture), the
recorder (contract 1), measured speculative runs (contract 2), the tiny GGUF builder and reader,
and prompt files."""
