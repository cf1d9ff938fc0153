"""The HTTP reference (docs/reference/http.md) from the broker's OpenAPI document: the same dict
``GET /openapi.json`` serves (:data:`wqbroker.http.openapi.DOCUMENT`), built in this process.

Every operation, grouped by tag: method and path, summary, description, the scope its token
needs, parameters, request body and every answer; then every component schema (its fields, their
types, constraints and descriptions, and the JSON Schema itself) and every shared response."""

from __future__ import annotations

import json
from typing import Any

from ref_markdown import block, code, inline, slug, table

Json = dict[str, Any]

_METHODS = ("get", "head", "post", "put", "patch", "delete", "options")
_SCHEMA_REF = "#/components/schemas/"
_RESPONSE_REF = "#/components/responses/"
# Constraints shown after a field's description, in this order: (keyword, label).
_CONSTRAINTS = (
    ("default", "default"),
    ("minimum", "minimum"),
    ("maximum", "maximum"),
    ("exclusiveMinimum", "above"),
    ("exclusiveMaximum", "below"),
    ("minLength", "min length"),
    ("maxLength", "max length"),
    ("minItems", "min items"),
    ("maxItems", "max items"),
    ("uniqueItems", "unique items"),
    ("pattern", "pattern"),
    ("format", "format"),
    ("examples", "examples"),
)


def operation_anchor(method: str, path: str) -> str:
    return slug(method, path)


def schema_anchor(name: str) -> str:
    return slug("schema", name)


def response_anchor(name: str) -> str:
    return slug("response", name)


def _schema_link(name: str) -> str:
    return f"[{name}](#{schema_anchor(name)})"


def type_of(schema: Json) -> str:
    """A schema's type, in a few words (Markdown, safe in a table cell): references linked."""
    if "$ref" in schema:
        return _schema_link(schema["$ref"].removeprefix(_SCHEMA_REF))
    if "const" in schema:
        return code(json.dumps(schema["const"]))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return " or ".join(type_of(s) for s in schema[key])
    kind = schema.get("type")
    if kind is None:
        return "any JSON value" if "enum" not in schema else "one of the values"
    kinds = kind if isinstance(kind, list) else [kind]
    words: list[str] = []
    for k in kinds:
        if k == "array" and "items" in schema:
            words.append(f"array of {type_of(schema['items'])}")
        else:
            words.append(k)
    return " or ".join(words)


def constraints(schema: Json) -> list[str]:
    """A field's constraints as short phrases (Markdown, safe in a table cell)."""
    out: list[str] = []
    if "enum" in schema:
        out.append("one of " + ", ".join(code(json.dumps(v)) for v in schema["enum"]))
    for key, label in _CONSTRAINTS:
        if key not in schema:
            continue
        value = schema[key]
        if key == "uniqueItems":
            if value:
                out.append(label)
            continue
        if key == "examples":
            shown = ", ".join(code(json.dumps(v)) for v in value)
        elif key in ("pattern", "format"):
            shown = code(str(value))
        else:
            shown = code(json.dumps(value))
        out.append(f"{label} {shown}")
    return out


def _describe(schema: Json) -> str:
    """A field's description and its constraints, for one table cell."""
    parts = []
    if schema.get("description"):
        parts.append(inline(schema["description"]))
    found = constraints(schema)
    if "items" in schema and isinstance(schema["items"], dict):
        found += [f"each: {c}" for c in constraints(schema["items"])]
        if schema["items"].get("description"):
            parts.append("Each: " + inline(schema["items"]["description"]))
    for alternative in schema.get("anyOf", []) + schema.get("oneOf", []):
        found += constraints(alternative)
    if found:
        parts.append("<small>" + "; ".join(found) + "</small>")
    return "<br>".join(parts)


