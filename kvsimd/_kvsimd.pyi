# Stubs of kvsimd's compiled core (kvsimd/_kvsimd.pyx and its .pxi files).  Checked against the
# built module by tests/test_stubs.py (python -m mypy.stubtest).
from typing import Any, ContextManager, Dict, List, Mapping, Optional, Sequence, TextIO, Tuple, Union

from typing_extensions import Self, disjoint_base

import numpy as np
import numpy.typing as npt

from kvsimd.errors import (KVSimdBusyError as KVSimdBusyError, KVSimdCapacityError as KVSimdCapacityError,
                           KVSimdISAError as KVSimdISAError, KVSimdMemoryError as KVSimdMemoryError,
                           KVSimdPositionError as KVSimdPositionError, KVSimdTypeError as KVSimdTypeError,
                           KVSimdValueError as KVSimdValueError)

__version__: str
MAX_THREADS: int
MAX_TOKENS: int
POLICIES: Tuple[str, ...]

_Array = npt.NDArray[Any]
_Range = Tuple[Any, ...]

# ---------------------------------------------------------------- runtime
def active_isa() -> str: ...
def cpu_features() -> List[str]: ...
def isa_info() -> Dict[str, Any]: ...
def show_runtime(file: Optional[TextIO] = ...) -> None: ...

# ---------------------------------------------------------------- ops
def attend(q: _Array, k: _Array, v: _Array, *, scale: Optional[float] = ..., alibi_slopes: Optional[_Array] = ...,
           key_positions: Optional[_Array] = ..., query_position: Optional[int] = ..., out: Optional[_Array] = ...,
           ranges: Optional[Sequence[_Range]] = ..., q_alt: Optional[_Array] = ...,
           softcap: Optional[float] = ..., causal_offset: Optional[int] = ..., causal: bool = ...,
           window: Optional[int] = ...) -> _Array: ...
def apply_rope(x: _Array, positions: Any, *, theta: float = ..., style: str = ...,
               rotary_dim: Optional[int] = ..., inv_freq: Optional[Sequence[float]] = ...,
               attn_factor: float = ...) -> _Array: ...
def shift_keys(k: _Array, delta: int, *, theta: float = ..., style: str = ..., rotary_dim: Optional[int] = ...,
               inv_freq: Optional[Sequence[float]] = ..., start: int = ..., stop: Optional[int] = ...) -> _Array: ...
def to_float16(x: _Array, out: Optional[_Array] = ...) -> _Array: ...
def to_float32(x: _Array, out: Optional[_Array] = ...) -> _Array: ...

# ---------------------------------------------------------------- plans
@disjoint_base
class RopeSpec:
    theta: float
    attn_factor: float
    rotary_dim: int
    head_dim: int
    def __new__(cls, theta: float, style: str, rotary_dim: Optional[int], head_dim: int,
                inv_freq: Optional[Sequence[float]] = ..., attn_factor: float = ...) -> Self: ...
    @property
    def style(self) -> str: ...
    @property
    def inv_freq(self) -> Optional[_Array]: ...
    @property
    def frequencies(self) -> _Array: ...
    def _key(self) -> Tuple[Any, ...]: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@disjoint_base
class _Plan:
    R: int
    H: int
    HD: int
    nrmax: int
    rd: int
    owner: Any
    embed_positions: Any
    refill: Mapping[int, Tuple[int, ...]]
    tokens: Any
    kind: int
    explicit: bool
    windows: Tuple[int, ...]
    def row(self, r: int) -> Tuple[int, int, int, int, Tuple[Tuple[int, int, int, int], ...]]: ...

