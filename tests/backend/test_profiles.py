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
    text = load_profile("tiny").source and open(load_profile("tiny").source).read()
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


def message_for(tmp_path, **overrides):
    path = write(tmp_path, base_text(**overrides))
    with pytest.raises(ProfileError) as err:
        load_profile(str(path))
    message = str(err.value)
    assert message.startswith(f"profile {path}: field '")
    return message


def test_draft_vocab_larger_than_target_vocab(tmp_path):
    message = message_for(tmp_path, **{"draft_vocab_size = 192": "draft_vocab_size = 300"})
    assert "field 'draft.draft_vocab_size' = 300: expected at most target.vocab_size (259)" in message


def test_seq_len_beyond_the_draft_positions_or_1_shl_20(tmp_path):
    message = message_for(tmp_path, **{"seq_len = 128": "seq_len = 100000000000"})
    assert "field 'train.seq_len' = 100000000000: expected at most draft.max_position_embeddings (1024)" in message
    message = message_for(tmp_path, **{"seq_len = 128": "seq_len = 2000000", "max_position_embeddings = 1024": "max_position_embeddings = 4000000"})
    assert "field 'train.seq_len' = 2000000: expected at most 1048576 (1<<20) tokens" in message


def test_numbers_are_not_coerced_from_strings_or_floats(tmp_path):
    message = message_for(tmp_path, **{"seq_len = 128": 'seq_len = "128"'})
    assert "field 'train.seq_len' = '128': expected input should be a valid integer (a TOML number or boolean, not a quoted string)" in message
    message = message_for(tmp_path, **{"seq_len = 128": "seq_len = 1e11"})
    assert "field 'train.seq_len' = 100000000000.0: expected input should be a valid integer" in message
    message = message_for(tmp_path, **{"learning_rate = 3e-3": 'learning_rate = "3e-3"'})
    assert "field 'train.learning_rate' = '3e-3': expected input should be a valid number" in message
    message = message_for(tmp_path, **{"learning_rate = 3e-3": "learning_rate = nan"})
    assert "field 'train.learning_rate' = nan: expected input should be a finite number" in message
    message = message_for(tmp_path, **{"seed = 0": "seed = true"})
    assert "field 'train.seed' = True: expected input should be a valid integer" in message
    assert load_profile("tiny").train.learning_rate == 3e-3  # an integer-valued float field still takes 1, 2, ...


def test_sizes_must_be_positive(tmp_path):
    for field, good, bad in [
        ("target.hidden_size", "hidden_size = 128\nnum_layers", "hidden_size = 0\nnum_layers"),
        ("draft.intermediate_size", "intermediate_size = 512", "intermediate_size = -1"),
        ("draft.rms_norm_eps", "rms_norm_eps = 1e-6", "rms_norm_eps = 0.0"),
        ("draft.rope_theta", "rope_theta = 10000.0", "rope_theta = -1.0"),
        ("train.batch_size", "batch_size = 4", "batch_size = 0"),
    ]:
        message = message_for(tmp_path, **{good: bad})
        assert f"field '{field}' = " in message and "greater than 0" in message, message


def test_cross_field_errors_inside_a_section_name_the_field(tmp_path):
    message = message_for(tmp_path, **{"num_key_value_heads = 4": "num_key_value_heads = 3"})
    assert "field 'draft.num_attention_heads' = 4: expected a multiple of num_key_value_heads (3)" in message
    message = message_for(tmp_path, **{"aux_layer_ids = [1, 3, 4]": "aux_layer_ids = [4, 3, 1]"})
    assert "field 'target.aux_layer_ids' = [4, 3, 1]: expected strictly increasing layer ids" in message