def _field_rows(schema: Json, prefix: str = "") -> list[list[str]]:
    """One row per property (nested objects' properties as ``outer.inner``)."""
    rows: list[list[str]] = []
    required = set(schema.get("required", []))
    for name, field in schema.get("properties", {}).items():
        rows.append(
            [
                code(prefix + name),
                type_of(field),
                "yes" if name in required else "",
                _describe(field),
            ]
        )
        if "properties" in field:
            rows += _field_rows(field, f"{prefix}{name}.")
        items = field.get("items")
        if isinstance(items, dict) and "properties" in items:
            rows += _field_rows(items, f"{prefix}{name}[].")
    return rows


def _fields(schema: Json) -> str:
    rows = _field_rows(schema)
    if not rows:
        return ""
    return table(["Field", "Type", "Required", "Description"], rows)


def _raw(schema: Json) -> str:
    text = json.dumps(schema, indent=2, ensure_ascii=False)
    body = "\n".join("    " + line for line in text.splitlines())
    return f'??? note "JSON Schema"\n\n    ```json\n{body}\n    ```'


def _schema_section(name: str, schema: Json) -> str:
    out = [f"### {name} {{ #{schema_anchor(name)} }}", ""]
    if schema.get("description"):
        out += [block(schema["description"]), ""]
    if "properties" in schema:
        extra = schema.get("additionalProperties")
        out += [
            f"An object ({'no other members' if extra is False else 'other members allowed'}).",
            "",
        ]
        out += [_fields(schema), ""]
    elif "oneOf" in schema or "anyOf" in schema:
        alternatives: list[Json] = schema.get("oneOf") or schema.get("anyOf") or []
        out += ["One of:", ""]
        for i, alternative in enumerate(alternatives, 1):
            fields = _fields(alternative)
            out += [f"**{i}.** {type_of(alternative)}", ""]
            if alternative.get("description"):
                out += [block(alternative["description"]), ""]
            if fields:
                out += [fields, ""]
    else:
        out += [f"Type: {type_of(schema)}.", ""]
        found = constraints(schema)
        if found:
            out += ["Constraints: " + "; ".join(found) + ".", ""]
    out += [_raw(schema), ""]
    return "\n".join(out)


def _body_of(content: Json) -> str:
    """The media types of a body and their schemas, in a few words."""
    parts = []
    for media, value in content.items():
        schema = value.get("schema")
        shown = code(media)
        if schema is not None:
            shown += ": " + type_of(schema)
        parts.append(shown)
    return "; ".join(parts)


def _security(operation: Json) -> str:
    security = operation.get("security")
    if not security:
        return "none: open to every client, with or without a token file."
    scopes = [s for alternative in security for s in alternative.get("bearer", [])]
    if not scopes:
        return "any valid token (with `-token-file`)."
    return (
        "a token with the " + " or ".join(code(s) for s in scopes) + " scope (with `-token-file`)."
    )


def _parameter_rows(parameters: list[Json]) -> list[list[str]]:
    rows = []
    for p in parameters:
        schema = p.get("schema", {})
        rows.append(
            [
                code(p["name"]),
                p["in"],
                type_of(schema),
                "yes" if p.get("required") else "",
                _describe({**schema, "description": p.get("description", "")}),
            ]
        )
    return rows


def _response_rows(responses: Json, components: Json) -> list[list[str]]:
    rows = []
    for status, answer in responses.items():
        if "$ref" in answer:
            name = answer["$ref"].removeprefix(_RESPONSE_REF)
            answer = components["responses"][name]
            text = f"[{name}](#{response_anchor(name)}): " + inline(answer["description"])
        else:
            text = inline(answer.get("description", ""))
        headers = ", ".join(code(h) for h in answer.get("headers", {}))
        if headers:
            text += f"<br><small>headers: {headers}</small>"
        links = ", ".join(code(link) for link in answer.get("links", {}))
        if links:
            text += f"<br><small>links: {links}</small>"
        rows.append([code(status), text, _body_of(answer.get("content", {}))])
    return rows