# ---------------------------------------------------------------- caches
@disjoint_base
class _KVStore:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    capacity: int
    batch: int
    def __new__(cls, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, batch: int = ...,
                 dtype: Any = ..., **streaming: Any) -> Self: ...
    @property
    def dtype(self) -> np.dtype[Any]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def lengths(self) -> _Array: ...
    def length(self, seq: int = ...) -> int: ...
    def _layer_view(self, layer: int, which: int) -> _Array: ...
    def keys(self, layer: int, seq: int = ..., length: Optional[int] = ...) -> _Array: ...
    def values(self, layer: int, seq: int = ..., length: Optional[int] = ...) -> _Array: ...
    def write(self, layer: int, k: _Array, v: _Array, *, seq: int = ..., start: Optional[int] = ...) -> None: ...
    def commit(self, n: int, seq: int = ...) -> None: ...
    def reset(self, seq: Optional[int] = ...) -> None: ...
    def attend(self, layer: int, q: _Array, *, seq: int = ..., length: Optional[int] = ...,
               scale: Optional[float] = ..., alibi_slopes: Optional[_Array] = ...,
               query_position: Optional[int] = ..., out: Optional[_Array] = ...,
               softcap: Optional[float] = ...) -> _Array: ...

@disjoint_base
class KVCache(_KVStore):
    n_keep: int
    n_discard: int
    def __new__(cls, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, batch: int = ...,
                 dtype: Any = ..., n_keep: int = ..., policy: str = ..., n_discard: Optional[int] = ...) -> Self: ...
    @property
    def policy(self) -> str: ...
    @property
    def positions(self) -> _Array: ...
    @property
    def head(self) -> _Array: ...
    @property
    def seen(self) -> _Array: ...
    @property
    def rotations(self) -> _Array: ...
    @property
    def tokens(self) -> List[List[int]]: ...
    def transaction(self) -> ContextManager[Any]: ...
    def begin_prefill(self, seq: int, tokens: _Array, *, rope: Optional[RopeSpec] = ...,
                      alibi_slopes: Optional[_Array] = ..., n_heads: Optional[int] = ..., scale: Optional[float] = ...,
                      softcap: Optional[float] = ..., windows: Optional[Sequence[int]] = ...) -> _Plan: ...
    def end_prefill(self, plan: _Plan) -> None: ...
    def append(self, seq: int, n: int, tokens: Optional[_Array] = ...) -> None: ...
    def begin_step(self, tokens: _Array, *, rope: Optional[RopeSpec] = ..., alibi_slopes: Optional[_Array] = ...,
                   n_heads: Optional[int] = ..., scale: Optional[float] = ..., softcap: Optional[float] = ...,
                   windows: Optional[Sequence[int]] = ...) -> _Plan: ...
    def end_step(self, plan: _Plan) -> None: ...
    def truncate(self, seq: int, n: int) -> None: ...
    def step_plan(self, HD: int, slots: _Array, kpos: _Array, spos: _Array, ranges: Sequence[Sequence[_Range]], *,
                  rope: Union[RopeSpec, Tuple[float, str, Optional[int]], None] = ...,
                  alibi_slopes: Optional[_Array] = ..., scale: Optional[float] = ...,
                  key_positions: Optional[_Array] = ...) -> _Plan: ...
    def step_attend(self, layer: int, qkv: _Array, out: _Array, slots: _Array, kpos: _Array, spos: _Array,
                    ranges: Sequence[Sequence[_Range]], *,
                    rope: Union[RopeSpec, Tuple[float, str, Optional[int]], None] = ...,
                    alibi_slopes: Optional[_Array] = ..., scale: Optional[float] = ...,
                    key_positions: Optional[_Array] = ...) -> _Array: ...
    def shift_range(self, seq: int, t0: int, t1: int, delta: int, theta: float, style: str,
                    rotary_dim: Optional[int], *, inv_freq: Optional[Sequence[float]] = ...) -> None: ...

class CrossAttentionCache(_KVStore):
    def __new__(cls, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int, *, batch: int = ...,
                 dtype: Any = ..., **unexpected: Any) -> Self: ...

# ---------------------------------------------------------------- the layer
def weight_types() -> Dict[str, Dict[str, int]]: ...

