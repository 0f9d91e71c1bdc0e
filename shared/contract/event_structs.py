"""decode()'s fast path: msgspec Structs generated from the event models, which check an entry's body while
msgpack is decoded, in C.

Validating a small event's body with pydantic costs about as much as the rest of consuming it. msgspec checks
the same field types and bounds while it decodes, several times faster, and the models are then made from its
values without validating them again. The models stay the contract: each Struct is generated from its model's
fields, so no check is written twice, and a body that a Struct refuses goes through the model's own
validation, which either accepts it (pydantic's lax coercions: a str of digits for an int) or says what is
wrong, as it always did. The fast path changes how fast an entry decodes, never whether it does or what it
decodes to; only `model_fields_set` names every field (as for a body that encode() wrote, which has them all).
The Envelope around a payload is a Struct itself: a body decodes, in one pass, to an Envelope holding the
payload's Struct, which the model made from it then replaces before anyone holds the envelope.

A model gets a fast path only when every field and check of it is one this module translates (`_wire_type`):
int, float, str, bool, None, Any, Literal, unions, lists and maps of them, a nested model, `ge`,
`allow_inf_nan=False`, a packed token array (its own validator runs on the bytes), and model validators that
run after the fields (they run on the made model), in a frozen model that forbids extra fields. Anything else
(a `before` validator, a field validator, a new kind of constraint) leaves the model on pydantic alone, as
`fast_decoder` then returns None.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import msgspec
from annotated_types import Ge
from pydantic import BaseModel, PlainSerializer, PlainValidator, SerializeAsAny
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_asdict = msgspec.structs.asdict
_force_setattr = msgspec.structs.force_setattr

FLOAT_MAX = sys.float_info.max
"""Within ±FLOAT_MAX a float is finite: msgspec's bounds refuse NaN and ±inf outside it."""
_PLAIN = (int, float, str, bool, type(None))
_SERIALIZATION_ONLY = (PlainSerializer, SerializeAsAny)

_new = object.__new__
_set_dict = BaseModel.__dict__["__dict__"].__set__
_set_fields_set = BaseModel.__dict__["__pydantic_fields_set__"].__set__
_set_extra = BaseModel.__dict__["__pydantic_extra__"].__set__
_set_private = BaseModel.__dict__["__pydantic_private__"].__set__


def _maker(model: type[BaseModel], checked: list[tuple[str, Callable[[Any], Any]]],
           nested: list[tuple[str, Callable[[msgspec.Struct], BaseModel]]],
           after: list[Callable[[Any], Any]]) -> Callable[[msgspec.Struct], BaseModel]:
    """A function making a `model` from its Struct, as the model's validation would have made it. `checked`:
    fields whose model validator runs on the wire's value (a packed token array's, on its bytes); `nested`:
    fields that hold a model, with its maker; `after`: the model's validators that run on the made model."""
    # One set for every model made: pydantic changes a model's set only where a field is assigned, which a
    # frozen model refuses first (_struct_and_maker makes no Struct for a model that is not frozen)
    fields_set = set(model.model_fields)
    finish = [*checked, *nested]

    def make(struct: msgspec.Struct) -> BaseModel:
        values = _asdict(struct)
        for name, function in finish:
            values[name] = function(values[name])
        made = _new(model)
        _set_dict(made, values)
        _set_fields_set(made, fields_set)
        _set_extra(made, None)
        _set_private(made, None)
        for validator in after:
            validator(made)
        return made

    return make


def fast_decoder(event: type[BaseModel], envelope: type[msgspec.Struct]) -> Callable[[bytes], Any] | None:
    """A function from a msgpack body to an `envelope` (the contract's generic Envelope Struct) holding an
    `event` (a model with the class variables TYPE and VERSION, which the envelope's `type` and
    `schema_version` must be), or to None where the body is not one that the Structs accept (the model's own
    validation must then say); None when the model has a field or check this module does not translate (each
    raises a TypeError that says which)."""
    try:
        struct, make = _struct_and_maker(event)
        decode = msgspec.msgpack.Decoder(envelope[struct]).decode
    except TypeError:  # a field or check no Struct expresses (msgspec's own: a union it cannot tell apart)
        return None
    type_and_version = (event.TYPE, event.VERSION)

    def fast_decode(body: bytes) -> msgspec.Struct | None:
        try:
            decoded = decode(body)
            if (decoded.type, decoded.schema_version) != type_and_version:
                return None
            # The envelope is frozen, but no one holds it yet: its payload's Struct becomes the model here
            _force_setattr(decoded, "payload", make(decoded.payload))
        # Whatever the Struct, a packed array's check or an after validator raises: the model's validation
        # decides, so that no entry can make the fast path raise what decode() did not raise before it
        except Exception:
            return None
        return decoded

    return fast_decode


