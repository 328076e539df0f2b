import pytest
from typer.testing import CliRunner

from infer_tune.cli import app
from infer_tune.errors import ConfigError
from infer_tune.recipe import build_protocol, build_workload, builtin_recipes, load_recipe


def test_builtin_recipes_ship_in_package():
    assert "quantize-int8" in builtin_recipes()
    recipe = load_recipe("quantize-int8")
    assert recipe.workload["suite"] == "chat"
    assert [c["technique"] for c in recipe.configs] == ["quantize", "quantize"]


def test_cli_overrides_layer_on_recipe():
    recipe = load_recipe("quantize-int8")
    workload = build_workload(recipe, {"limit": 2})
    assert workload.limit == 2 and workload.max_new_tokens == recipe.workload["max_new_tokens"]
    assert build_protocol(recipe, {}).min_iterations == recipe.protocol["min_iterations"]


@pytest.mark.parametrize("text, message", [
    ("workload: {suite: chat}\nbogus: 1\n", "unknown keys bogus"),
    ("configs:\n  - {method: int8-dynamic}\n", "needs a 'technique'"),
    ("configs:\n  - {technique: teleport}\n", "technique 'teleport'"),
    ("workload: {suitee: chat}\n", "unknown workload keys suitee"),
    ("- just\n- a list\n", "must be a mapping"),
    ("workload: [unclosed\n", "not valid YAML"),
])
def test_bad_recipes(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        recipe = load_recipe(str(path))
        build_workload(recipe, {})
        from infer_tune.recipe import build_configs

        build_configs(recipe)


def test_unknown_recipe_cli_exit_2(tmp_path):
    result = CliRunner().invoke(app, ["bench", "--recipe", "no-such-recipe", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown recipe" in result.stderr


def test_yaml_is_safe_loaded(tmp_path):
    path = tmp_path / "evil.yaml"
    path.write_text("workload: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_recipe(str(path))


def test_stages_layer_over_the_top_level_and_are_validated(tmp_path):
    from infer_tune.recipe import expand_stages

    path = tmp_path / "r.yaml"
    path.write_text("model: m1\nworkload: {suite: chat, limit: 4}\nconfigs: [{technique: quantize, method: bf16}]\n"
                    "stages:\n  - {name: code, workload: {suite: code}, configs: [{technique: kv-cache, impl: static}]}\n"
                    "  - {name: other, model: m2, configs: []}\n")
    stages = expand_stages(load_recipe(str(path)))
    assert [s.name for s in stages] == ["r", "r/code", "r/other"]
    assert stages[1].workload == {"suite": "code", "limit": 4} and stages[1].model == "m1"
    assert stages[2].model == "m2"
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n  - {name: x, colour: red}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\]: unknown keys colour"):
        expand_stages(load_recipe(str(bad)))
    typed = tmp_path / "typed.yaml"
    typed.write_text("stages:\n  - {name: x, workload: [1, 2]}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\]: workload must be a mapping"):
        expand_stages(load_recipe(str(typed)))


def test_every_builtin_recipe_builds_its_configs():
    """A shipped recipe that no longer matches a technique's fields fails here, not in a user's run."""
    from infer_tune.recipe import build_configs, expand_stages

    for name in builtin_recipes():
        for stage in expand_stages(load_recipe(name)):
            build_workload(stage, {})
            build_protocol(stage, {})
            assert build_configs(stage) or not stage.configs, (name, stage.name)
