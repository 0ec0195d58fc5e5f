"""How a message is checked and packed, whatever its type: WireError, the field checks every message's
check() uses (a clear error naming the field and the limit), and the generic map ↔ dataclass conversion
that checks every field against its annotation (schemas/messages.py holds the types and their tags)."""
import dataclasses
import functools
import operator
import types
import typing

from schemas.sampling import MAX_TOKEN_ID
from schemas.subjects import token


class WireError(ValueError):
    """A message that is not valid msgpack, of an unknown type or version, or with a bad field."""


def check_name(kind: str, value: str) -> None:
    """value is a subject token (a request id, tenant or worker): WireError naming `kind` if not."""
    try:
        token(kind, value)
    except ValueError as e:
        raise WireError(str(e)[:200]) from None


def check_token_ids(name: str, ids: list[int], most: int, limit_name: str, empty: bool = False) -> None:
    if not ids and not empty:
        raise WireError(f"{name}: at least one token id is needed")
    limit(len(ids), most, name, limit_name, "token ids")
    if ids and not (min(ids) >= 0 and max(ids) <= MAX_TOKEN_ID):
        bad = next(t for t in ids if not 0 <= t <= MAX_TOKEN_ID)
        raise WireError(f"{name}: token id {bad} is outside [0, {MAX_TOKEN_ID}]")


def in_range(name: str, value: int, lo: int, hi: int) -> None:
    if not lo <= value <= hi:
        raise WireError(f"{name}: {value} is outside [{lo}, {hi}]")


def limit(n: int, most: int, name: str, limit_name: str, unit: str) -> None:
    if n > most:
        raise WireError(f"{name}: {n} {unit} is more than {limit_name}={most}")


SCALARS = frozenset({str, int, float, bool, type(None), list, dict})


def to_dict(obj) -> dict:
    names, values, nested = layout(type(obj))
    got = values(obj)
    if nested:                                    # a field that holds a dataclass: its map
        got = list(got)
        for i in nested:
            got[i] = to_wire(got[i])
    return dict(zip(names, got))


@functools.cache
def layout(cls) -> tuple[tuple[str, ...], typing.Callable, tuple[int, ...]]:
    """A message class's field names, a getter of their values (a tuple, read in C: encoding every
    token chunk goes through here) and which of them may hold a dataclass."""
    names = tuple(name for name, *_ in schema(cls))
    values = operator.attrgetter(*names) if len(names) > 1 else lambda obj: (getattr(obj, names[0]),)
    nested = tuple(i for i, (_, hint, *_) in enumerate(schema(cls)) if holds_dataclass(hint))
    return names, values, nested


def holds_dataclass(hint) -> bool:
    return dataclasses.is_dataclass(hint) or any(map(holds_dataclass, typing.get_args(hint)))


def to_wire(value):
    if type(value) in SCALARS:
        return value
    if dataclasses.is_dataclass(value):
        return to_dict(value)
    return list(value) if isinstance(value, tuple) else value


def build(cls, obj: dict, path: str):
    kwargs = {}
    for name, hint, required, exact in schema(cls):
        if name in obj:
            value = obj[name]
            kwargs[name] = value if type(value) in exact else convert(value, hint, path + name)
        elif required:
            raise WireError(f"{path + name}: missing")
    try:
        return cls(**kwargs)
    except ValueError as e:                       # a dataclass's own checks (SamplingParams)
        raise WireError(f"{path}{e}") from None


def convert(value, hint, path: str):
    """value checked against the type hint (and nested dataclasses built); WireError names the path."""
    if type(value) is hint:                       # the common case first: an exact scalar
        return value
    origin, args = shape(hint)
    if origin is list and type(value) is list and set(map(type, value)) <= {args[0]}:   # token ids: in C
        return value
    if origin is dict and type(value) is dict and set(map(type, value)) <= {args[0]} \
            and set(map(type, value.values())) <= {args[1]}:                          # timings, usage: in C
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
        elif len(args) == 2 and type(None) in args:          # X | None: X's own error names the inner field
            return convert(value, args[0] if args[1] is type(None) else args[1], path)
        for arg in args:
            try:
                return convert(value, arg, path)
            except WireError:
                pass
        raise WireError(f"{path}: {value!r} is not {type_name(hint)}")
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise WireError(f"{path}: expected a map, got {type(value).__name__}")
        return build(hint, value, path + ".")
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise WireError(f"{path}: expected a list, got {type(value).__name__}")
        return origin(convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise WireError(f"{path}: expected a map, got {type(value).__name__}")
        return {convert(k, args[0], path): convert(v, args[1], f"{path}.{k}") for k, v in value.items()}
    if hint is type(None):
        if value is not None:
            raise WireError(f"{path}: expected nil")
        return None
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise WireError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")
    return value


@functools.cache
def schema(cls) -> list[tuple[str, object, bool, frozenset]]:
    """(name, type hint, required, the types it takes as they are) of each field of a message class:
    decoding checks a scalar field's type with one set lookup (the hot path of every token chunk)."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
             exact(hints[f.name])) for f in dataclasses.fields(cls)]


def exact(hint) -> frozenset:
    """The scalar types a value of this hint may have unconverted (int is not a float, bool not an int)."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return frozenset(t for t in options if t in (str, int, float, bool, type(None)))


@functools.cache
def shape(hint) -> tuple:
    return typing.get_origin(hint), typing.get_args(hint)


def type_name(hint) -> str:
    return " | ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(hint)) or str(hint)
