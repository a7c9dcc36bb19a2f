"""Microbenchmark runners that write measurement tables (contract 3).

`llama_cpp`: per-layer expert time through llama.cpp (llama-cpp-python, the installed build's
backend) by differencing models with L and 2L MoE layers. `torch_cuda`: per-slot and
deduplicating kernels through torch on a CUDA GPU. `backend_ops`: importer of llama.cpp's own
`test-backend-ops perf -o MUL_MAT_ID` output. `routing` and `table` are shared by all of them.
"""
