"""llama.cpp through llama-cpp-python's low-level API: a model, decoding contexts, routing capture.

The recorder and the speculative runner share this module. Settings chosen for reproducible
routing (facts checked by running llama-cpp-python 0.3.36): CPU only, flash attention off and
an F32 KV cache (then a prompt decoded in one batch and token by token selects bit-identical
experts), logits requested for every token of a capturing pass (otherwise llama.cpp's last layer
routes only the output rows), and llama.cpp's logging silenced unless asked for.

Routing capture installs `cb_eval` on a context: the scheduler asks about every graph node,
the callback answers yes for `ffn_moe_topk-L` (an I32 view of the argsort, read with its
strides: highest probability first) and the gate-weight tensors `ffn_moe_weights*-L`; the last
weight stage computed for a layer is the one the engine applies (`weights`, then `_softmax`,
`_norm`, `_scaled` when the architecture has them). One decode gives one round per ubatch;
rounds are concatenated in order. The callback adds a fixed cost per graph node, so passes are
timed on a context without it (see `moesim.tracegen.llamacpp.speculate`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Self

import numpy as np

from moesim.errors import InputError, MoesimError, Terminated
from moesim.machine import usable_cpus

ENGINE = "llama.cpp"
BACKEND = "cpu"
GGML_TYPE_F32 = 0
GGML_TYPE_I32 = 26
# graph nodes read: the top-k ids and each stage of the gate weights (not their "(reshaped)" views)
_CAPTURED = re.compile(rb"^ffn_moe_(topk|weights|weights_softmax|weights_norm|weights_scaled)-(\d+)$")


class EngineError(MoesimError):
    """llama.cpp refused or failed an operation (load, context, decode)."""


class _GGMLTensor(ctypes.Structure):
    """`struct ggml_tensor` of ggml 0.25 (GGML_MAX_DIMS 4, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


@dataclass
class _Runtime:
    """The loaded library, its ggml helpers and the log callback (one per process)."""

    llama: Any
    tensor_get: Any
    nbytes: Any
    log_callback: Any
    verbose: bool = False


_RUNTIME: _Runtime | None = None


def runtime(verbose: bool = False) -> _Runtime:
    """Load llama-cpp-python once; llama.cpp's log goes to stderr only when `verbose`."""
    global _RUNTIME
    if _RUNTIME is None:
        import llama_cpp
        from llama_cpp._ggml import libggml

        tensor_get = libggml.ggml_backend_tensor_get
        tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        tensor_get.restype = None
        nbytes = libggml.ggml_nbytes
        nbytes.argtypes = [ctypes.c_void_p]
        nbytes.restype = ctypes.c_size_t

        def log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            if _RUNTIME is not None and _RUNTIME.verbose:
                os.write(2, text)

        callback = llama_cpp.llama_log_callback(log)
        llama_cpp.llama_log_set(callback, ctypes.c_void_p())
        llama_cpp.llama_backend_init()
        _RUNTIME = _Runtime(llama_cpp, tensor_get, nbytes, callback)
    _RUNTIME.verbose = verbose
    return _RUNTIME


def engine_version() -> str:
    """The engine's version string written into traces."""
    import llama_cpp

    return f"llama-cpp-python {llama_cpp.__version__}"


class Closing:
    """A resource used as a context manager: `with` calls `close()` on the way out."""

    def close(self) -> None:
        """Free the resource (idempotent)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LlamaModel(Closing):
    """A GGUF model loaded on the CPU, with its vocabulary."""

    def __init__(self, path: str | Path, verbose: bool = False, n_gpu_layers: int = 0) -> None:
        self.path = Path(path)
        rt = runtime(verbose)
        self._llama = rt.llama
        if not self.path.is_file():
            raise InputError(f"{self.path}: no such GGUF file")
        params = self._llama.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers  # 0: CPU; -1: every layer on a GPU build's device (microbenchmarks)
        self.ptr = self._llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not self.ptr:
            raise EngineError(f"{self.path}: llama.cpp could not load the model (run with --verbose to see its log)")
        self.vocab = self._llama.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(self._llama.llama_vocab_n_tokens(self.vocab))
        self.n_ctx_train = int(self._llama.llama_model_n_ctx_train(self.ptr))

    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS when the vocabulary adds one."""
        if self._llama.llama_vocab_type(self.vocab) == self._llama.LLAMA_VOCAB_TYPE_NONE:
            raise InputError(f"{self.path}: the model has no tokenizer (tokenizer.ggml.model 'no_vocab'); text prompts need one")
        data = text.encode()
        capacity = len(data) + 8
        for _ in range(2):
            buffer = (self._llama.llama_token * capacity)()
            n = self._llama.llama_tokenize(self.vocab, data, len(data), buffer, capacity, True, False)
            if n >= 0:
                return list(buffer[:n])
            capacity = -n  # the buffer was too small: llama.cpp says how many it needs
        raise EngineError(f"{self.path}: tokenizing a prompt of {len(data)} bytes failed")

    def is_eog(self, token: int) -> bool:
        """Whether the token ends generation (EOS, EOT, ...)."""
        return bool(self._llama.llama_vocab_is_eog(self.vocab, token))

    def close(self) -> None:
        """Free the model."""
        if self.ptr:
            self._llama.llama_model_free(self.ptr)
            self.ptr = None


class RoutingCapture:
    """The eval callback: collects each MoE layer's top-k ids and gate weights of a decode."""

    def __init__(self, moe_layers: Sequence[int], top_k: int) -> None:
        self.moe_layers = tuple(moe_layers)
        self.top_k = top_k
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}
        rt = runtime()
        self._tensor_get, self._nbytes = rt.tensor_get, rt.nbytes
        self._ids: list[list[np.ndarray]] = [[] for _ in self.moe_layers]
        self._weights: list[list[np.ndarray | None]] = [[] for _ in self.moe_layers]
        self._error: BaseException | None = None
        self.callback = rt.llama.ggml_backend_sched_eval_callback(self._on_node)  # keep a reference

    def _on_node(self, tensor: int, ask: bool, user_data: int) -> bool:
        try:
            match = _CAPTURED.match(_GGMLTensor.from_address(tensor).name)
            if ask or match is None:
                return match is not None
            self._read(tensor, match.group(1) == b"topk", int(match.group(2)))
            return True
        except BaseException as exc:  # an exception must not cross the C boundary
            self._error = exc
            return False

    def _read(self, tensor: int, is_topk: bool, layer: int) -> None:
        slot = self._index.get(layer)
        if slot is None:
            raise EngineError(f"llama.cpp routed layer {layer}, which the GGUF metadata does not list as a MoE layer")
        t = _GGMLTensor.from_address(tensor)
        size = int(self._nbytes(tensor))
        raw = np.empty(size, np.uint8)
        self._tensor_get(tensor, raw.ctypes.data, 0, size)
        dtype = np.int32 if t.type == GGML_TYPE_I32 else np.float32
        shape = tuple(int(n) for n in reversed(t.ne[:4]))
        strides = tuple(int(n) for n in reversed(t.nb[:4]))
        # ggml_nbytes of a view spans exactly (ne - 1)·nb + element size: read it with its strides
        rows = np.ndarray(shape, dtype, buffer=raw, strides=strides).reshape(-1, self.top_k)
        if is_topk:
            self._ids[slot].append(rows)
            self._weights[slot].append(None)
        elif self._weights[slot]:
            self._weights[slot][-1] = rows

    def reset(self) -> None:
        """Forget what was captured."""
        self._ids = [[] for _ in self.moe_layers]
        self._weights = [[] for _ in self.moe_layers]
        self._error = None

    def discard(self) -> None:
        """Drop the routing of the last decode (a pass whose routing is not needed); re-raise a
        failure of the callback."""
        error = self._error
        self.reset()
        if error is not None:
            raise error

    def take(self, n_tokens: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The routing of the last decode: ids (T, L, K) int32 and weights (T, L, K) float32 or None."""
        if self._error is not None:
            self.discard()
        ids, weights = [], []
        for slot, layer in enumerate(self.moe_layers):
            if not self._ids[slot]:
                raise EngineError(f"llama.cpp reported no routing for MoE layer {layer} (no 'ffn_moe_topk-{layer}' tensor)")
            ids.append(np.concatenate(self._ids[slot]))
            parts = self._weights[slot]
            weights.append(None if any(p is None for p in parts) else np.concatenate(parts))  # type: ignore[arg-type]
        if any(a.shape[0] != n_tokens for a in ids):
            raise EngineError(f"llama.cpp routed {[a.shape[0] for a in ids]} tokens per MoE layer, expected {n_tokens}")
        self.reset()
        stacked = np.stack(ids, axis=1)
        return stacked, None if any(w is None for w in weights) else np.stack(weights, axis=1)  # type: ignore[arg-type]


class LlamaContext(Closing):
    """A decoding context on a model: one sequence, greedy logits, optional routing capture."""

    def __init__(
        self,
        model: LlamaModel,
        n_ctx: int,
        n_threads: int = 0,
        n_ubatch: int = 512,
        capture: RoutingCapture | None = None,
    ) -> None:
        self.model = model
        self._llama = model._llama
        self.capture = capture
        params = self._llama.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_ctx
        params.n_ubatch = min(n_ubatch, n_ctx)
        params.n_seq_max = 1
        threads = n_threads or usable_cpus()
        params.n_threads = params.n_threads_batch = threads
        params.flash_attn_type = self._llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.type_k = params.type_v = GGML_TYPE_F32
        params.no_perf = True
        if capture is not None:
            params.cb_eval = capture.callback
            params.cb_eval_user_data = None
        self.ptr = self._llama.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise EngineError(f"{model.path}: llama.cpp could not create a context of {n_ctx} tokens")
        self.n_ctx = n_ctx
        self.memory = self._llama.llama_get_memory(self.ptr)
        self._batch = self._llama.llama_batch_init(n_ctx, 0, 1)
        self._tokens = np.ctypeslib.as_array(self._batch.token, shape=(n_ctx,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(n_ctx,))
        self._n_seq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(n_ctx,))
        self._logits = np.ctypeslib.as_array(self._batch.logits, shape=(n_ctx,))
        for i in range(n_ctx):
            self._batch.seq_id[i][0] = 0

    def decode(self, tokens: Sequence[int], start_pos: int, all_logits: bool = True) -> np.ndarray:
        """Decode tokens at positions start_pos, start_pos+1, ...; returns logits (rows, vocab) of
        every token (or of the last one), float32."""
        n = len(tokens)
        if n < 1 or start_pos + n > self.n_ctx:
            raise EngineError(f"cannot decode {n} tokens at position {start_pos} in a context of {self.n_ctx}")
        self._tokens[:n] = tokens
        self._pos[:n] = np.arange(start_pos, start_pos + n)
        self._n_seq[:n] = 1
        self._logits[:n] = 1 if all_logits else 0
        self._logits[n - 1] = 1
        self._batch.n_tokens = n
        code = self._llama.llama_decode(self.ptr, self._batch)
        if code != 0:
            if self.capture is not None:
                self.capture.reset()
            raise EngineError(f"{self.model.path}: llama_decode failed with code {code} ({n} tokens at position {start_pos})")
        rows = n if all_logits else 1
        logits = np.ctypeslib.as_array(self._llama.llama_get_logits(self.ptr), shape=(rows * self.model.n_vocab,))
        return logits.reshape(rows, self.model.n_vocab).copy()

    def synchronize(self) -> None:
        """Wait for the backend (for timing)."""
        self._llama.llama_synchronize(self.ptr)

    def truncate(self, keep: int) -> None:
        """Drop the KV cache from position `keep` on (rolls back rejected drafts)."""
        self._llama.llama_memory_seq_rm(self.memory, 0, keep, -1)

    def clear(self) -> None:
        """Empty the KV cache (between prompts: no prefix is reused)."""
        self._llama.llama_memory_clear(self.memory, True)

    def close(self) -> None:
        """Free the context and its batch."""
        if self.ptr:
            self._llama.llama_batch_free(self._batch)
            self._llama.llama_free(self.ptr)
            self.ptr = None


class DeferredInterrupt:
    """Ctrl-C (SIGINT) or SIGTERM sets a flag checked between decodes (a signal must not land
    inside a C callback); a second one interrupts at once."""

    def __init__(self) -> None:
        self.requested: int | None = None

    def check(self) -> None:
        """Raise KeyboardInterrupt (Terminated for SIGTERM) if a signal arrived."""
        if self.requested is not None:
            raise Terminated if self.requested == signal.SIGTERM else KeyboardInterrupt

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None:
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.requested = signum


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[DeferredInterrupt]:
    """Install the deferring SIGINT and SIGTERM handlers (main thread only) for the block."""
    guard = DeferredInterrupt()
    try:
        previous = {s: signal.signal(s, guard._handler) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: leave signals alone
        yield guard
        return
    try:
        yield guard
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
