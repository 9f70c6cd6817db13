"""benchmarks.structured's checks without a cluster: what counts as a valid answer, the ITL it
measures (D's gaps only), and the table listing every invalid answer."""

from __future__ import annotations

import json

import jsonschema

from benchmarks.structured import _an_answer, _itl_s, invalid_reason, table, varied_schemas


def test_the_schemas_vary_and_each_has_an_answer() -> None:
    schemas = varied_schemas(100)
    assert len({json.dumps(s, sort_keys=True) for s in schemas}) == 100
    for schema in schemas:
        jsonschema.validate(_an_answer(schema), schema)


def test_only_a_complete_answer_of_the_schema_is_valid() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert invalid_reason('{"a":1}', "stop", schema) is None
    assert "finish_reason 'length'" in invalid_reason('{"a":1', "length", schema)
    assert invalid_reason('{"a":"x"}', "stop", schema) == "'x' is not of type 'integer'"
    assert invalid_reason('{"a":', "stop", schema).startswith("Expecting value")


def test_itl_leaves_out_the_first_gap_and_failures_are_listed() -> None:
    assert _itl_s([0.0, 1.0, 1.5, 2.0]) == 0.5  # P's token to D's first (1 s) left out
    assert _itl_s([0.0, 1.0]) is None
    result = {"count": 2, "sent": {"whole": 1, "streamed": 1},
              "valid": {"whole": 1, "streamed": 0}, "failures": ["schema 1 (streamed): cut"],
              "itl_schema": [0.004], "itl_plain": []}  # fmt: skip
    text = table(result, (50.0, 0.61), "cmd")
    assert "| 1 + 1 | 1 + 0 | 4.00 | - | 50 | 0.61 |" in text
    assert text.endswith("- schema 1 (streamed): cut\n")
