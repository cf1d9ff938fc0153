"""The gRPC reference (docs/reference/grpc.md) from proto/wqwire/pb/broker.proto: compiled by
protoc (grpcio-tools) with its source info into a descriptor set, then every service, rpc,
message (its fields: number, name, type, label) and enum rendered with the comments written
above them in the .proto."""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc_tools  # type: ignore[import-untyped]
from google.protobuf import descriptor_pb2
from grpc_tools import protoc
from ref_markdown import block, code, inline, slug, table

ROOT = Path(__file__).resolve().parents[2]
PROTO_DIR = ROOT / "proto"
SOURCE = "wqwire/pb/broker.proto"

FD = descriptor_pb2.FieldDescriptorProto
# Field numbers of the descriptor messages, for source-info paths.
_MESSAGE, _ENUM, _SERVICE, _SYNTAX = 4, 5, 6, 12
_FIELD, _NESTED, _NESTED_ENUM = 2, 3, 4
_METHOD = 2
_VALUE = 2

_SCALARS = {
    value: name.removeprefix("TYPE_").lower()
    for name, value in FD.Type.items()
    if name not in ("TYPE_MESSAGE", "TYPE_ENUM", "TYPE_GROUP")
}


def descriptor_set(
    proto_dir: Path = PROTO_DIR, source: str = SOURCE
) -> descriptor_pb2.FileDescriptorSet:
    """The .proto compiled by protoc, with its comments (``--include_source_info``)."""
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "broker.desc"
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"-I{well_known}",
            "--include_source_info",
            f"--descriptor_set_out={out}",
            source,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto_dir / source}")
        files = descriptor_pb2.FileDescriptorSet()
        files.ParseFromString(out.read_bytes())
    return files


@dataclass(frozen=True)
class Comments:
    """The comments of one file, by the source-info path of what they are about."""

    leading: dict[tuple[int, ...], str]
    detached: dict[tuple[int, ...], list[str]]

    @classmethod
    def of(cls, file: descriptor_pb2.FileDescriptorProto) -> Comments:
        leading: dict[tuple[int, ...], str] = {}
        detached: dict[tuple[int, ...], list[str]] = {}
        for loc in file.source_code_info.location:
            path = tuple(loc.path)
            text = loc.leading_comments or loc.trailing_comments
            if text and path not in leading:
                leading[path] = text
            if loc.leading_detached_comments:
                detached.setdefault(path, []).extend(loc.leading_detached_comments)
        return cls(leading, detached)

    def get(self, *path: int) -> str:
        return self.leading.get(path, "")


def markdown_of(comment: str) -> str:
    """A .proto comment as Markdown: paragraphs joined, indented lines kept as a code block."""
    lines = [line[1:] if line.startswith(" ") else line for line in comment.splitlines()]
    out: list[str] = []
    pre: list[str] = []
    para: list[str] = []

    def flush_para() -> None:
        if para:
            out.append(block(" ".join(para)))
            para.clear()

    def flush_pre() -> None:
        if pre:
            out.append("```text\n" + "\n".join(pre) + "\n```")
            pre.clear()

    for line in lines:
        if line.startswith("  ") and line.strip():
            flush_para()
            pre.append(line)
        elif not line.strip():
            flush_para()
            flush_pre()
        else:
            flush_pre()
            para.append(line.strip())
    flush_para()
    flush_pre()
    return "\n\n".join(out)


def _one_line(comment: str) -> str:
    """A comment for a table cell: one line, safe."""
    return inline(" ".join(line.strip() for line in comment.splitlines() if line.strip()))


def message_anchor(full_name: str) -> str:
    return slug("message", full_name)


def enum_anchor(full_name: str) -> str:
    return slug("enum", full_name)


def rpc_anchor(service: str, method: str) -> str:
    return slug("rpc", service, method)


class _Names:
    """Where each type of the package is described (for links), and the map entries."""

    def __init__(self, file: descriptor_pb2.FileDescriptorProto) -> None:
        self.package = file.package
        self.anchors: dict[str, str] = {}
        self.maps: dict[str, descriptor_pb2.DescriptorProto] = {}
        for name, message, _ in _messages(file.message_type, ""):
            full = f".{self.package}.{name}"
            if message.options.map_entry:
                self.maps[full] = message
            else:
                self.anchors[full] = message_anchor(name)
        for name, _, _ in _enums(file):
            self.anchors[f".{self.package}.{name}"] = enum_anchor(name)

    def type_of(self, field: descriptor_pb2.FieldDescriptorProto) -> str:
        if field.type in (FD.TYPE_MESSAGE, FD.TYPE_ENUM):
            entry = self.maps.get(field.type_name)
            if entry is not None:
                key, value = entry.field
                return f"map&lt;{self.type_of(key)}, {self.type_of(value)}&gt;"
            return self.link(field.type_name)
        return code(_SCALARS[field.type])

    def link(self, type_name: str) -> str:
        local = type_name.removeprefix(f".{self.package}.")
        anchor = self.anchors.get(type_name)
        if anchor is None:
            return code(type_name.lstrip("."))
        return f"[{local}](#{anchor})"


