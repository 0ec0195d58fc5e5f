"""python -m lab.benchmarks.chat_tokens, small: every turn's tokens with the history kept equal the whole encode
(the run stops otherwise), each turn's history is found kept, and the report has a row per turn."""
import json

from lab.benchmarks import chat_tokens


def test_a_small_run_keeps_each_history_and_reports_each_turn(tiny_model, capsys):
    chat_tokens.main(["--model", tiny_model, "--conversations", "2", "--turns", "3", "--system-len", "100",
                      "--user-len", "40", "--reply-len", "30", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["exact"] and [r["turn"] for r in report["turns"]] == [1, 2, 3]
    # encoded once each: the system prompt, every user message, every reply but the last turn's (never re-sent);
    # kept: a turn's whole history but the reply just appended (the first conversation's system prompt, turn 1)
    assert report["misses"] == 1 + 2 * (3 + 2) and report["hits"] == (2 - 1) + 2 * (2 + 4)
    prompts = [r["prompt_tokens"] for r in report["turns"]]
    assert prompts == sorted(prompts) and all(r["kept_ms"] > 0 and r["whole_ms"] > 0 for r in report["turns"])
