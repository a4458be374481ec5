from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Dtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[Dtype]
    DTYPE_FLOAT32: _ClassVar[Dtype]
    DTYPE_FLOAT16: _ClassVar[Dtype]
    DTYPE_INT8: _ClassVar[Dtype]
    DTYPE_UINT8: _ClassVar[Dtype]
    DTYPE_BINARY: _ClassVar[Dtype]
    DTYPE_UBINARY: _ClassVar[Dtype]
DTYPE_UNSPECIFIED: Dtype
DTYPE_FLOAT32: Dtype
DTYPE_FLOAT16: Dtype
DTYPE_INT8: Dtype
DTYPE_UINT8: Dtype
DTYPE_BINARY: Dtype
DTYPE_UBINARY: Dtype

class InfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model", "dim", "max_tokens", "normalize", "compute_dtype", "representations", "prompt_names", "revision")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    REPRESENTATIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NAMES_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    model: str
    dim: int
    max_tokens: int
    normalize: bool
    compute_dtype: str
    representations: _containers.RepeatedScalarFieldContainer[str]
    prompt_names: _containers.RepeatedScalarFieldContainer[str]
    revision: str
    def __init__(self, model: _Optional[str] = ..., dim: _Optional[int] = ..., max_tokens: _Optional[int] = ..., normalize: _Optional[bool] = ..., compute_dtype: _Optional[str] = ..., representations: _Optional[_Iterable[str]] = ..., prompt_names: _Optional[_Iterable[str]] = ..., revision: _Optional[str] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("inputs", "model", "dimensions", "dtype", "truncate", "window_overlap")
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_OVERLAP_FIELD_NUMBER: _ClassVar[int]
    inputs: _containers.RepeatedScalarFieldContainer[str]
    model: str
    dimensions: int
    dtype: Dtype
    truncate: bool
    window_overlap: int
    def __init__(self, inputs: _Optional[_Iterable[str]] = ..., model: _Optional[str] = ..., dimensions: _Optional[int] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., truncate: _Optional[bool] = ..., window_overlap: _Optional[int] = ...) -> None: ...

class Vector(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("vectors", "dtype", "dim", "model", "prompt_tokens")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    vectors: _containers.RepeatedCompositeFieldContainer[Vector]
    dtype: Dtype
    dim: int
    model: str
    prompt_tokens: int
    def __init__(self, vectors: _Optional[_Iterable[_Union[Vector, _Mapping]]] = ..., dtype: _Optional[_Union[Dtype, str]] = ..., dim: _Optional[int] = ..., model: _Optional[str] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
