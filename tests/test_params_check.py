"""The fast params check agrees with jsonschema, the authority, on what it accepts."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validators

from gateway.loading import parse_config

SHIPPED = Path(__file__).resolve().parents[1] / "triggers.yaml"
SCHEMAS = """
version: 1
workflows:
  shapes:
    steps: [a]
    params_schema:
      type: object
      required: [n]
      additionalProperties: false
      properties:
        n: {type: integer, minimum: 0, exclusiveMaximum: 10}
        s: {type: string, pattern: "^[a-z]+$", maxLength: 5}
        tags: {type: array, items: {enum: [x, y]}, uniqueItems: true}
        either: {anyOf: [{type: string}, {type: "null"}]}
  referenced:
    steps: [a]
    params_schema:
      $defs: {n: {type: integer}}
      type: object
      properties: {n: {$ref: "#/$defs/n"}}
"""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 20) | st.floats(-5, 20, allow_nan=False)
    | st.sampled_from(["", "abc", "ABC", "abcdefg", "x", "y"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                 max_size=3),
    max_leaves=8,
)  # fmt: skip
params = st.dictionaries(st.sampled_from(["n", "s", "tags", "either", "other"]), json_values)

ENV = {"GITHUB_WEBHOOK_SECRET": "x", "STRIPE_WEBHOOK_SECRET": "x", "REALM_TRIGGER_TOKEN": "x"}
CONFIGS = [parse_config(SCHEMAS, with_triggers=False),
           parse_config(SHIPPED.read_text(), with_triggers=False, env=ENV)]  # fmt: skip
WORKFLOWS = [wf for config in CONFIGS for wf in config.workflows.values() if wf.params_schema]


def test_plain_schemas_get_the_fast_check_and_references_do_not():
    by_name = {wf.name: wf for wf in WORKFLOWS}
    assert by_name["shapes"]._fast_check is not None
    assert by_name["deploy"]._fast_check is not None
    assert by_name["referenced"]._fast_check is None


@settings(max_examples=400, deadline=None)
@given(params=params)
def test_the_fast_check_and_jsonschema_agree(params):
    for wf in WORKFLOWS:
        authority = validators.validator_for(wf.params_schema)(wf.params_schema)
        assert (wf.params_errors(params) == []) == authority.is_valid(params), (wf.name, params)