def _messages(
    messages: Iterable[descriptor_pb2.DescriptorProto], prefix: str, path: tuple[int, ...] = ()
) -> Iterator[tuple[str, descriptor_pb2.DescriptorProto, tuple[int, ...]]]:
    """Every message (nested ones too) with its dotted name and source-info path."""
    for i, message in enumerate(messages):
        name = f"{prefix}{message.name}"
        where = (*path, _NESTED, i) if path else (_MESSAGE, i)
        yield name, message, where
        yield from _messages(message.nested_type, f"{name}.", where)


def _enums(
    file: descriptor_pb2.FileDescriptorProto,
) -> Iterator[tuple[str, descriptor_pb2.EnumDescriptorProto, tuple[int, ...]]]:
    for i, enum in enumerate(file.enum_type):
        yield enum.name, enum, (_ENUM, i)
    for name, message, where in _messages(file.message_type, ""):
        for j, enum in enumerate(message.enum_type):
            yield f"{name}.{enum.name}", enum, (*where, _NESTED_ENUM, j)


def _label(
    field: descriptor_pb2.FieldDescriptorProto, message: descriptor_pb2.DescriptorProto
) -> str:
    if field.label == FD.LABEL_REPEATED:
        return "repeated"
    if field.proto3_optional:
        return "optional"
    if field.HasField("oneof_index"):
        return f"oneof {code(message.oneof_decl[field.oneof_index].name)}"
    return ""


def _rpc_signature(names: _Names, method: descriptor_pb2.MethodDescriptorProto) -> str:
    request = ("stream " if method.client_streaming else "") + names.link(method.input_type)
    response = ("stream " if method.server_streaming else "") + names.link(method.output_type)
    return f"{request} → {response}"


def _services(
    file: descriptor_pb2.FileDescriptorProto, names: _Names, notes: Comments
) -> list[str]:
    out: list[str] = []
    for i, service in enumerate(file.service):
        full = f"{file.package}.{service.name}"
        out += [f"## Service {service.name} {{ #{slug('service', service.name)} }}", ""]
        out += [f"Full name {code(full)}.", ""]
        comment = notes.get(_SERVICE, i)
        if comment:
            out += [markdown_of(comment), ""]
        rows = [
            [
                f"[{m.name}](#{rpc_anchor(service.name, m.name)})",
                _rpc_signature(names, m),
                _one_line(notes.get(_SERVICE, i, _METHOD, j).split("\n\n")[0]),
            ]
            for j, m in enumerate(service.method)
        ]
        out += [table(["Method", "Request → response", "Summary"], rows), ""]
        for j, method in enumerate(service.method):
            out += [f"### {method.name} {{ #{rpc_anchor(service.name, method.name)} }}", ""]
            out += [f"{code(f'/{full}/{method.name}')}: {_rpc_signature(names, method)}", ""]
            streaming = [
                side
                for side, on in (
                    ("client", method.client_streaming),
                    ("server", method.server_streaming),
                )
                if on
            ]
            if streaming:
                out += [f"Streaming: {' and '.join(streaming)}.", ""]
            comment = notes.get(_SERVICE, i, _METHOD, j)
            if comment:
                out += [markdown_of(comment), ""]
    return out


def _message_section(
    name: str,
    message: descriptor_pb2.DescriptorProto,
    where: tuple[int, ...],
    names: _Names,
    notes: Comments,
) -> list[str]:
    out = [f"### {name} {{ #{message_anchor(name)} }}", ""]
    comment = notes.get(*where)
    if comment:
        out += [markdown_of(comment), ""]
    if not message.field:
        return [*out, "No fields.", ""]
    rows = [
        [
            str(field.number),
            code(field.name),
            names.type_of(field),
            _label(field, message),
            _one_line(notes.get(*where, _FIELD, j)),
        ]
        for j, field in enumerate(message.field)
    ]
    return [*out, table(["#", "Field", "Type", "Label", "Description"], rows), ""]


def _enum_section(
    name: str, enum: descriptor_pb2.EnumDescriptorProto, where: tuple[int, ...], notes: Comments
) -> list[str]:
    out = [f"### {name} {{ #{enum_anchor(name)} }}", ""]
    comment = notes.get(*where)
    if comment:
        out += [markdown_of(comment), ""]
    rows = [
        [str(value.number), code(value.name), _one_line(notes.get(*where, _VALUE, j))]
        for j, value in enumerate(enum.value)
    ]
    return [*out, table(["#", "Name", "Description"], rows), ""]


def render(files: descriptor_pb2.FileDescriptorSet | None = None) -> str:
    """The page's generated body, from ``files`` (default: the broker's .proto, compiled)."""
    if files is None:
        files = descriptor_set()
    file = next(f for f in files.file if f.name == SOURCE)
    names = _Names(file)
    notes = Comments.of(file)
    out = [f"_Generated from {code('proto/' + file.name)}, package {code(file.package)}._", ""]
    # (the file's opening comment: above its syntax statement)
    for text in [*notes.detached.get((_SYNTAX,), []), notes.get(_SYNTAX)]:
        if text:
            out += [markdown_of(text), ""]
    out += _services(file, names, notes)
    out += ["## Messages", ""]
    for name, message, where in _messages(file.message_type, ""):
        if not message.options.map_entry:
            out += _message_section(name, message, where, names, notes)
    enums = list(_enums(file))
    if enums:
        out += ["## Enums", ""]
        for name, enum, where in enums:
            out += _enum_section(name, enum, where, notes)
    return "\n".join(out)
