"""`tokenbus bench-structured`: a small run on SmolLM2 measures every share and compile, with every constrained
output following the schema; a cost over the goal, an output off the schema or a row that ended early fail it;
its schemas are what they say."""
import json

import jsonschema
import orjson
import pytest

from lab.benchmarks import structured as bst
from ops.cli import parser


@pytest.mark.slow
def test_a_small_run_measures_each_share_and_compile_and_every_output_follows_the_schema(smollm2, tmp_path,
                                                                                          capsys):
    path = tmp_path / "s.json"
    args = parser().parse_args(["bench-structured", "--model", smollm2, "--batch", "4", "--output-len", "12",
                                "--repeat", "1", "--large-properties", "8", "--json", str(path)])
    assert args.shares == [0, 25, 100] and args.min_items == 8
    code = bst.main(args)
    out = capsys.readouterr().out
    report = orjson.loads(path.read_bytes())
    assert [(r["share"], r["constrained_rows"]) for r in report["rows"]] == [(0, 0), (0.25, 1), (1, 4)]
    assert all(r["outputs_follow_schema"] and r["ended_early"] == 0 and r["steps"] >= 10 for r in report["rows"])
    assert [r["outputs"] for r in report["rows"]] == [0, 1, 4]
    assert report["rows"][0]["mask_ms"] < 0.5 < report["rows"][2]["mask_ms"] * 100      # no masks without rows
    assert list(report["compiles"]) == ["tokenizer info", "typical schema", "large schema (8 properties)", "regex",
                                        "longest pause beside a compile"]
    assert all(c["seconds"] > 0 for c in report["compiles"].values())
    masks = report["masks"]
    assert masks["rows"] == 4 and all(masks[k] > 0 for k in ("fill_ms", "xgrammar_apply_ms", "engine_apply_ms"))
    assert "constrained" in out and "typical schema" in out
    assert code == (1 if bst.failures(report) else 0)       # 4 rows of 12 tokens: the cost is noise, either way


def test_a_cost_over_the_goal_an_output_off_the_schema_or_an_early_end_fails_the_run():
    rows = [{"share": 0, "cost": 0.0, "outputs_follow_schema": True, "ended_early": 0},
            {"share": 1, "cost": 0.12, "outputs_follow_schema": False, "ended_early": 2}]
    missed = bst.failures({"rows": rows, "goal_cost": 0.10, "output_len": 64})
    assert missed == ["100% constrained rows cost 12.0% of the output tokens/s, more than the goal's 10%",
                      "a constrained output at 100% does not follow the schema",
                      "2 rows at 100% ended before 64 tokens"]


def test_the_schemas_are_valid_and_the_order_cannot_close_before_its_least_items():
    order, large = bst.order_schema(8), bst.large_schema(40)
    jsonschema.Draft202012Validator.check_schema(order)
    jsonschema.Draft202012Validator.check_schema(large)
    assert len(large["properties"]) == 40 and len(json.dumps(large)) > 4000
    item = {"sku": "ABC-1234", "name": "x", "qty": 1, "price": 1.5}
    whole = {"id": 1, "customer": {"name": "a", "email": "b", "tier": "pro"}, "status": "new", "items": [item] * 8}
    jsonschema.validate(whole, order)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**whole, "items": [item] * 7}, order)
    checked = bst.schema_grammar(order)
    assert bst.follows(json.dumps(whole)[:40], checked)           # xgrammar writes ", " and ": "
    assert not bst.follows('{"id": "one"', checked)