@disjoint_base
class QMatrix:
    base: Any
    wtype: str
    name: str
    rows: int
    cols: int
    row_bytes: int
    ggml_type: int
    activations: str
    def __new__(cls, data: Any, wtype: str, shape: Tuple[int, int], *, name: str = ...,
                activations: Optional[str] = ...) -> Self: ...
    @property
    def shape(self) -> Tuple[int, int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def raw(self) -> _Array: ...
    def dequantize(self) -> _Array: ...
    def take(self, ids: Any) -> _Array: ...
    def matmul(self, x: _Array, out: Optional[_Array] = ...) -> _Array: ...
    def _repacked(self) -> Optional[_Array]: ...

@disjoint_base
class _Weight:
    a: _Array
    name: str
    def __new__(cls, a: _Array, name: str, shape: Sequence[int]) -> Self: ...

@disjoint_base
class _Parameters:
    w: _Weight
    b: Optional[_Weight]

@disjoint_base
class Linear(_Parameters):
    n_in: int
    n_out: int
    name: str
    parts: Tuple[QMatrix, ...]
    def __new__(cls, w: Union[_Array, QMatrix, Sequence[QMatrix]], b: Optional[_Array] = ..., *, name: str = ...,
                bias_name: Optional[str] = ...) -> Self: ...
    def __call__(self, x: _Array) -> _Array: ...

@disjoint_base
class Norm(_Parameters):
    rms: bool
    eps: float
    d: int
    def __new__(cls, w: _Array, b: Optional[_Array], rms: bool, eps: float, d: int, *, name: str = ...) -> Self: ...
    def __call__(self, x: _Array) -> _Array: ...

@disjoint_base
class Block:
    norm1: Norm
    norm2: Norm
    norm_cross: Optional[Norm]
    qkv: Linear
    o: Linear
    ffn_in: Linear
    ffn_out: Linear
    cross_q: Optional[Linear]
    cross_o: Optional[Linear]
    cross_kv: Optional[Linear]
    q_norm: Optional[Norm]
    k_norm: Optional[Norm]
    post_attn: Optional[Norm]
    post_ffn: Optional[Norm]
    def __new__(cls, norm1: Norm, qkv: Linear, o: Linear, norm2: Norm, ffn_in: Linear, ffn_out: Linear,
                 norm_cross: Optional[Norm] = ..., cross_q: Optional[Linear] = ..., cross_o: Optional[Linear] = ...,
                 cross_kv: Optional[Linear] = ..., *, q_norm: Optional[Norm] = ..., k_norm: Optional[Norm] = ...,
                 post_attn: Optional[Norm] = ..., post_ffn: Optional[Norm] = ...) -> Self: ...

@disjoint_base
class Layers:
    blocks: List[Block]
    d: int
    H: int
    Hkv: int
    D: int
    pre_norm: bool
    parallel: bool
    gated: bool
    cross: bool
    windows: Tuple[int, ...]
    def __new__(cls, blocks: Sequence[Block], *, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int,
                 activation: str, gated: bool, pre_norm: bool, parallel_residual: bool,
                 windows: Optional[Sequence[int]] = ...) -> Self: ...
    def run(self, x: _Array, plan: _Plan, cross: Optional[CrossAttentionCache] = ...) -> _Array: ...

# ---------------------------------------------------------------- private helpers the package calls
def _need_int(x: Any, name: str, lo: int = ..., hi: int = ...) -> int: ...
def _need_real(x: Any, name: str) -> float: ...
def _need_array(a: Any, name: str, dtypes: Any, ndim: int, dims: str, writeable: bool = ...,
                shape: Optional[Tuple[int, ...]] = ...) -> None: ...
def _rope_params(theta: Any, style: Any, rotary_dim: Any, D: int) -> Tuple[float, int, int]: ...
def _local_plan(T: int, H: int, Hkv: int, D: int, rope: Optional[RopeSpec], alibi_slopes: Optional[_Array],
                causal: bool, scale: Optional[float] = ..., softcap: Optional[float] = ...,
                windows: Optional[Sequence[int]] = ...) -> _Plan: ...
def _set_isa(name: str, forced: bool = ...) -> None: ...
def _quantize_x(x: Any) -> _Array: ...
def _restore_isa(name: str, forced: Any) -> None: ...
def _set_kernel_threads(n: int) -> None: ...
def _get_kernel_threads() -> int: ...
def _bench_read(buf: _Array) -> Any: ...
def _bench_mem(op: str, dst: _Array, src: _Array, threads: int = ...) -> Any: ...
def _fma_peak(isa: str, iters: int) -> Any: ...
