"""A model's default sampling parameters (schemas/generation.py): where they are read from, and how they fill
what a request leaves unset."""
import json

import pytest

from schemas import generation
from schemas.sampling import SamplingParams

RECOMMENDED = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}


def model_dir(tmp_path, config: dict | None = None, stamp: dict | None = None):
    if config is not None:
        (tmp_path / generation.CONFIG).write_text(json.dumps(config))
    if stamp is not None:
        (tmp_path / generation.STAMP).write_text(json.dumps(stamp))
    return tmp_path


def test_auto_takes_every_sampling_field_the_generation_config_sets_and_nothing_else(tmp_path):
    d = model_dir(tmp_path, {"eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                             "min_p": None, "max_new_tokens": 100})
    assert generation.load(d) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    assert generation.load(d, "none") == {}


def test_a_catalogue_model_whose_files_set_none_has_its_entry_s_from_its_pull_stamp(tmp_path):
    d = model_dir(tmp_path, {"eos_token_id": 2}, {"name": "smollm2-135m-instruct", "sampling": RECOMMENDED})
    assert generation.load(d) == RECOMMENDED
    (d / generation.CONFIG).write_text(json.dumps({"temperature": 0.7}))     # the files' own win
    assert generation.load(d) == {"temperature": 0.7}


def test_a_model_with_no_generation_config_and_no_stamp_has_no_defaults(tmp_path):
    assert generation.load(tmp_path) == {} == generation.load(model_dir(tmp_path, {"bos_token_id": 1}))


def test_a_file_or_a_directory_given_replaces_the_model_s_own(tmp_path):
    (tmp_path / "other").mkdir()
    other = model_dir(tmp_path / "other", {"temperature": 0.6})
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"top_k": -1, "repetition_penalty": 1.3}))
    assert generation.load(tmp_path, str(mine)) == {"top_k": 0, "repetition_penalty": 1.3}  # as SamplingParams has it
    assert generation.load(tmp_path, str(other)) == {"temperature": 0.6}


@pytest.mark.parametrize("content, message", [
    ('{"temperature": -1}', "temperature must be 0 (greedy) or in"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ("[1, 2]", "not a JSON object"),
    ("{", "cannot be read (JSONDecodeError"),
])
def test_a_generation_config_sampling_cannot_take_is_refused_naming_the_file_and_the_field(tmp_path, content,
                                                                                         message):
    path = tmp_path / "g.json"
    path.write_text(content)
    with pytest.raises(ValueError) as e:
        generation.load(tmp_path, str(path))
    assert str(e.value).startswith(f"generation config {path}: ") and message in str(e.value)
    with pytest.raises(ValueError, match="cannot be read"):
        generation.load(tmp_path, str(tmp_path / "missing.json"))


def test_unset_fields_get_the_defaults_and_set_ones_keep_their_value_even_when_it_is_sampling_params_own():
    p = SamplingParams(temperature=1.0, max_tokens=5)
    generation.fill(p, {"temperature", "max_tokens"}, RECOMMENDED)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.top_k, p.max_tokens) == (1.0, 0.9, 1.1, 0, 5)
    p = SamplingParams()
    generation.fill(p, (), RECOMMENDED)
    assert (p.temperature, p.top_p, p.repetition_penalty) == (0.2, 0.9, 1.1)


def test_a_greedy_request_stays_plain_greedy_but_a_model_whose_default_is_greedy_gets_the_rest():
    p = SamplingParams(temperature=0)
    generation.fill(p, {"temperature"}, RECOMMENDED)
    assert p == SamplingParams(temperature=0)
    p = SamplingParams()
    generation.fill(p, (), {"temperature": 0.0, "repetition_penalty": 1.2})
    assert (p.temperature, p.repetition_penalty) == (0.0, 1.2)


def test_the_defaults_are_shown_in_one_line():
    assert generation.shown({"temperature": 0.2, "top_k": 40}) == "temperature 0.2, top_k 40"
    assert generation.shown({}) == "none"
