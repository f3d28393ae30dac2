"""Attention heads not divisible by ``tp_size``: a named ValueError at ``prepare`` (fixes/convert/tp.py), not a bare
``shape '[2, 32, -1, 32]' is invalid`` at the first forward."""

import types

import pytest

from accel_fp8_fix.fixes.convert.tp import check_heads_divisible


def _model(**fields):
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=128, hidden_size=192, intermediate_size=256, num_hidden_layers=1, **fields)
    return types.SimpleNamespace(config=config)


def test_heads_not_divisible_by_tp_size_names_the_fields_values_and_what_to_change():
    with pytest.raises(ValueError) as info:
        check_heads_divisible(_model(num_attention_heads=6, num_key_value_heads=6), 4)
    msg = str(info.value)
    assert "num_attention_heads=6" in msg and "tp_size=4" in msg and "6 % 4 = 2" in msg
    assert "Qwen2Config" in msg and "ParallelismConfig(tp_size=...)" in msg and "(1, 2, 3, 6)" in msg


def test_kv_heads_not_divisible_is_named_alone():
    with pytest.raises(ValueError) as info:
        check_heads_divisible(_model(num_attention_heads=4, num_key_value_heads=2), 4)
    msg = str(info.value)
    assert "num_key_value_heads=2 is not a multiple of tp_size=4" in msg
    assert "num_attention_heads=4 is not" not in msg and "(1, 2)" in msg


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_divisible_heads_and_models_without_head_fields_pass(tp):
    check_heads_divisible(_model(num_attention_heads=4, num_key_value_heads=4), tp)
    check_heads_divisible(types.SimpleNamespace(), tp)  # a plain torch model: nothing to check
    check_heads_divisible(types.SimpleNamespace(config=types.SimpleNamespace(num_attention_heads=None)), tp)
