"""The alias and persistence contract, serialised inside standard ONNX messages.

onnxkv declares how values share storage with fields the ONNX schema does not
define.  They are written as protobuf fields numbered ≥ 1000 directly on the
standard messages, so ``onnx.save``/``onnx.load`` keep them (protobuf keeps
unknown fields) and ONNX Runtime ignores them.  This module is the only place
that reads or writes them.

=================  ======  ===================  =========================================
message            number  name                 wire payload
=================  ======  ===================  =========================================
``NodeProto``      1000    output_alias         repeated ``OutputAlias`` message:
                                                1 output_index (varint),
                                                2 input_index (varint),
                                                3 kind (varint enum: 1 = MUST_ALIAS)
``ValueInfoProto`` 1000    access               varint enum: 1 = READ_ONLY, 2 = READ_WRITE
``ValueInfoProto`` 1001    alias_of             string: name of the aliased input
``GraphProto``     1000    persistent_bindings  repeated ``PersistentBinding`` message:
                                                1 input name (string), 2 output name (string)
=================  ======  ===================  =========================================

Meaning: an ``output_alias`` entry says node output ``output_index`` *is* the
storage of node input ``input_index`` (``MUST_ALIAS``: written in place, no
allocation, never a silent copy).  ``alias_of`` states the same on the
output's ``ValueInfoProto``.  ``access`` marks a graph input as read-only or
as writable in place.  A persistent binding ``input <- output`` feeds the
output of one run as that input of the next.  :func:`onnxkv.model.checker.check_model`
enforces the rules; this module only stores and reads.

Getters read protobuf's unknown-field set of the message itself (the
``google.protobuf.unknown_fields`` module), so looking up a graph's bindings
never serialises its weights.  Setters replace the onnxkv fields of a message
and keep everything else, including other tools' unknown fields.
When a message already carries onnxkv fields, replacing them re-parses that
message: references to its sub-messages taken before the call (for example
``node = graph.node[0]`` before ``set_persistent_bindings(graph, ...)``) then
no longer point into it.  Getters raise :class:`ContractError` naming the
message when a stored field is malformed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import onnx
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from onnxkv.errors import ContractError
from onnxkv.model import _wire

__all__ = [
    "ContractError",
    "MUST_ALIAS",
    "OutputAlias",
    "Access",
    "Contract",
    "set_output_alias",
    "get_output_alias",
    "set_access",
    "get_access",
    "set_alias_of",
    "get_alias_of",
    "set_persistent_bindings",
    "get_persistent_bindings",
    "describe_node",
    "alias_value_names",
    "has_declarations",
]

NODE_OUTPUT_ALIAS = 1000
VALUE_ACCESS = 1000
VALUE_ALIAS_OF = 1001
GRAPH_PERSISTENT_BINDINGS = 1000

_NODE_FIELDS = frozenset({NODE_OUTPUT_ALIAS})
_VALUE_FIELDS = frozenset({VALUE_ACCESS, VALUE_ALIAS_OF})
_GRAPH_FIELDS = frozenset({GRAPH_PERSISTENT_BINDINGS})

MUST_ALIAS = "MUST_ALIAS"
_KIND_CODES = {MUST_ALIAS: 1}
_KIND_NAMES = {code: name for name, code in _KIND_CODES.items()}


@dataclass(frozen=True)
class OutputAlias:
    """Node output ``output_index`` shares the storage of node input ``input_index``."""

    output_index: int
    input_index: int
    kind: str = MUST_ALIAS

    def __post_init__(self) -> None:
        for name in ("output_index", "input_index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"OutputAlias: {name} must be a non-negative int, got {value!r}")
        if self.kind not in _KIND_CODES:
            raise ValueError(f"OutputAlias: unknown kind {self.kind!r} (expected one of {sorted(_KIND_CODES)})")


class Access(enum.Enum):
    """How a graph input may be used: only read, or written in place."""

    READ_ONLY = 1
    READ_WRITE = 2


def describe_node(node: onnx.NodeProto, index: int | None = None) -> str:
    """A short label for error messages: the node's name, or its position, op and outputs."""
    op = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
    if node.name:
        return f"node {node.name!r} ({op})"
    where = f"#{index} " if index is not None else ""
    return f"node {where}({op} -> {list(node.output)})"