def _operation(method: str, path: str, operation: Json, components: Json) -> str:
    out = [
        f"### `{method.upper()} {path}` {{ #{operation_anchor(method, path)} }}",
        "",
        f"**{inline(operation.get('summary', ''))}**"
        + (
            f" (operation id {code(operation['operationId'])})"
            if "operationId" in operation
            else ""
        ),
        "",
    ]
    if operation.get("description"):
        out += [block(operation["description"]), ""]
    out += [f"**Token:** {_security(operation)}", ""]
    parameters = operation.get("parameters", [])
    if parameters:
        header = ["Parameter", "In", "Type", "Required", "Description"]
        out += ["**Parameters**", "", table(header, _parameter_rows(parameters)), ""]
    body = operation.get("requestBody")
    if body is not None:
        required = "required" if body.get("required") else "optional"
        out += [f"**Request body** ({required}): {_body_of(body.get('content', {}))}", ""]
        if body.get("description"):
            out += [block(body["description"]), ""]
    rows = _response_rows(operation.get("responses", {}), components)
    out += ["**Responses**", "", table(["Status", "Meaning", "Body"], rows), ""]
    return "\n".join(out)


def operations(document: Json) -> list[tuple[str, str, Json]]:
    """Every (method, path, operation) of ``document``, in the document's order."""
    return [
        (method, path, item[method])
        for path, item in document["paths"].items()
        for method in _METHODS
        if method in item
    ]


def render(document: Json | None = None) -> str:
    """The page's generated body, from ``document`` (default: the broker's own)."""
    if document is None:
        from wqbroker.http.openapi import DOCUMENT

        document = DOCUMENT
    components = document.get("components", {})
    info = document["info"]
    out = [
        f"_{inline(info['title'])}, OpenAPI {document['openapi']}, document version "
        f"{inline(str(info['version']))}._",
        "",
        block(info.get("description", "")),
        "",
    ]
    schemes = components.get("securitySchemes", {})
    for name, scheme in schemes.items():
        out += [
            f"**Security scheme {code(name)}** ({scheme.get('type')}, {scheme.get('scheme')}): "
        ]
        out += ["", block(scheme.get("description", "")), ""]
    ops = operations(document)
    tags = [t["name"] for t in document.get("tags", [])]
    tags += sorted({tag for _, _, op in ops for tag in op.get("tags", [])} - set(tags))
    descriptions = {t["name"]: t.get("description", "") for t in document.get("tags", [])}
    # An index of every operation, then each operation under its tag.
    rows = [
        [
            f"[`{method.upper()} {path}`](#{operation_anchor(method, path)})",
            inline(op.get("summary", "")),
            inline((op.get("tags") or [""])[0]),
        ]
        for method, path, op in ops
    ]
    out += ["## Operations", "", table(["Operation", "Summary", "Group"], rows), ""]
    for tag in tags:
        tagged = [(m, p, op) for m, p, op in ops if tag in op.get("tags", [])]
        if not tagged:
            continue
        out += [f"## {tag.capitalize()} {{ #{slug('tag', tag)} }}", ""]
        if descriptions.get(tag):
            out += [block(descriptions[tag]), ""]
        out += [_operation(m, p, op, components) for m, p, op in tagged]
    untagged = [(m, p, op) for m, p, op in ops if not op.get("tags")]
    if untagged:
        out += ["## Other operations", ""]
        out += [_operation(m, p, op, components) for m, p, op in untagged]
    out += ["## Schemas", ""]
    out += [_schema_section(name, s) for name, s in components.get("schemas", {}).items()]
    out += ["## Shared responses", ""]
    for name, answer in components.get("responses", {}).items():
        out += [f"### {name} {{ #{response_anchor(name)} }}", "", block(answer["description"]), ""]
        body = _body_of(answer.get("content", {}))
        if body:
            out += [f"Body: {body}", ""]
        headers = answer.get("headers", {})
        if headers:
            rows = [
                [code(h), type_of(v.get("schema", {})), inline(v.get("description", ""))]
                for h, v in headers.items()
            ]
            out += [table(["Header", "Type", "Description"], rows), ""]
    return "\n".join(out)
