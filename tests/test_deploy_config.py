"""The deployment schema refuses what it would otherwise have to override."""

import pytest

from deploy.config import ConfigError, parse_config


@pytest.mark.parametrize("field", ["num_threads", "tensor_parallel_size"])
def test_per_role_engine_fields_are_refused_under_engine(field):
    with pytest.raises(ConfigError, match=rf"engine.{field}: set it per role in a deployment \(prefill.{field}"):
        parse_config({"engine": {field: 2}})
    roles = {"prefill": {"replicas": 0}, "decode": {"replicas": 0}, "aggregated": {"replicas": 1, field: 2}}
    assert getattr(parse_config(roles).aggregated, field) == 2


def test_a_dumped_config_parses_again():
    """Launchers hand workers the config as YAML with every field listed, defaults included."""
    config = parse_config({"engine": {"num_kv_blocks": 64}, "decode": {"replicas": 2, "num_threads": 1}})
    assert parse_config(config.model_dump()) == config