def _describe_value(value_info: onnx.ValueInfoProto) -> str:
    return f"value {value_info.name!r}"


def _describe_graph(graph: onnx.GraphProto) -> str:
    return f"graph {graph.name!r}"


# -- raw field access ---------------------------------------------------------------------------


def _read(message: Message, numbers: frozenset[int], label: str) -> list[_wire.Field]:
    """The onnxkv fields (numbers in ``numbers``) stored on ``message``, in order."""
    fields = []
    for item in UnknownFieldSet(message):
        if item.field_number in numbers:
            if item.wire_type not in (_wire.VARINT, _wire.LEN):
                raise ContractError(
                    f"{label}: onnxkv field {item.field_number} has unexpected wire type {item.wire_type}"
                )
            fields.append(_wire.Field(item.field_number, item.wire_type, item.data))
    return fields


def _write(message: Message, numbers: frozenset[int], fields: list[_wire.Field]) -> None:
    """Replace the onnxkv fields ``numbers`` of ``message`` by ``fields``."""
    if _has_fields(message, numbers):
        message.ParseFromString(_wire.strip_fields(message.SerializeToString(), numbers))
    if fields:
        message.MergeFromString(_wire.encode_fields(fields))


def has_declarations(message: onnx.NodeProto | onnx.ValueInfoProto | onnx.GraphProto) -> bool:
    """Whether ``message`` carries any onnxkv field (well-formed or not)."""
    numbers = {onnx.NodeProto: _NODE_FIELDS, onnx.ValueInfoProto: _VALUE_FIELDS, onnx.GraphProto: _GRAPH_FIELDS}
    return _has_fields(message, numbers[type(message)])


def _has_fields(message: Message, numbers: frozenset[int]) -> bool:
    return any(item.field_number in numbers for item in UnknownFieldSet(message))


def _expect(item: _wire.Field, wire_type: int, label: str, what: str) -> int | bytes:
    if item.wire_type != wire_type:
        raise ContractError(f"{label}: {what} has wire type {item.wire_type}, expected {wire_type}")
    return item.value


def _decode(payload: bytes, label: str, what: str) -> list[_wire.Field]:
    try:
        return _wire.decode_fields(payload)
    except ValueError as exc:
        raise ContractError(f"{label}: malformed {what}: {exc}") from None


def _text(payload: bytes, label: str, what: str) -> str:
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        raise ContractError(f"{label}: {what} is not valid UTF-8") from None


# -- NodeProto.output_alias ---------------------------------------------------------------------


def set_output_alias(node: onnx.NodeProto, aliases: Iterable[OutputAlias]) -> None:
    """Declare ``node``'s output aliases, replacing any; an empty list removes them.

    Raises ValueError when an entry is not an :class:`OutputAlias` or two entries
    name the same output index.
    """
    aliases = list(aliases)
    seen = set()
    for alias in aliases:
        if not isinstance(alias, OutputAlias):
            raise ValueError(f"set_output_alias: expected OutputAlias entries, got {alias!r}")
        if alias.output_index in seen:
            raise ValueError(f"set_output_alias: output index {alias.output_index} is declared twice")
        seen.add(alias.output_index)
    fields = [
        _wire.Field(
            NODE_OUTPUT_ALIAS,
            _wire.LEN,
            _wire.encode_fields(
                [
                    _wire.Field(1, _wire.VARINT, alias.output_index),
                    _wire.Field(2, _wire.VARINT, alias.input_index),
                    _wire.Field(3, _wire.VARINT, _KIND_CODES[alias.kind]),
                ]
            ),
        )
        for alias in aliases
    ]
    _write(node, _NODE_FIELDS, fields)


def get_output_alias(node: onnx.NodeProto) -> list[OutputAlias]:
    """The output aliases declared on ``node`` (empty when none)."""
    label = describe_node(node)
    aliases = []
    for item in _read(node, _NODE_FIELDS, label):
        values = {1: None, 2: None, 3: None}
        for sub in _decode(_expect(item, _wire.LEN, label, "output_alias"), label, "output_alias"):
            if sub.number in values:
                values[sub.number] = _expect(sub, _wire.VARINT, label, f"output_alias field {sub.number}")
        output_index, input_index, kind = values[1], values[2], values[3]
        if output_index is None or input_index is None:
            raise ContractError(f"{label}: output_alias entry lacks its output or input index")
        if kind not in _KIND_NAMES:
            raise ContractError(f"{label}: output_alias kind {kind} is unknown (expected 1 = MUST_ALIAS)")
        aliases.append(OutputAlias(output_index, input_index, _KIND_NAMES[kind]))
    return aliases


