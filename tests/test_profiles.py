"""Profiles load into typed objects; a wrong or missing field names file, field, value and expectation."""
import pytest

from backend.profiles import ProfileError, available_profiles, default_aux_layer_ids, load_profile


def test_shipped_profiles_load():
    assert {"tiny", "llama3.1-8b", "kimi-k2.5"} <= set(available_profiles())
    for name in available_profiles():
        assert load_profile(name).name == name


def test_kimi_facts():
    kimi = load_profile("kimi-k2.5")
    assert (kimi.target.hidden_size, kimi.target.num_layers, kimi.target.vocab_size) == (7168, 61, 163840)
    assert kimi.target.aux_layer_ids == [1, 29, 57]
    assert kimi.target.aux_width == 21504
    assert kimi.serve.tp_size == 8


def test_llama_facts():
    llama = load_profile("llama3.1-8b")
    assert (llama.target.hidden_size, llama.target.num_layers, llama.target.vocab_size) == (4096, 32, 128256)
    assert llama.target.aux_layer_ids == [1, 15, 28] == default_aux_layer_ids(32)


def test_tiny_uses_default_aux_ids():
    tiny = load_profile("tiny")
    assert tiny.target.aux_layer_ids == default_aux_layer_ids(tiny.target.num_layers)
    assert tiny.target.num_layers >= 8


def write(tmp_path, text):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    return path


def base_text(**overrides):
    text = (load_profile("tiny").source and open(load_profile("tiny").source).read())
    for old, new in overrides.items():
        text = text.replace(old, new)
    return text


def test_wrong_type_names_file_field_value_and_expectation(tmp_path):
    path = write(tmp_path, base_text(**{"hidden_size = 128\nnum_layers": 'hidden_size = "wide"\nnum_layers'}))
    with pytest.raises(ProfileError) as err:
        load_profile(str(path))
    message = str(err.value)
    assert str(path) in message and "target.hidden_size" in message and "'wide'" in message and "integer" in message


def test_missing_field_is_named(tmp_path):
    path = write(tmp_path, base_text(**{"vocab_size = 259\n": ""}))
    with pytest.raises(ProfileError, match=r"target\.vocab_size' is missing"):
        load_profile(str(path))


def test_aux_ids_out_of_range(tmp_path):
    path = write(tmp_path, base_text(**{"aux_layer_ids = [1, 3, 4]": "aux_layer_ids = [1, 3, 9]"}))
    with pytest.raises(ProfileError, match=r"aux layer id 9 is outside 0\.\.7"):
        load_profile(str(path))


def test_unknown_field_and_bad_toml(tmp_path):
    path = write(tmp_path, base_text(**{"[serve]\n": "[serve]\nspeculative_algo = 'EAGLE'\n"}))
    with pytest.raises(ProfileError, match=r"serve.speculative_algo' = 'EAGLE' is not a known field"):
        load_profile(str(path))
    path.write_text("name = [unclosed")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_profile(str(path))


def test_unknown_profile_lists_known_ones():
    with pytest.raises(ProfileError, match="known profiles: .*tiny"):
        load_profile("no-such-profile")
