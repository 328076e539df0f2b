import json

import pytest

from infer_tune.errors import SuiteError
from infer_tune.suites import SuiteSpec, _json_array_items, detect_lang, load_suite


def test_code_suite_is_humaneval():
    prompts = load_suite(SuiteSpec("code"))
    assert len(prompts) == 164
    assert prompts[0].id == "HumanEval/0"
    assert prompts[0].reference and "def " in prompts[0].text
    assert prompts[0].extra["entry_point"] == "has_close_elements"


def test_chat_suite_deterministic_by_seed():
    a = load_suite(SuiteSpec("chat", limit=5, seed=1))
    b = load_suite(SuiteSpec("chat", limit=5, seed=1))
    c = load_suite(SuiteSpec("chat", limit=5, seed=2))
    assert [p.id for p in a] == [p.id for p in b]
    assert [p.id for p in a] != [p.id for p in c]
    assert all(p.reference for p in a)
    assert all(detect_lang(p.text + " " + p.reference) == "en" for p in a)


def test_file_suite_fields(prompts_file):
    prompts = load_suite(SuiteSpec(str(prompts_file), limit=3))
    assert len(prompts) == 3 and all(p.reference for p in prompts)


def test_csv_suite_with_custom_fields(tmp_path):
    path = tmp_path / "s.csv"
    path.write_text("q,a\nwhat is 2+2?,4\nname a colour,red\n")
    prompts = load_suite(SuiteSpec(str(path), prompt_field="q", reference_field="a"))
    assert sorted(p.reference for p in prompts) == ["4", "red"]


def test_limit_zero_rejected():
    with pytest.raises(SuiteError):
        SuiteSpec("chat", limit=0)


def test_truncated_json_array_keeps_complete_records():
    text = json.dumps([{"a": 1}, {"a": 2}, {"a": 3}])[:-8]
    assert [x["a"] for x in _json_array_items(text)] == [1, 2]


def test_detect_lang():
    assert detect_lang("Hello there, how are you?") == "en"
    assert detect_lang("你好，今天天气怎么样？") == "zh"
