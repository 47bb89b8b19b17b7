"""JSON schemas of the structured-output workload and checks: nested objects, arrays with
min/max items, enums, numbers with ranges, required and optional keys, string patterns.

The test suite samples against every one of them and validates the outputs with `jsonschema`;
the structured-output benchmark and the grammar-backend comparison use the same set.
"""

from __future__ import annotations

from typing import Any

PERSON: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}

ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 12},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "quantity"],
                "additionalProperties": False,
            },
        },
        "status": {"enum": ["pending", "shipped", "delivered"]},
    },
    "required": ["order_id", "items", "status"],
    "additionalProperties": False,
}

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 60},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow"]},
        "humidity": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["city", "temperature_c", "conditions"],
    "additionalProperties": False,
}

TAGS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 30},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,8}$"},
                 "minItems": 2, "maxItems": 4},
        "score": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "company": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 30},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
        "public": {"type": "boolean"},
    },
    "required": ["company", "public"],
    "additionalProperties": False,
}

MATRIX: dict[str, Any] = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 1,
            "maxItems": 2,
            "items": {"type": "array", "minItems": 2, "maxItems": 3,
                      "items": {"type": "number", "minimum": -10, "maximum": 10}},
        },
        "label": {"type": ["string", "null"], "maxLength": 10},
    },
    "required": ["rows"],
    "additionalProperties": False,
}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": PERSON, "order": ORDER, "weather": WEATHER, "tags": TAGS, "nested": NESTED,
    "matrix": MATRIX,
}