def alias_value_names(node: onnx.NodeProto, alias: OutputAlias, index: int | None = None) -> tuple[str, str]:
    """The (output, input) value names ``alias`` links on ``node``; ContractError when either is missing.

    ``index`` (the node's position in its graph) only improves the message.
    """
    label = describe_node(node, index)
    if alias.output_index >= len(node.output) or not node.output[alias.output_index]:
        raise ContractError(
            f"{label}: output_alias names output {alias.output_index}, but the node has no such "
            f"output (outputs: {list(node.output)})"
        )
    if alias.input_index >= len(node.input) or not node.input[alias.input_index]:
        raise ContractError(
            f"{label}: output_alias names input {alias.input_index}, but the node has no such "
            f"input (inputs: {list(node.input)})"
        )
    return node.output[alias.output_index], node.input[alias.input_index]


# -- ValueInfoProto.access and alias_of ---------------------------------------------------------


def _value_fields(value_info: onnx.ValueInfoProto) -> dict[int, _wire.Field]:
    """The value's onnxkv fields by number; a repeated scalar field keeps its last value (protobuf rule)."""
    return {item.number: item for item in _read(value_info, _VALUE_FIELDS, _describe_value(value_info))}


def _set_value_field(value_info: onnx.ValueInfoProto, item: _wire.Field | None, number: int) -> None:
    fields = {n: f for n, f in _value_fields(value_info).items() if n != number}
    if item is not None:
        fields[number] = item
    _write(value_info, _VALUE_FIELDS, [fields[n] for n in sorted(fields)])


def set_access(value_info: onnx.ValueInfoProto, access: Access | str | None) -> None:
    """Declare the value's access (an :class:`Access` or its name); None removes it."""
    if isinstance(access, str) and access in Access.__members__:
        access = Access[access]
    if access is not None and not isinstance(access, Access):
        raise ValueError(f"set_access: unknown access {access!r} (expected READ_ONLY or READ_WRITE)")
    item = None if access is None else _wire.Field(VALUE_ACCESS, _wire.VARINT, access.value)
    _set_value_field(value_info, item, VALUE_ACCESS)


def get_access(value_info: onnx.ValueInfoProto) -> Access | None:
    """The declared access of the value, or None."""
    item = _value_fields(value_info).get(VALUE_ACCESS)
    if item is None:
        return None
    label = _describe_value(value_info)
    code = _expect(item, _wire.VARINT, label, "access")
    try:
        return Access(code)
    except ValueError:
        raise ContractError(f"{label}: access {code} is unknown (expected 1 = READ_ONLY or 2 = READ_WRITE)") from None


def set_alias_of(value_info: onnx.ValueInfoProto, name: str | None) -> None:
    """Declare that the value aliases the input ``name``; None removes the declaration."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"set_alias_of: expected a non-empty value name, got {name!r}")
    item = None if name is None else _wire.Field(VALUE_ALIAS_OF, _wire.LEN, name.encode("utf-8"))
    _set_value_field(value_info, item, VALUE_ALIAS_OF)


def get_alias_of(value_info: onnx.ValueInfoProto) -> str | None:
    """The name of the input the value aliases, or None."""
    item = _value_fields(value_info).get(VALUE_ALIAS_OF)
    if item is None:
        return None
    label = _describe_value(value_info)
    name = _text(_expect(item, _wire.LEN, label, "alias_of"), label, "alias_of")
    if not name:
        raise ContractError(f"{label}: alias_of is empty")
    return name


# -- GraphProto.persistent_bindings -------------------------------------------------------------


def set_persistent_bindings(graph: onnx.GraphProto, bindings: Mapping[str, str]) -> None:
    """Declare ``{input name: output name}`` bindings, replacing any; an empty mapping removes them."""
    fields = []
    for input_name, output_name in bindings.items():
        for name in (input_name, output_name):
            if not isinstance(name, str) or not name:
                raise ValueError(f"set_persistent_bindings: expected non-empty value names, got {name!r}")
        fields.append(
            _wire.Field(
                GRAPH_PERSISTENT_BINDINGS,
                _wire.LEN,
                _wire.encode_fields(
                    [
                        _wire.Field(1, _wire.LEN, input_name.encode("utf-8")),
                        _wire.Field(2, _wire.LEN, output_name.encode("utf-8")),
                    ]
                ),
            )
        )
    _write(graph, _GRAPH_FIELDS, fields)


def get_persistent_bindings(graph: onnx.GraphProto) -> dict[str, str]:
    """The graph's bindings ``{input name: output name}`` (empty when none)."""
    label = _describe_graph(graph)
    bindings: dict[str, str] = {}
    for item in _read(graph, _GRAPH_FIELDS, label):
        names = {1: "", 2: ""}
        for sub in _decode(_expect(item, _wire.LEN, label, "persistent_bindings"), label, "persistent binding"):
            if sub.number in names:
                what = f"persistent binding field {sub.number}"
                names[sub.number] = _text(_expect(sub, _wire.LEN, label, what), label, what)
        input_name, output_name = names[1], names[2]
        if not input_name or not output_name:
            raise ContractError(f"{label}: persistent binding {input_name!r} <- {output_name!r} lacks a name")
        if input_name in bindings:
            raise ContractError(
                f"{label}: input {input_name!r} is bound twice (<- {bindings[input_name]!r} and <- {output_name!r})"
            )
        bindings[input_name] = output_name
    return bindings


