from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_SHARD: _ClassVar[Role]
    ROLE_WORKER: _ClassVar[Role]

class LeaseStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LEASE_STATUS_UNSPECIFIED: _ClassVar[LeaseStatus]
    LEASE_ALIVE: _ClassVar[LeaseStatus]
    LEASE_EXPIRED: _ClassVar[LeaseStatus]
    LEASE_UNKNOWN: _ClassVar[LeaseStatus]
ROLE_UNSPECIFIED: Role
ROLE_SHARD: Role
ROLE_WORKER: Role
LEASE_STATUS_UNSPECIFIED: LeaseStatus
LEASE_ALIVE: LeaseStatus
LEASE_EXPIRED: LeaseStatus
LEASE_UNKNOWN: LeaseStatus

class RegisterRequest(_message.Message):
    __slots__ = ("role", "slot", "address", "incarnation", "rejoin")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REJOIN_FIELD_NUMBER: _ClassVar[int]
    role: Role
    slot: int
    address: str
    incarnation: str
    rejoin: bool
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., slot: _Optional[int] = ..., address: _Optional[str] = ..., incarnation: _Optional[str] = ..., rejoin: _Optional[bool] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("lease_id", "ttl_ms", "generation")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_ms: int
    generation: int
    def __init__(self, lease_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("status", "generation")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    status: LeaseStatus
    generation: int
    def __init__(self, status: _Optional[_Union[LeaseStatus, str]] = ..., generation: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class ShardsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShardsReply(_message.Message):
    __slots__ = ("num_shards", "addresses", "incarnations", "generation", "complete")
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    INCARNATIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    num_shards: int
    addresses: _containers.RepeatedScalarFieldContainer[str]
    incarnations: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    complete: bool
    def __init__(self, num_shards: _Optional[int] = ..., addresses: _Optional[_Iterable[str]] = ..., incarnations: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., complete: _Optional[bool] = ...) -> None: ...
