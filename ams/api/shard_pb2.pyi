from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    INT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
INT64: DType
INT32: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class TableSpec(_message.Message):
    __slots__ = ("name", "num_rows", "dim", "dtype", "state_dtype", "momentum", "weight_decay", "seed", "init_std")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    STATE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INIT_STD_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_rows: int
    dim: int
    dtype: DType
    state_dtype: DType
    momentum: float
    weight_decay: float
    seed: int
    init_std: float
    def __init__(self, name: _Optional[str] = ..., num_rows: _Optional[int] = ..., dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., state_dtype: _Optional[_Union[DType, str]] = ..., momentum: _Optional[float] = ..., weight_decay: _Optional[float] = ..., seed: _Optional[int] = ..., init_std: _Optional[float] = ...) -> None: ...

class CreateTableRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ...) -> None: ...

class CreateTableReply(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class SnapshotReply(_message.Message):
    __slots__ = ("path", "step")
    PATH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    path: str
    step: int
    def __init__(self, path: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("step",)
    STEP_FIELD_NUMBER: _ClassVar[int]
    step: int
    def __init__(self, step: _Optional[int] = ...) -> None: ...

class RestoreReply(_message.Message):
    __slots__ = ("step", "path")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("spec", "owned_rows", "row_bytes", "state_bytes", "pulls", "pushes", "rows_pulled", "rows_pushed", "graph_version", "graph_step", "graph_k", "graph_bytes")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OWNED_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PULLS_FIELD_NUMBER: _ClassVar[int]
    PUSHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_PULLED_FIELD_NUMBER: _ClassVar[int]
    ROWS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    GRAPH_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAPH_STEP_FIELD_NUMBER: _ClassVar[int]
    GRAPH_K_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    spec: TableSpec
    owned_rows: int
    row_bytes: int
    state_bytes: int
    pulls: int
    pushes: int
    rows_pulled: int
    rows_pushed: int
    graph_version: int
    graph_step: int
    graph_k: int
    graph_bytes: int
    def __init__(self, spec: _Optional[_Union[TableSpec, _Mapping]] = ..., owned_rows: _Optional[int] = ..., row_bytes: _Optional[int] = ..., state_bytes: _Optional[int] = ..., pulls: _Optional[int] = ..., pushes: _Optional[int] = ..., rows_pulled: _Optional[int] = ..., rows_pushed: _Optional[int] = ..., graph_version: _Optional[int] = ..., graph_step: _Optional[int] = ..., graph_k: _Optional[int] = ..., graph_bytes: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("shard_id", "num_shards", "tables", "last_snapshot_step", "incarnation", "storage", "data_port")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    LAST_SNAPSHOT_STEP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STORAGE_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    num_shards: int
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    last_snapshot_step: int
    incarnation: str
    storage: str
    data_port: int
    def __init__(self, shard_id: _Optional[int] = ..., num_shards: _Optional[int] = ..., tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., last_snapshot_step: _Optional[int] = ..., incarnation: _Optional[str] = ..., storage: _Optional[str] = ..., data_port: _Optional[int] = ...) -> None: ...

class NeighborsRequest(_message.Message):
    __slots__ = ("table", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class NeighborsReply(_message.Message):
    __slots__ = ("offsets", "neighbors")
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBORS_FIELD_NUMBER: _ClassVar[int]
    offsets: Tensor
    neighbors: Tensor
    def __init__(self, offsets: _Optional[_Union[Tensor, _Mapping]] = ..., neighbors: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class SetNeighborsRequest(_message.Message):
    __slots__ = ("table", "ids", "offsets", "neighbors", "graph_version", "graph_step", "replace_all")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    NEIGHBORS_FIELD_NUMBER: _ClassVar[int]
    GRAPH_VERSION_FIELD_NUMBER: _ClassVar[int]
    GRAPH_STEP_FIELD_NUMBER: _ClassVar[int]
    REPLACE_ALL_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: Tensor
    offsets: Tensor
    neighbors: Tensor
    graph_version: int
    graph_step: int
    replace_all: bool
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[_Union[Tensor, _Mapping]] = ..., offsets: _Optional[_Union[Tensor, _Mapping]] = ..., neighbors: _Optional[_Union[Tensor, _Mapping]] = ..., graph_version: _Optional[int] = ..., graph_step: _Optional[int] = ..., replace_all: _Optional[bool] = ...) -> None: ...

class SetNeighborsReply(_message.Message):
    __slots__ = ("graph_version",)
    GRAPH_VERSION_FIELD_NUMBER: _ClassVar[int]
    graph_version: int
    def __init__(self, graph_version: _Optional[int] = ...) -> None: ...

class TakeTouchedRequest(_message.Message):
    __slots__ = ("table", "max_ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    MAX_IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    max_ids: int
    def __init__(self, table: _Optional[str] = ..., max_ids: _Optional[int] = ...) -> None: ...

class TakeTouchedReply(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: Tensor
    def __init__(self, ids: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...