# -- the whole model ----------------------------------------------------------------------------


def _value_infos(graph: onnx.GraphProto) -> Iterable[tuple[str, onnx.ValueInfoProto]]:
    for where in ("input", "output", "value_info"):
        for value_info in getattr(graph, where):
            yield f"graph.{where}", value_info


@dataclass
class Contract:
    """Every contract declaration of a model's main graph.

    Attributes:
        output_aliases: node index in ``graph.node`` -> its output aliases.
        access: value name -> declared access.
        alias_of: value name -> name of the input it aliases.
        persistent_bindings: graph input name -> graph/node output name.
    """

    output_aliases: dict[int, list[OutputAlias]] = field(default_factory=dict)
    access: dict[str, Access] = field(default_factory=dict)
    alias_of: dict[str, str] = field(default_factory=dict)
    persistent_bindings: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> Contract:
        """Read the declarations of ``model.graph``.

        A value listed more than once (``graph.input``/``output``/``value_info``)
        must not carry different declarations; ContractError otherwise.
        """
        graph = model.graph
        contract = cls(persistent_bindings=get_persistent_bindings(graph))
        for index, node in enumerate(graph.node):
            aliases = get_output_alias(node)
            if aliases:
                contract.output_aliases[index] = aliases
        origin: dict[tuple[str, str], str] = {}
        for where, value_info in _value_infos(graph):
            for kind, value, table in (
                ("access", get_access(value_info), contract.access),
                ("alias_of", get_alias_of(value_info), contract.alias_of),
            ):
                if value is None:
                    continue
                name = value_info.name
                if name in table and table[name] != value:
                    raise ContractError(
                        f"value {name!r}: {kind} is {_show(table[name])} in "
                        f"{origin[kind, name]} but {_show(value)} in {where}"
                    )
                table[name] = value
                origin.setdefault((kind, name), where)
        return contract

    def apply(self, model: onnx.ModelProto) -> None:
        """Replace every declaration of ``model.graph`` by this contract's.

        Access and alias_of go on every ``ValueInfoProto`` of the value in the
        main graph; a value listed nowhere gets a new ``graph.value_info`` entry
        holding only its name.
        """
        graph = model.graph
        for index in self.output_aliases:
            if not 0 <= index < len(graph.node):
                raise ValueError(f"Contract.apply: node index {index} out of range (graph has {len(graph.node)} nodes)")
        set_persistent_bindings(graph, self.persistent_bindings)
        for index, node in enumerate(graph.node):
            set_output_alias(node, self.output_aliases.get(index, []))
        listed = {value_info.name for _, value_info in _value_infos(graph)}
        for name in sorted((self.access.keys() | self.alias_of.keys()) - listed):
            graph.value_info.add().name = name
        for _, value_info in _value_infos(graph):
            set_access(value_info, self.access.get(value_info.name))
            set_alias_of(value_info, self.alias_of.get(value_info.name))


def _show(value: Access | str) -> str:
    return value.name if isinstance(value, Access) else repr(value)
