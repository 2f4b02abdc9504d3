"""`bench structured`'s schemas: the workload's six JSON schemas (each with a prompt that asks
for it and one valid instance), the two non-JSON specs, and the probe's never-seen schemas
(`typical_schema`, `heavy_schema`) that miss the engine's grammar cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    """A JSON schema of the workload, a prompt that asks for it, and one valid instance (the
    backend measurement walks the instance's tokens; the tests validate it)."""

    name: str
    schema: dict[str, Any]
    prompt: str
    example: dict[str, Any]

    @property
    def schema_text(self) -> str:
        return json.dumps(self.schema, separators=(",", ":"))


_NAME = {"type": "string", "minLength": 1, "maxLength": 24}

# Every string, array and number is bounded, so a small model under the grammar always reaches
# the closing brace within the bench's max_tokens.
SCHEMAS: tuple[SchemaCase, ...] = (
    SchemaCase(
        "person",
        {"type": "object",
         "properties": {"name": _NAME,
                        "age": {"type": "integer", "minimum": 0, "maximum": 120},
                        "email": {"type": "string",
                                  "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org|net)$"}},
         "required": ["name", "age", "email"], "additionalProperties": False},
        "Describe a person as a JSON object with name, age and email.",
        {"name": "Ada Lovelace", "age": 36, "email": "ada@math.org"}),
    SchemaCase(
        "address",
        {"type": "object",
         "properties": {"name": _NAME,
                        "address": {"type": "object",
                                    "properties": {"street": {"type": "string", "maxLength": 32},
                                                   "city": _NAME,
                                                   "zip": {"type": "string",
                                                           "pattern": "^[0-9]{5}$"}},
                                    "required": ["street", "city", "zip"],
                                    "additionalProperties": False},
                        "country": {"enum": ["US", "FR", "DE", "JP"]}},
         "required": ["name", "address", "country"], "additionalProperties": False},
        "Give a customer's mailing address as a JSON object.",
        {"name": "Bob", "address": {"street": "12 Elm St", "city": "Springfield",
                                    "zip": "12345"}, "country": "US"}),
    SchemaCase(
        "order",
        {"type": "object",
         "properties": {"order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
                        "items": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "object",
                                            "properties": {
                                                "sku": {"type": "string",
                                                        "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                                                "qty": {"type": "integer", "minimum": 1,
                                                        "maximum": 9}},
                                            "required": ["sku", "qty"],
                                            "additionalProperties": False}},
                        "status": {"enum": ["pending", "shipped", "delivered"]}},
         "required": ["order_id", "items", "status"], "additionalProperties": False},
        "Write a shop order as a JSON object with an id, its items and a status.",
        {"order_id": 1042, "items": [{"sku": "ABC-1234", "qty": 2},
                                     {"sku": "XYZ-0001", "qty": 1}], "status": "shipped"}),
    SchemaCase(
        "event",
        {"type": "object",
         "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 40},
                        "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                        "tags": {"type": "array", "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 12}},
                        "priority": {"enum": ["low", "medium", "high"]}},
         "required": ["title", "date", "priority"], "additionalProperties": False},
        "Describe a calendar event as a JSON object with a title, date, tags and priority.",
        {"title": "Team offsite", "date": "2026-03-14", "tags": ["work", "travel"],
         "priority": "high"}),
    SchemaCase(
        "product",
        {"type": "object",
         "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                        "name": _NAME,
                        "in_stock": {"type": "boolean"},
                        "dimensions": {"type": "object",
                                       "properties": {
                                           "width": {"type": "integer", "minimum": 1,
                                                     "maximum": 500},
                                           "height": {"type": "integer", "minimum": 1,
                                                      "maximum": 500}},
                                       "required": ["width", "height"],
                                       "additionalProperties": False}},
         "required": ["id", "name", "in_stock", "dimensions"], "additionalProperties": False},
        "Describe a product in a catalogue as a JSON object.",
        {"id": 77, "name": "Desk lamp", "in_stock": True,
         "dimensions": {"width": 20, "height": 45}}),
    SchemaCase(
        "review",
        {"type": "object",
         "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                        "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                        "summary": {"type": "string", "maxLength": 60},
                        "recommend": {"type": "boolean"}},
         "required": ["sentiment", "stars", "summary", "recommend"],
         "additionalProperties": False},
        "Summarise a product review as a JSON object with sentiment, stars and a summary.",
        {"sentiment": "positive", "stars": 4, "summary": "Works well, a bit loud.",
         "recommend": True}),
)

# The backend measurement's two non-JSON specs (the engine's ``regex`` and ``choice`` kinds).
REGEX_SPEC = ("regex", "\\([0-9]{3}\\) [0-9]{3}-[0-9]{4}", "(555) 123-4567")
CHOICE_SPEC = ("choice", json.dumps(["positive", "negative", "neutral"]), "neutral")


def heavy_schema(tag: int, fields: int = 150) -> str:
    """A schema that takes tens of ms to compile (``fields`` string properties with patterns
    and as many enums, all required); ``tag`` goes into every name, so each probe misses the
    engine's grammar cache."""
    props: dict[str, Any] = {}
    for i in range(fields):
        props[f"f{tag}_{i}"] = {"type": "string",
                                "pattern": f"^[a-z]{{2,8}}-[0-9]{{{1 + i % 4}}}(x|y|z{i})$"}
        props[f"e{tag}_{i}"] = {"enum": [f"v{j}_{i}" for j in range(12)]}
    return json.dumps({"type": "object", "properties": props, "required": list(props),
                       "additionalProperties": False})


def typical_schema(tag: int) -> str:
    """One of `SCHEMAS` with an optional property named after ``tag``: a schema of the
    workload's size that the engine's grammar cache has never seen."""
    case = SCHEMAS[tag % len(SCHEMAS)]
    schema = json.loads(case.schema_text)
    schema["properties"][f"note_{tag}"] = {"type": "string", "maxLength": 8}
    return json.dumps(schema, separators=(",", ":"))