def validated_model(kind: type, value: Any) -> BaseModel:
    """msgspec's hook for a field that holds a model (the Envelope's payload, where the fast path did not
    take a body): the model's own validation, lax coercions and errors and all."""
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return kind.model_validate(value)
    raise TypeError(f"no decoding for {kind!r}")


def _struct_and_maker(model: type[BaseModel]) -> tuple[type[msgspec.Struct],
                                                       Callable[[msgspec.Struct], BaseModel]]:
    """`model`'s Struct and the function making a `model` of one; TypeError for what no Struct expresses."""
    decorators = model.__pydantic_decorators__
    if decorators.field_validators or decorators.validators or decorators.root_validators or any(
            validator.info.mode != "after" for validator in decorators.model_validators.values()):
        raise TypeError(f"{model.__name__} has validators that run on its input")
    config = model.model_config
    if config.get("strict") or config.get("extra") != "forbid" or not config.get("frozen"):
        raise TypeError(f"{model.__name__} is strict, takes extra fields or is not frozen")
    fields, checked, nested = [], [], []
    for name, info in model.model_fields.items():
        if info.alias or info.validation_alias:
            raise TypeError(f"{model.__name__}.{name} has an alias")
        if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
            if not all(isinstance(item, _SERIALIZATION_ONLY) for item in _flattened(info.metadata)):
                raise TypeError(f"{model.__name__}.{name} is a model with checks of its own")
            struct, maker = _struct_and_maker(info.annotation)
            wire, check = struct, None
            nested.append((name, maker))
        else:
            wire, check = _wire_type(info.annotation, info.metadata)
        if check is not None:
            checked.append((name, check))
        if info.default_factory is not None:
            fields.append((name, wire, msgspec.field(default_factory=info.default_factory)))
        elif info.default is not PydanticUndefined:
            if not isinstance(info.default, (*_PLAIN, tuple, frozenset)):  # pydantic copies a mutable default
                raise TypeError(f"{model.__name__}.{name} has a mutable default")
            fields.append((name, wire, info.default))
        else:
            fields.append((name, wire))
    # gc=False: a Struct lives only until its model is made from it, and holds no cycle for the collector
    struct = msgspec.defstruct(f"{model.__name__}Wire", fields, kw_only=True, forbid_unknown_fields=True,
                               gc=False)
    after = [validator.func for validator in decorators.model_validators.values()]
    return struct, _maker(model, checked, nested, after)


def _wire_type(annotation: Any, metadata: list | tuple = ()) -> tuple[Any, Callable[[Any], Any] | None]:
    """The msgspec type that checks what `annotation` with `metadata` checks, and the model's validator of the
    value where the field has one (a PlainValidator, which the Struct leaves to run on the wire's bytes)."""
    bounds: dict[str, Any] = {}
    for item in _flattened(metadata):
        if isinstance(item, PlainValidator):
            return bytes, item.func
        if isinstance(item, Ge):
            bounds["ge"] = item.ge
        elif type(item).__name__ == "AllowInfNan" and not item.allow_inf_nan and annotation is float:
            bounds.update(ge=-FLOAT_MAX, le=FLOAT_MAX)
        elif not isinstance(item, _SERIALIZATION_ONLY):
            raise TypeError(f"no msgspec check for {item!r}")
    origin = get_origin(annotation)
    if origin is Annotated:
        base, *extra = get_args(annotation)
        return _wire_type(base, [*metadata, *extra])
    if origin in (Union, types.UnionType):
        members = tuple(_checked_free(arg) for arg in get_args(annotation))
        wire = Union[members]  # noqa: UP007 (a union of types made at run time)
    elif origin is list:
        wire = list[_checked_free(*get_args(annotation))]
    elif origin is dict:
        key, value = get_args(annotation)
        wire = dict[_checked_free(key), _checked_free(value)]
    elif origin is Literal or annotation in _PLAIN or annotation is Any:
        wire = annotation
    else:
        raise TypeError(f"no msgspec type for {annotation!r}")
    return (Annotated[wire, msgspec.Meta(**bounds)] if bounds else wire), None


def _flattened(metadata: list | tuple) -> list:
    """Metadata with an Annotated's FieldInfo (`Annotated[int, Field(ge=0)]` inside a list) opened up."""
    flat = []
    for item in metadata:
        if isinstance(item, FieldInfo):
            if item.alias or item.validation_alias or item.default is not PydanticUndefined:
                raise TypeError(f"no msgspec type for {item!r}")
            flat.extend(_flattened(item.metadata))
        else:
            flat.append(item)
    return flat


def _checked_free(annotation: Any) -> Any:
    """The msgspec type of a type inside a container or union, where a validator of its own cannot run."""
    wire, check = _wire_type(annotation)
    if check is not None:
        raise TypeError(f"a validated type inside {annotation!r}")
    return wire
